"""Memory per GPU, planned before anything is launched (planner.py: model state as each strategy lays it out,
activations and working buffers estimated): `scripts/plan_memory.py` compares every config of accelerate_configs/
and names the one to launch, `--dry_run` prints the memory of the launch as configured, and summary.json
holds the model state each rank held (measured.py). See docs/memory_plan.md.
"""

from training.parts import Part


def after_prepare(accelerator, model, optimizer, args):
    """The model state this rank holds, measured at the second optimizer step, for summary.json."""
    from parts.memory_plan.measured import held_gradients, model_state_probe
    from training.collectives import max_over_ranks

    measured = model_state_probe(model, optimizer, lambda: held_gradients(model))
    return lambda steps_run: {"model_state_bytes_per_rank": max_over_ranks(measured, accelerator)}


def dry_run_lines(task, model, model_args, args, strategy, processes: int, compute_dtype) -> list[str]:
    from parts.memory_plan.planner import launch_memory

    return [f"memory/rank:     {launch_memory(task, model, model_args, args, strategy, processes, compute_dtype)}"]


PART = Part("memory_plan", "memory per GPU planned before launch: which config fits (scripts/plan_memory.py), and "
            "the dry run's memory line; the model state each rank holds, measured (summary.json)",
            after_prepare=after_prepare, dry_run_lines=dry_run_lines, files=("scripts/plan_memory.py",))
