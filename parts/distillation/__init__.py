"""Knowledge distillation (`--teacher_model_name_or_path`): the student learns from a frozen teacher's
logits as well as from the labels, under every data-parallel config (parts/distillation/teacher.py: the
objective, the teacher's checks, placement and memory plan). See docs/distillation.md.
"""

from dataclasses import dataclass, field

from training.errors import ArgumentError
from training.parts import CheckpointFiles, Flags, Part, Plan, Training


@dataclass
class DistillationFlags:
    teacher_model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "Distil from this frozen teacher (Hub id or directory; same tokenizer, or same labels): it runs "
                          "beside the student under the same strategy and is never trained or saved. See "
                          "docs/distillation.md."},
    )
    distillation_alpha: float = field(
        default=0.5,
        metadata={"help": "Distillation: weight of the teacher loss; 1 - alpha weighs the label loss. In [0, 1]."},
    )
    distillation_temperature: float = field(default=1.0, metadata={
        "help": "Distillation: softmax temperature of both models' logits (the loss is scaled by T^2)."})
    distillation_loss: str = field(
        default="forward_kl",
        metadata={"help": "Distillation: the divergence between teacher and student: forward_kl KL(teacher||student), "
                          "reverse_kl KL(student||teacher), or jsd (Jensen-Shannon).",
                  "choices": ["forward_kl", "reverse_kl", "jsd"]},
    )


class Distillation(Part):
    name = "distillation"
    description = "knowledge distillation from a frozen teacher (--teacher_model_name_or_path)"
    flags = DistillationFlags
    run_inputs = ("teacher_model_name_or_path",)
    files = ("docs/distillation.png", "training/strategy/frozen.py", "training/checkpoints/frozen.py")  # (DPO's reference shares them)

    def __init__(self) -> None:
        self.teacher_figures = None  # () -> the teacher's bytes per rank, a collective (set with a teacher)
        self.distillation = None  # the objective, with the teacher's record
        self.allowed_changes = None  # --allow_config_changes

    def check_flags(self, flags: Flags) -> None:
        """The distillation settings need a teacher, and the teacher a data-parallel layout, which places it as it
        places the student."""
        from training.arguments import flags_given, split_model

        model_args, args = flags.model, flags.train
        if not args.parts.distillation.teacher_model_name_or_path:
            if given := flags_given(args, ("distillation_alpha", "distillation_temperature", "distillation_loss")):
                raise ArgumentError(f"--{given[0]} is for distillation: add --teacher_model_name_or_path, or drop it")
            return
        if not 0 <= args.parts.distillation.distillation_alpha <= 1:
            raise ArgumentError(f"--distillation_alpha weighs the teacher loss against the label loss: it must be in "
                                f"[0, 1], got {args.parts.distillation.distillation_alpha}")
        if args.parts.distillation.distillation_temperature <= 0:
            raise ArgumentError(f"--distillation_temperature must be > 0, got {args.parts.distillation.distillation_temperature}")
        from training.task_registry import task_entry

        if task_entry(model_args.task).load().auto_model is None:
            raise ArgumentError(f"--teacher_model_name_or_path with --task {model_args.task}: the task names no "
                                "transformers class to load a teacher with (its auto_model); distil a causal LM or an "
                                "image classifier")
        if split := split_model(flags):
            raise ArgumentError(f"--teacher_model_name_or_path with {split} is not supported; distil under a "
                                "data-parallel config (ddp.yaml, fsdp.yaml or a ZeRO config), which places the teacher "
                                "as it places the student")

    def training_objective(self, objective, training: Training):
        """With a teacher, the distillation objective in place of the task's (uncompiled: the teacher may be a
        DeepSpeed engine)."""
        args = training.args
        if not args.parts.distillation.teacher_model_name_or_path:
            return objective
        from parts.distillation.teacher import build_distillation
        from training.collectives import max_over_ranks

        distillation, held = build_distillation(training.accelerator, training.task, training.strategy,
                                                args.parts.distillation.teacher_model_name_or_path, args)
        self.teacher_figures = lambda: max_over_ranks({"parameters": held}, training.accelerator)
        self.distillation, self.allowed_changes = distillation, args.allow_config_changes
        return distillation.loss_sums

    def save_state(self, checkpoint: CheckpointFiles) -> None:
        """The teacher's record (where it came from, its configuration, its weights' checksum)."""
        if self.distillation is not None and checkpoint.accelerator.is_main_process:
            from parts.distillation.teacher import IDENTITY
            from training.checkpoints.frozen import save_frozen_identity

            save_frozen_identity(checkpoint.directory, IDENTITY, self.distillation.identity)

    def load_state(self, checkpoint: CheckpointFiles) -> None:
        """A resume that distils from another teacher than the checkpoint's run: refused, unless named on purpose."""
        if self.distillation is not None:
            from parts.distillation.teacher import IDENTITY
            from training.checkpoints.frozen import check_frozen_identity

            check_frozen_identity(checkpoint.directory, IDENTITY, self.distillation.identity,
                                  "teacher_model_name_or_path", self.allowed_changes)

    def summary(self, steps_run: int) -> dict:
        """The teacher's bytes per rank."""
        return {"teacher_state_bytes_per_rank": self.teacher_figures()} if self.teacher_figures else {}

    def dry_run_line(self, plan: Plan) -> str | None:
        """The teacher checked from its config and tokenizer, and its weights per rank planned."""
        if not plan.args.parts.distillation.teacher_model_name_or_path:
            return None
        from parts.distillation.teacher import teacher_plan

        held = teacher_plan(plan.task, plan.args.parts.distillation.teacher_model_name_or_path, plan.strategy, plan.processes,
                            plan.compute_dtype.itemsize)
        return f"teacher:         {held}"


PART = Distillation()
