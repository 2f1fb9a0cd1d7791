"""Memory per GPU, planned before anything is launched (planner.py: model state as each strategy lays it out,
activations and working buffers estimated): `scripts/plan_memory.py` compares every config of accelerate_configs/
and names the one to launch, and `--dry_run` prints the memory of the launch as configured. See
docs/memory_plan.md.
"""

from training.parts import Part


def dry_run_lines(task, model, model_args, args, strategy, processes: int, compute_dtype) -> list[str]:
    from parts.memory_plan.planner import launch_memory

    return [f"memory/rank:     {launch_memory(task, model, model_args, args, strategy, processes, compute_dtype)}"]


PART = Part("memory_plan", "memory per GPU planned before launch: which config fits (scripts/plan_memory.py), and "
            "the dry run's memory line", dry_run_lines=dry_run_lines, files=("scripts/plan_memory.py",))
