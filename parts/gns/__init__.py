"""The gradient noise scale (`--gns_every N`): McCandlish et al. (2018)'s B_simple = tr(Σ)/|G|², the batch size above
which a larger batch stops buying fewer steps (the critical batch size), in metrics.jsonl, the trackers, report.png
and summary.json as `gradient_noise_scale`. |G|² and tr(Σ) are estimated without bias from two batch sizes every
step already has: one micro-batch on one rank (its gradient, seen by tensor hooks before any strategy sums or reduces
it) and the global batch (the norm clipping measured). `noise.py` holds the estimator. docs/gns.md.

    accelerate launch --config_file accelerate_configs/fsdp.yaml train.py --gns_every 10
"""

from __future__ import annotations

from dataclasses import dataclass, field

from training.errors import ArgumentError, StrategyError
from training.parts import Conflict, Flags, Launch, Loop, MicroStep, OptimizerStep, Part, Training


@dataclass
class GnsFlags:
    gns_every: int = field(default=0, metadata={
        "help": "Measure the gradient noise scale (B_simple, in examples) at every Nth optimizer step and log it as "
                "gradient_noise_scale: the critical batch size to compare the global batch with (docs/gns.md). "
                "0: off."})


class GradientNoiseScale(Part):
    name = "gns"
    description = "the gradient noise scale (the critical batch size) measured as the run trains (--gns_every)"
    flags = GnsFlags
    # a pipeline's or a tensor-parallel group's ranks each hold part of every gradient of one batch
    conflicts = (Conflict("gns_every", "pipeline_parallel_size", ": a process holds some stages' gradients"),
                 Conflict("gns_every", "ddp_comm_hook", ": the global gradient clipping measures is what the hook "
                                                         "compressed"))

    def __init__(self) -> None:
        self.meter = None  # the run's `NoiseMeter`, once prepared

    def check_flags(self, flags: Flags) -> None:
        if flags.train.parts.gns.gns_every < 0:
            raise ArgumentError(f"--gns_every {flags.train.parts.gns.gns_every}: give a step interval >= 1 (0: off)")

    def check_launch(self, launch: Launch) -> None:
        """Two batch sizes: more than one micro-batch per optimizer step."""
        args = launch.args
        if args.parts.gns.gns_every and args.do_train and launch.processes * args.gradient_accumulation_steps < 2:
            raise StrategyError("--gns_every compares one micro-batch's gradient with the global batch's, and one "
                                "process without accumulation has one micro-batch per step: add "
                                "--gradient_accumulation_steps 2, or launch 2 processes or more")

    def after_prepare(self, training: Training) -> None:
        from parts.gns.noise import NoiseMeter

        every = training.args.parts.gns.gns_every if training.args.do_train else 0  # (an evaluation: no gradients)
        if every and training.ranks_per_batch > 1:
            raise StrategyError("--gns_every with tensor parallelism: a group's ranks each hold a slice of every "
                                "gradient; measure it on a launch without tp")
        if every and training.accelerator.mixed_precision == "fp16":  # (clipping's norm is unscaled, the hooks' not)
            raise StrategyError("--gns_every under fp16: its loss scale multiplies the gradients the hooks read; "
                                "measure it in bf16 or fp32 (--mixed_precision bf16)")
        self.meter = NoiseMeter(training, every) if every else None

    def around_training(self, loop: Loop) -> None:
        if self.meter is not None:
            self.meter.start(loop.current_step())

    def after_backward(self, micro: MicroStep) -> None:
        if self.meter is not None:
            self.meter.micro_batch_done(micro)

    def after_optimizer_step(self, step: OptimizerStep) -> None:
        if self.meter is not None:
            self.meter.step_done(step.step, step.grad_norm)

    def logged_figures(self, training: Training):
        return self.meter


PART = GradientNoiseScale()
