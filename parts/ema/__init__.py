"""An exponential moving average of the trained weights (`--ema_decay`), as Lightning's `WeightAveraging`, timm's
`ModelEmaV3` and ema-pytorch keep one: updated after each optimizer step, evaluated beside the weights as trained
(`eval_ema_loss`, ...), kept in every checkpoint (resumed under any strategy and process count), written to final/
with `--ema_export`. `average.py` holds the average itself. docs/ema.md.

    accelerate launch --config_file accelerate_configs/fsdp.yaml train.py --ema_decay 0.999
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass, field, fields

from training.errors import ArgumentError
from training.parts import (
    CheckpointFiles,
    Conflict,
    Evaluating,
    Exporting,
    Flags,
    OptimizerStep,
    Part,
    Training,
)


@dataclass
class EmaFlags:
    ema_decay: float = field(default=0.0, metadata={
        "help": "Keep an exponential moving average of the trained weights, after each update ema = decay * ema + "
                "(1 - decay) * weights (0.999 is common); evaluated beside them (eval_ema_loss, ...) and kept in "
                "checkpoints. 0: off."})
    ema_update_after_step: int = field(default=0, metadata={
        "help": "Updates up to this one copy the weights, later ones average them (ema-pytorch's update_after_step, "
                "counting the optimizer steps from 0 as it counts its calls)."})
    ema_update_every: int = field(default=1, metadata={
        "help": "Update the average at optimizer steps 0, N, 2N, ... counted from 0 (ema-pytorch's update_every)."})
    ema_export: bool = field(default=False, metadata={
        "help": "Write the average's weights to final/ (the weights as trained otherwise)."})


FLAGS = tuple(f.name for f in fields(EmaFlags))  # --ema_decay first


class Ema(Part):
    name = "ema"
    description = "an exponential moving average of the weights, evaluated, checkpointed and exported (--ema_decay)"
    flags = EmaFlags
    # a pipeline's stages each hold some layers, and run their own evaluation and export
    conflicts = (Conflict("ema_decay", "pipeline_parallel_size", ": pipeline stages keep no average of the weights"),)

    def __init__(self) -> None:
        self.average = None  # the run's `WeightAverage`, once prepared
        self.evaluating = False  # --do_train false: the checkpoint's average is evaluated, and must be there

    def check_flags(self, flags: Flags) -> None:
        """A decay in [0, 1), an interval of at least 1; the other flags need --ema_decay."""
        from training.arguments import flags_given  # not at import: training/flags.py imports the parts

        own = flags.train.parts.ema
        if not own.ema_decay:
            if given := flags_given(flags.train, FLAGS[1:]):
                raise ArgumentError(f"--{given[0]} is for the average of the weights: add --ema_decay, or drop it")
            return
        if own.ema_export and not flags.train.do_train:
            raise ArgumentError("--ema_export with --do_train false: an evaluation exports nothing; drop --ema_export")
        if not flags.train.do_train and not flags.train.resume_from_checkpoint:
            raise ArgumentError("--ema_decay with --do_train false evaluates the average a checkpoint holds, and a model "
                                "holds none: give --resume_from_checkpoint <a checkpoint saved with --ema_decay>, or "
                                "drop --ema_decay")
        if not 0 < own.ema_decay < 1 or own.ema_update_every < 1 or own.ema_update_after_step < 0:
            raise ArgumentError(f"--ema_decay must be in (0, 1), --ema_update_every >= 1 and --ema_update_after_step "
                                f">= 0; got {own.ema_decay}, {own.ema_update_every}, {own.ema_update_after_step}")

    def after_prepare(self, training: Training) -> None:
        """The average starts as the prepared weights, each rank holding its share of each (a resume loads it next)."""
        own, self.average, self.evaluating = training.args.parts.ema, None, not training.args.do_train
        if own.ema_decay:
            from parts.ema.average import WeightAverage

            self.average = WeightAverage(training.accelerator, training.model, own.ema_decay,
                                         own.ema_update_after_step, own.ema_update_every)

    def after_optimizer_step(self, step: OptimizerStep) -> None:
        """The average moved towards the weights just stepped (not where the loss scaler skipped the update)."""
        if self.average is not None:
            self.average.update(step.step, step.skipped)

    def around_evaluation(self, evaluation: Evaluating) -> dict[str, AbstractContextManager]:
        """A second pass on the average's weights: eval_ema_loss, ..."""
        return {"eval_ema": self.average.swapped_in()} if self.average is not None else {}

    def around_export(self, export: Exporting) -> AbstractContextManager | None:
        """final/ holds the average's weights under --ema_export."""
        if self.average is not None and export.args.parts.ema.ema_export:
            return self.average.swapped_in()
        return None

    def save_state(self, checkpoint: CheckpointFiles) -> None:
        """Each rank's share of the average, in the tensor format of model_state/ (ema/)."""
        if self.average is not None:
            self.average.save(checkpoint.directory, checkpoint.stamp)

    def load_state(self, checkpoint: CheckpointFiles) -> None:
        """The average as saved, whatever strategy and process count saved it (a checkpoint without one: the
        average starts from the resumed weights; refused where only evaluated, whose figures would be the weights')."""
        if self.average is not None:
            self.average.load(checkpoint.directory, required=self.evaluating)


PART = Ema()
