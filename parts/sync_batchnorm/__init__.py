"""SyncBatchNorm (`--sync_batchnorm`): BatchNorm statistics over the micro-batches of all processes, for
image models trained with a few examples per GPU (torch implements it for GPUs only). docs/sync_batchnorm.md.

BatchNorm normalises each layer with the mean and variance of the batch it sees. Under data parallelism
each process sees only its per-device batch, so with a few examples per device those statistics are noisy
(with one they are degenerate) and training suffers, however large the global batch. `SyncBatchNorm`
computes them over all processes together, at the cost of collectives in every BatchNorm layer, forward
and backward. (The running statistics that evaluation uses are averaged over the ranks by the core,
with or without this part: training/batchnorm.py.)
"""

from dataclasses import dataclass, field

from training.parts import Part, Started


@dataclass
class SyncBatchNormFlags:
    sync_batchnorm: bool = field(default=False, metadata={
        "help": "BatchNorm statistics over all processes' batches (GPUs; see parts/sync_batchnorm)."})


class SyncBatchNorm(Part):
    name = "sync_batchnorm"
    description = "BatchNorm statistics over every process's micro-batch, on GPUs (--sync_batchnorm)"
    flags = SyncBatchNormFlags

    def convert_model(self, model, run: Started):
        """The model with `SyncBatchNorm` layers under --sync_batchnorm, and a log line saying what happened."""
        if not run.args.parts.sync_batchnorm.sync_batchnorm:
            return model
        from accelerate.logging import get_logger

        from parts.sync_batchnorm.convert import convert_sync_batchnorm

        model, note = convert_sync_batchnorm(model, run.accelerator)
        get_logger(__name__).info(note, main_process_only=True)
        return model


PART = SyncBatchNorm()
