"""Memory per GPU, planned before anything is launched (planner.py: model state as each strategy lays it out,
activations and working buffers estimated): `scripts/plan_memory.py` compares every config of accelerate_configs/
and names the one to launch, `--dry_run` prints the memory of the launch as configured, and summary.json
holds the model state each rank held (measured.py). See docs/memory_plan.md.
"""

from training.parts import Part, Plan, Training


class MemoryPlan(Part):
    name = "memory_plan"
    description = ("memory per GPU planned before launch: which config fits (scripts/plan_memory.py), and the dry run's "
                   "memory line; the model state each rank holds, measured (summary.json)")
    files = ("scripts/plan_memory.py",)

    def __init__(self) -> None:
        self.measured = None  # the model state this rank holds, measured at the second optimizer step
        self.accelerator = None

    def after_prepare(self, training: Training) -> None:
        """The model state this rank holds, measured at the second optimizer step."""
        from parts.memory_plan.measured import held_gradients, model_state_probe

        self.measured = model_state_probe(training.model, training.optimizer, lambda: held_gradients(training.model))
        self.accelerator = training.accelerator

    def summary(self, steps_run: int) -> dict:
        """The model state held per rank, the most over the ranks (a collective)."""
        if self.measured is None:
            return {}
        from training.collectives import max_over_ranks

        return {"model_state_bytes_per_rank": max_over_ranks(self.measured, self.accelerator)}

    def dry_run_line(self, plan: Plan) -> str:
        from parts.memory_plan.planner import launch_memory

        return f"memory/rank:     {launch_memory(plan)}"


PART = MemoryPlan()
