"""The pipeline's flags, and whether they cut the model: read by the part's hooks before torch loads (no torch here)."""

from dataclasses import dataclass, field


@dataclass
class PipelineFlags:
    pipeline_parallel_size: int = field(
        default=1,
        metadata={"help": "Pipeline stages: the model cut layer-wise over this many processes (ddp config; launch a "
                          "multiple of it: the rest are replicas). See parts/pipeline."},
    )
    pipeline_schedule: str = field(default="1F1B", metadata={
        "help": "Pipeline: torch's schedule.", "choices": ["GPipe", "1F1B", "Interleaved1F1B"]})
    pipeline_microbatches: int = field(default=4, metadata={
        "help": "Pipeline: equal micro-batches each per-device batch is cut into."})
    pipeline_timeline: bool = field(
        default=False,
        metadata={"help": "Pipeline: record when each stage computes each micro-batch (wall clock) into "
                          "output_dir/pipeline_timeline.json, for scripts/benchmark.py --pipeline."},
    )


def pipelined(args) -> bool:
    """Whether the model is cut into stages."""
    return args.parts.pipeline.pipeline_parallel_size > 1


# why a flag that needs the whole model in each process cannot run with stages (`Pipeline.conflicts`, layout.py)
WHOLE_MODELS_ONLY = (" (stages exchange fixed-shape activations of whole models); drop it, or train without pipeline "
                     "stages")
