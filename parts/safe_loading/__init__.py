"""Checkpoints loaded without running code from them: everything a resume unpickles is held to an allow-list
(unpickling.py). Without this part a resume loads as accelerate, torch and DeepSpeed do by themselves: DeepSpeed's
files with full unpickling, FSDP2's metadata with plain pickle. See docs/safe_loading.md.
"""

from training.parts import CheckpointLoad, Part


class SafeLoading(Part):
    name = "safe_loading"
    description = "checkpoints unpickled against an allow-list: a tampered one runs no code"

    def loading_checkpoint(self, checkpoint: CheckpointLoad):
        """The context a resume loads the checkpoint in: its DCP metadata checked, then weights-only torch.load."""
        from parts.safe_loading.unpickling import safe_unpickling

        return safe_unpickling(checkpoint.path, checkpoint.deepspeed)


PART = SafeLoading()
