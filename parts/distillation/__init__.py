"""Knowledge distillation (`--teacher_model_name_or_path`): the student learns from a frozen teacher's
logits as well as from the labels, under every data-parallel config (parts/distillation/teacher.py: the
objective, the teacher's checks, placement and memory plan). See docs/distillation.md.
"""

from dataclasses import dataclass, field

from training.errors import ArgumentError
from training.parts import Part


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


def check_flags(model_args, data_args, args) -> None:
    """The distillation settings need a teacher, and the teacher a data-parallel layout, which places it as it
    places the student."""
    from training.arguments import flags_set, split_model

    if not args.teacher_model_name_or_path:
        if given := flags_set(args, ("distillation_alpha", "distillation_temperature", "distillation_loss")):
            raise ArgumentError(f"--{given[0]} is for distillation: add --teacher_model_name_or_path, or drop it")
        return
    if not 0 <= args.distillation_alpha <= 1:
        raise ArgumentError(f"--distillation_alpha weighs the teacher loss against the label loss: it must be in [0, 1], "
                            f"got {args.distillation_alpha}")
    if args.distillation_temperature <= 0:
        raise ArgumentError(f"--distillation_temperature must be > 0, got {args.distillation_temperature}")
    from training.task_registry import task_entry

    if task_entry(model_args.task).load().auto_model is None:
        raise ArgumentError(f"--teacher_model_name_or_path with --task {model_args.task}: the task names no transformers "
                            "class to load a teacher with (its auto_model); distil a causal LM or an image classifier")
    if split := split_model(model_args, args):
        raise ArgumentError(f"--teacher_model_name_or_path with {split} is not supported; distil under a data-parallel "
                            "config (ddp.yaml, fsdp.yaml or a ZeRO config), which places the teacher as it places the student")


def training_objective(objective, accelerator, task, strategy, args):
    """With a teacher, the distillation objective in place of the task's (uncompiled: the teacher may be a
    DeepSpeed engine), and the teacher's bytes per rank for summary.json."""
    if not args.teacher_model_name_or_path:
        return objective, None
    from parts.distillation.teacher import build_distillation
    from training.collectives import max_over_ranks

    distillation, held = build_distillation(accelerator, task, strategy, args.teacher_model_name_or_path, args)
    return distillation.loss_sums, lambda steps_run: {
        "teacher_state_bytes_per_rank": max_over_ranks({"parameters": held}, accelerator)}


def dry_run_lines(task, model, model_args, args, strategy, processes: int, compute_dtype) -> list[str]:
    """The teacher checked from its config and tokenizer, and its weights per rank planned."""
    if not args.teacher_model_name_or_path:
        return []
    from parts.distillation.teacher import teacher_plan

    return [f"teacher:         {teacher_plan(task, args.teacher_model_name_or_path, strategy, processes, compute_dtype.itemsize)}"]


PART = Part("distillation", "knowledge distillation from a frozen teacher (--teacher_model_name_or_path)",
            DistillationFlags, run_inputs=("teacher_model_name_or_path",), check_flags=check_flags, training_objective=training_objective,
            dry_run_lines=dry_run_lines, files=("docs/distillation.png",))
