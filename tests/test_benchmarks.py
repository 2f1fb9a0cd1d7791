"""scripts/benchmark.py runs from the README and measures what it claims."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from models.configs import build_named_config
from models.language import build_tokenizer
from tests import forked_launcher
from tests.harness import REPO
from training.parts import installed

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

# ZeRO-2's and FSDP2's model-state layouts in bf16; ZeRO-3's (and DDP's, ZeRO-1's, offload's): tests/test_effective_config.py
CONFIGS = ("deepspeed_zero2", "fsdp")


def forked_launch(command: list[str], env: dict[str, str], log) -> forked_launcher.Launcher:
    """scripts/benchmark.py's `start_launch`, run by the suite's forked launcher (tests/forked_launcher.py)."""
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"], command
    return forked_launcher.start(command[3:], env, REPO, Path(log.name), fork_ranks=True)


def run_benchmark(out: Path, *flags: str, as_user: bool = False) -> dict:
    """scripts/benchmark.py with `flags`; its table, JSON figures and figure. By default its `main` in this
    process, its launches of train.py forked; `as_user`: the script as a user runs it, every launch a new
    interpreter (the data table's test)."""
    from scripts import benchmark

    argv = [*flags, "--warmup", "2", "--output", str(out / "table.md"), "--json", str(out / "results.json"),
            "--plot", str(out / "figure.png")]
    if as_user:
        result = subprocess.run([sys.executable, "scripts/benchmark.py", *argv], cwd=REPO, capture_output=True,
                                text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    else:
        environment = dict(os.environ)  # as a script, the benchmark may set its own (--data: one thread)
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(benchmark, "start_launch", forked_launch)
                benchmark.main(argv)
        finally:
            os.environ.clear()
            os.environ.update(environment)
    return {"table": (out / "table.md").read_text(), "plot": out / "figure.png", **json.loads((out / "results.json").read_text())}


@pytest.fixture(scope="module")
def benchmark(tmp_path_factory) -> dict:
    """The main table: train.py under each config, then train.py against raw DDP (scripts/raw_ddp.py, new
    interpreters under torchrun) and the data preparation rate."""
    return run_benchmark(tmp_path_factory.mktemp("benchmark"), "--model_config", "llama-tiny", "--configs", *CONFIGS,
                         "--steps", "8", "--log_every", "2", "--rounds", "1", "--per_device_train_batch_size", "4",
                         "--block_size", "64")


def test_every_strategy_gets_a_row_of_figures_recomputed_from_what_train_py_logged(benchmark) -> None:
    """Each row: medians over the intervals train.py logged after --warmup 2 (steps 4, 6 and 8 of 8, logged
    every 2), FLOPs per token of the model built here, and MFU from the logged tokens/s and peak FLOP/s."""
    for config in CONFIGS:
        run = benchmark["strategies"][config]
        assert [m["step"] for m in run["intervals"]] == [4, 6, 8] and run["processes"] == 2
        assert_figures_follow_the_logged_intervals(run, run["intervals"], block_size=64)
        if installed("mfu"):
            assert run["mfu"] == run["steady_mfu"]  # train.py's own median over the same intervals
        mfu = f"{run['mfu']:.1%}" if installed("mfu") else "n/a"
        shown = (f"| {config} | 2 | {run['tokens_per_sec']:,.0f} | {run['step_time'] * 1000:,.0f} | {mfu} | "
                 f"{run['time_to_first_step']:.1f} | {run['peak_memory_gb'] * 1024:,.0f} | ")
        assert shown in benchmark["table"] and run["time_to_first_step"] > 0
    ours, raw = benchmark["train_py_tokens_per_sec"], benchmark["raw_ddp_tokens_per_sec"]
    assert len(ours) == len(raw) == 1 and benchmark["train_py_over_raw"] == pytest.approx(ours[0] / raw[0])
    intervals, = benchmark["train_py_intervals"]  # tokens over time after the warm-up, as raw_ddp.py reports its own
    assert [m["step"] for m in intervals] == [4, 6, 8]
    assert ours[0] == pytest.approx(3 / sum(1 / m["tokens_per_sec"] for m in intervals))  # equal tokens per interval
    assert f"| 1 | {ours[0]:,.0f} | {raw[0]:,.0f} | {ours[0] / raw[0]:.3f} |" in benchmark["table"]
    assert f"{benchmark['data_preparation_tokens_per_sec']:,.0f} tokens/s" in benchmark["table"]


def assert_figures_follow_the_logged_intervals(row: dict, intervals: list[dict], block_size: int,
                                               vocabulary: int | None = None) -> int:
    """A row's tokens/s, step time and MFU are the medians of its logged intervals; its FLOPs per token are
    6N + 12·L·d·T of llama-tiny (at `vocabulary`) built here; each interval's MFU is its tokens/s x those
    FLOPs / its peak FLOP/s (parts/mfu: without it, no MFU). Returns the model's vocabulary."""
    overrides = f"max_position_embeddings={block_size}" + (f",vocab_size={vocabulary}" if vocabulary else "")
    model = AutoModelForCausalLM.from_config(build_named_config("llama-tiny", build_tokenizer(None, None), overrides))
    config = model.config
    matmul = sum(p.numel() for p in model.parameters()) - model.get_input_embeddings().weight.numel()
    assert row["flops_per_token"] == 6 * matmul + 12 * config.num_hidden_layers * config.hidden_size * block_size
    assert row["tokens_per_sec"] == statistics.median(m["tokens_per_sec"] for m in intervals)
    assert row["step_time"] == statistics.median(m["step_time"] for m in intervals)
    if not installed("mfu"):
        assert "mfu" not in row and not any("mfu" in m for m in intervals)
        return config.vocab_size
    for m in intervals:
        assert m["mfu"] == pytest.approx(m["tokens_per_sec"] * row["flops_per_token"] / m["peak_flops"])
    assert row["mfu"] == pytest.approx(statistics.median(m["mfu"] for m in intervals))
    return config.vocab_size


@pytest.mark.parts("memory_plan")
def test_measured_model_state_matches_the_memory_planner(benchmark) -> None:
    """bf16, 2 processes: what each rank holds, counted from its tensors, within 10% of
    scripts/plan_memory.py (fp32, every config: tests/test_memory_plan.py)."""
    for config in CONFIGS:
        run = benchmark["strategies"][config]
        assert run["model_state_bytes"] == pytest.approx(run["planned_bytes"], rel=0.10), config


@pytest.fixture(scope="module")
def fine_tuning(tmp_path_factory) -> dict:
    # one process: the table's code path, at the cost of one process per run (every config trains LoRA: test_fine_tuning.py)
    return run_benchmark(tmp_path_factory.mktemp("fine-tuning"), "--fine_tuning", "--model_config", "llama-tiny",
                         "--configs", "ddp", "--num_processes", "1", "--steps", "6", "--log_every", "2",
                         "--per_device_train_batch_size", "4", "--block_size", "64")


@pytest.mark.parts("lora", "sft")
def test_the_fine_tuning_table_sets_lora_against_full_fine_tuning(fine_tuning) -> None:
    """LoRA trains the same model with gradients and optimizer state for the adapter alone."""
    assert "| ddp |" in fine_tuning["table"]
    full, lora = (fine_tuning["fine_tuning"]["ddp"][kind] for kind in ("full", "lora"))
    assert full["tokens_per_sec"] > 0 and lora["tokens_per_sec"] > 0
    full_state, lora_state = full["model_state_bytes_per_rank"], lora["model_state_bytes_per_rank"]
    # the frozen base is still there, sharded alike, and the adapter beside it
    assert full["parameters"] < lora["parameters"] < 1.25 * full["parameters"]
    assert full_state["parameters"] < lora_state["parameters"] < 1.25 * full_state["parameters"]
    for part in ("gradients", "optimizer"):
        assert 0 < lora_state[part] < 0.25 * full_state[part], part


HOOKS = ("allreduce", "fp16", "power_sgd", "batched_power_sgd")  # power_sgd's resume and loss: test_compression


@pytest.mark.parts("compression")
def test_the_compression_table_counts_the_bytes_each_hook_sends(tmp_path) -> None:
    """Counted by the hook's wrapper: DDP's all-reduce sends every fp32 gradient, fp16 half of that, PowerSGD
    (from step 2 of 6) low-rank factors for the matrices after its first plain step. llama-small's 14 MB of
    gradients fill several of DDP's buckets, where torch's PowerSGD hooks deadlock on gloo unless train.py
    gives them one (a hang here would end at the timeout)."""
    short = "--model_config llama-small --max_steps 6 --block_size 32 --per_device_train_batch_size 2 " \
            "--logging_steps 2 --eval_steps 6 --max_eval_samples 8"
    figures = run_benchmark(tmp_path, "--compression", "--hooks", *HOOKS, "--power_sgd_start_step", "2",
                            "--train_flags", short)
    runs = figures["compression"]
    sent = {hook: runs[hook]["gradient_allreduce_bytes_per_step"] for hook in HOOKS}
    assert sent["allreduce"] == runs["allreduce"]["parameters"] * 4
    assert sent["fp16"] == sent["allreduce"] / 2
    for hook in ("power_sgd", "batched_power_sgd"):
        assert sent["allreduce"] * 2 / 6 < sent[hook] < sent["allreduce"] * 0.4, hook  # 2 plain steps of 6
    for hook in HOOKS:
        assert f"| {hook} |" in figures["table"] and runs[hook]["tokens_per_sec"] > 0 and runs[hook]["steps"] == 6
    assert runs["fp16"]["train_loss"] == pytest.approx(runs["allreduce"]["train_loss"], rel=1e-3)
    assert figures["plot"].stat().st_size > 10_000


def test_the_scaling_table_sets_each_process_count_against_one(tmp_path) -> None:
    figures = run_benchmark(tmp_path, "--scaling", "--configs", "ddp", "--processes", "1", "2", "--model_config",
                            "llama-tiny", "--steps", "6", "--log_every", "2", "--per_device_train_batch_size", "4",
                            "--block_size", "64")
    one, two = (figures["scaling"]["ddp"][str(n)] for n in (1, 2))
    assert one["processes"] == 1 and two["processes"] == 2 and one["speedup"] == 1
    assert two["speedup"] == pytest.approx(two["tokens_per_sec"] / one["tokens_per_sec"])
    assert two["efficiency"] == pytest.approx(two["speedup"] / 2)
    assert "| ddp | " in figures["table"] and "| 100% / " in figures["table"] and figures["plot"].stat().st_size > 10_000


@pytest.mark.parts("pipeline")
def test_the_pipeline_table_sets_schedules_against_a_naive_layer_split(tmp_path) -> None:
    figures = run_benchmark(tmp_path, "--pipeline", "--model_config", "llama-tiny", "--steps", "5", "--log_every", "1",
                            "--per_device_train_batch_size", "4", "--block_size", "32", "--microbatches", "2",
                            "--schedules", "1F1B")  # GPipe: tests/test_pipeline.py
    runs = figures["pipeline"]
    assert list(runs) == ["naive split", "1F1B m=2"]
    assert runs["naive split"]["theory"] == 1 / 2 and runs["1F1B m=2"]["theory"] == 1 / 3
    for name, run in runs.items():
        assert f"| {name.split(' m=')[0]} |" in figures["table"] and run["tokens_per_sec"] > 0 and run["processes"] == 2
        assert 0 < run["bubble"] < 1, name  # from when each stage computed each micro-batch
    assert figures["plot"].stat().st_size > 10_000


@pytest.mark.parts("distillation")
def test_the_distillation_table_sets_a_taught_student_against_one_alone(tmp_path, base_model) -> None:
    """The same student and steps, alone and taught (here by the suite's base model: the documented table trains
    the default job as its teacher); the eval loss along the way, and the teacher's weights reported apart. One
    process: the table's code path, at the cost of one process per run (every config distils: test_distillation.py)."""
    figures = run_benchmark(tmp_path, "--distillation", "--teacher", str(base_model), "--steps", "4", "--log_every", "2",
                            "--per_device_train_batch_size", "4", "--configs", "ddp", "--num_processes", "1")
    runs = figures["distillation"]
    assert runs["teacher"] == str(base_model)
    for name in ("alone", "distilled"):
        assert f"| {name} |" in figures["table"] and runs[name]["steps"] == 4 and runs[name]["tokens_per_sec"] > 0
    assert runs["distilled"]["teacher_state_bytes_per_rank"]["parameters"] > 0
    assert "teacher_state_bytes_per_rank" not in runs["alone"]
    assert runs["distilled"]["eval_loss"] != runs["alone"]["eval_loss"]
    assert figures["plot"].stat().st_size > 10_000


@pytest.mark.parts("streaming", "pretokenized")
def test_the_data_table_sets_each_data_path_against_what_training_consumes(tmp_path) -> None:
    """The script as a user runs it (every launch new interpreters: its one training run, scripts/prepare_data.py)."""
    figures = run_benchmark(tmp_path, "--data", "--corpus_mb", "1", "--data_batches", "10", "--steps", "4",
                            "--log_every", "2", as_user=True)
    table, data = figures["table"], figures["data"]
    assert data["corpus_bytes"] >= 2**20 and data["consumed_tokens_per_sec"] > 0
    for path in ("in memory", "streaming", "pre-tokenised"):
        assert data["delivered_tokens_per_sec"][path] > 0 and f"| {path} |" in table
    assert {1, 2} == {run["num_proc"] for run in data["prepare"].values()}
    assert all(run["tokens"] > 0 and run["tokens_per_sec"] > 0 for run in data["prepare"].values())


def test_the_profile_names_where_each_step_goes_without_a_train_py_edit(tmp_path) -> None:
    """scripts/profile_run.py runs train.py unchanged under torch.profiler, advanced by torch's optimizer-step hook:
    the table lists the operators by time and the kinds add up to the profiled total, the phases to the steps' time;
    train.py ends as usual.
    Its attention ran on the backends allowed (`--sdpa_backends`): CPU's flash kernel."""
    from tests.harness import TINY_RUN, launch

    result = launch("single", "scripts/profile_run.py", "--skip_steps", "2", "--profile_steps", "2", "--top", "30",
                    "--sdpa_backends", "flash", "math",  # on CPU as torch would choose anyway
                    "--json", str(tmp_path / "profile.json"), *TINY_RUN, "--max_steps", "5", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    profile = json.loads((tmp_path / "profile.json").read_text())
    assert sum(profile["kinds"].values()) == pytest.approx(profile["ms_per_step"])
    assert profile["kinds"]["matmul"] > 0 and profile["kinds"]["optimizer"] > 0  # aten::mm, the fused AdamW
    assert "| aten::_scaled_dot_product_flash_attention_for_cpu | attention |" in result.stdout  # not the math one
    assert len(profile["top"]) == 30 and [t["ms"] for t in profile["top"]] == sorted((t["ms"] for t in profile["top"]), reverse=True)
    assert f"CPU operators: {profile['ms_per_step']:,.1f} ms per step over 2 step(s)" in result.stdout
    for kind, ms in profile["kinds"].items():
        assert f"| {kind} | {ms:,.2f} | {ms / profile['ms_per_step']:.1%} |" in result.stdout
    # the step by phase: each phase's time and the rest add up to the steps' own; forward and backward measured
    phases = profile["phases"]
    assert sum(ms for phase, ms in phases["phases"].items() if phase != "output_layer") == pytest.approx(
        phases["ms_per_step"])
    assert all(phases["phases"][phase] > 0 for phase in ("forward", "backward", "optimizer", "data", "output_layer"))
    assert phases["phases"]["output_layer"] < phases["phases"]["forward"]  # a part of it
    assert phases["host_syncs_per_step"].get("aten::_fused_adamw_", 0) > 0  # CPU's fused AdamW reads its step count
    assert f"| forward | {phases['phases']['forward']:,.2f} |" in result.stdout
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == 5  # the run itself went on to its end


@pytest.mark.quick
def test_the_mfu_table_is_refused_in_one_line_without_its_part(monkeypatch) -> None:
    """A project made without the part mfu (scripts/new_project.py) has no scripts/mfu_benchmark.py either."""
    import scripts.benchmark as benchmark

    monkeypatch.setattr(benchmark, "installed", lambda name: name != "mfu")
    with pytest.raises(SystemExit, match=r"^error: --mfu needs the part mfu, which this project left out"):
        benchmark.main(["--mfu"])



def test_the_peers_table_sets_train_py_against_trainer_on_one_and_two_processes(tmp_path) -> None:
    """--peers: train.py and transformers' Trainer (scripts/trainer_peer.py, new interpreters) on the same model,
    data and steps, on 1 and 2 processes. Trainer on 2 CPU processes runs DDP (untold, it trained each torchrun
    rank alone: its 2-process eval loss was one process's)."""
    run = run_benchmark(tmp_path, "--peers", "--rounds", "1", "--steps", "8", "--log_every", "2")
    one, two = run["rounds"]
    assert (one["processes"], two["processes"]) == (1, 2)
    assert (one["trainer_parallel_mode"], two["trainer_parallel_mode"]) == ("not_parallel", "distributed")
    assert two["trainer_eval_loss"] != one["trainer_eval_loss"] and two["train_py_eval_loss"] != one["train_py_eval_loss"]
    assert all(r["train_py"] > 0 and r["trainer"] > 0 for r in run["rounds"])
    for processes in (1, 2):
        assert run[f"median_{processes}"]["speed_ratio"] == pytest.approx(
            run["rounds"][processes - 1]["train_py"] / run["rounds"][processes - 1]["trainer"])
        assert f"| median | {processes} | | | **{run[f'median_{processes}']['speed_ratio']:.3f}** |" in run["table"]
    # the wall time from launch to exit beside the rate
    assert all(r["train_py_wall_s"] > 0 and r["trainer_wall_s"] > 0 for r in run["rounds"])
    assert [r["train_py_compiled"] for r in run["rounds"]] == [False, False]  # 8 steps: eager, as its defaults say


@pytest.mark.quick
def test_the_nanogpt_peer_reads_nanogpts_own_lines_and_refuses_what_is_not_its_checkout(tmp_path) -> None:
    """--nanogpt: the step times and val loss come from the lines nanoGPT's train.py prints (its format strings,
    quoted); a directory that is not its checkout is refused in one line before anything runs."""
    from scripts.peer_benchmark import NANOGPT_EVAL, NANOGPT_STEP, nanogpt_checkout

    iter_num, lossf, dt, running_mfu, losses = 250, 1.2345, 0.02811, 0.0004, {"train": 1.1, "val": 1.4567}
    printed = "\n".join([f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}",
                         f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%"])
    assert NANOGPT_STEP.findall(printed) == [("250", "28.11")] and NANOGPT_EVAL.findall(printed) == [("250", "1.4567")]
    with pytest.raises(SystemExit, match=r"^error: --nanogpt .* is not a checkout of karpathy/nanoGPT"):
        nanogpt_checkout(tmp_path, tmp_path / "scratch")
