"""The scripts that measure this template itself, each printing a table measured side by side in one run: every
strategy against the others, train.py against a hand-written DDP loop and against transformers' Trainer
(scripts/benchmark.py, scripts/peer_benchmark.py, scripts/trainer_peer.py), and the probes
behind the docs' figures (saves, host memory while loading, the data paths, a profile, launches under stress, the CPU
optimizer step). No hooks: training never calls them. See docs/benchmarks.md."""

from training.parts import Part


class Benchmarks(Part):
    name = "benchmarks"
    description = "the scripts that measure this template: strategies side by side, train.py against raw DDP, profiles"
    files = ("scripts/benchmark.py", "scripts/raw_ddp.py", "scripts/peer_benchmark.py", "scripts/trainer_peer.py",
             "scripts/save_benchmark.py", "scripts/loading_memory.py",
             "scripts/data_benchmark.py", "scripts/profile_run.py", "scripts/stress_launch.py",
             "scripts/cpu_optimizer_step.py", "docs/scaling.png")


PART = Benchmarks()
