"""Pipeline stages (`--pipeline_parallel_size`): the model cut layer-wise over processes, run by torch's schedules
(parts/pipeline/schedule.py), on the layouts parts/pipeline/layout.py accepts, for the model families
parts/pipeline/stages.py can cut. The stages run as the model's `ModelRunner` (training/runner.py): their own
micro-steps, clipping, evaluation, checkpoint files and export. See docs/pipeline.md.
"""

from parts.pipeline.flags import WHOLE_MODELS_ONLY, PipelineFlags, pipelined
from training.parts import Conflict, Flags, Launch, Part, Plan, Started


class Pipeline(Part):
    name = "pipeline"
    description = "pipeline stages run by torch's schedules (--pipeline_parallel_size)"
    flags = PipelineFlags
    conflicts = (Conflict("use_peft", "pipeline_parallel_size", WHOLE_MODELS_ONLY),
                 Conflict("torch_compile", "pipeline_parallel_size", WHOLE_MODELS_ONLY))
    files = ("docs/pipeline.png",)

    def check_flags(self, flags: Flags) -> None:
        from parts.pipeline.layout import check_pipeline_flags

        check_pipeline_flags(flags.model, flags.data, flags.train)

    def check_launch(self, launch: Launch) -> None:
        from parts.pipeline.layout import check_pipeline_launch

        check_pipeline_launch(launch.args, launch.strategy, launch.processes)

    def model_split(self, flags: Flags) -> str | None:
        return "--pipeline_parallel_size" if pipelined(flags.train) else None

    def ranks_per_batch(self, args) -> int:
        """A pipeline's processes read the same batches: one replica is `--pipeline_parallel_size` processes."""
        return args.parts.pipeline.pipeline_parallel_size

    def wrap_model(self, model, run: Started):
        """This process's stages of the model, in its place, when pipelined."""
        if not pipelined(run.args):
            return model
        from parts.pipeline.schedule import StageModules

        return StageModules(run.accelerator, model, run.args)

    def model_runner(self, model, run: Started):
        """The stages run themselves: the schedule's forward and backward, the norm over every stage, each stage's
        own checkpoint files, the export gathered on rank 0 (parts/pipeline/schedule.py)."""
        return model if pipelined(run.args) else None

    def checkpoint_layout(self, args) -> dict[str, object]:
        """The stages, and how many each process holds where more than one (each process saves its own optimizer)."""
        from parts.pipeline.layout import STAGES_PER_PROCESS, stage_count

        if not pipelined(args):
            return {}
        per_process = STAGES_PER_PROCESS.get(args.parts.pipeline.pipeline_schedule, 1)
        return {"pipeline_stages": stage_count(args)} | ({"pipeline_stages_per_process": per_process}
                                                         if per_process > 1 else {})

    def held_parameters(self, plan: Plan) -> int | None:
        if not pipelined(plan.args):
            return None
        from parts.pipeline.layout import parameters_per_process

        return parameters_per_process(plan.model, plan.args)

    def dry_run_line(self, plan: Plan) -> str | None:
        args = plan.args
        if not pipelined(args):
            return None
        from parts.pipeline.layout import stage_count

        return (f"pipeline:        {stage_count(args)} pipeline stages ({args.parts.pipeline.pipeline_schedule}, "
                f"{args.parts.pipeline.pipeline_microbatches} micro-batches) over {args.parts.pipeline.pipeline_parallel_size} processes per replica")


PART = Pipeline()
