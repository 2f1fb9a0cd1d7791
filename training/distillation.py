"""Knowledge distillation: a frozen teacher beside the trained student (`--teacher_model_name_or_path`).

    accelerate launch --config_file accelerate_configs/fsdp.yaml train.py --teacher_model_name_or_path DIR

Each target's loss becomes (1 - alpha) x cross-entropy + alpha x T^2 x D(teacher, student), with
both models' logits softened by the temperature T (`--distillation_temperature`), `alpha`
`--distillation_alpha` and D the divergence `--distillation_loss` names:

- forward_kl: KL(teacher || student), the classic (Hinton et al.): the student covers every
  answer the teacher gives weight to;
- reverse_kl: KL(student || teacher): the student settles on the teacher's main answers;
- jsd: Jensen-Shannon, the mean of both models' KL to their average (bounded, symmetric).

The sums run over the same targets as the label loss (for a causal LM the next tokens that are
not ignored, over the shared tokenizer's tokens), per example, and are divided by the window's
target count like every loss here (training/loss.py): every split of the global batch, on
every strategy, trains the same student.

The teacher is an input, like the data: loaded once, in eval mode, without gradients, never in
the optimizer, never in a checkpoint or `final/`. The strategy places it as it places the
student (training/strategy_adapters.py `place_frozen_model`). Evaluation reports the student's
own label loss, so `eval_loss` compares with a run trained without a teacher.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

import psutil
import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.logging import get_logger

from training.memory_plan import Layout, model_state
from training.performance import compute_dtype, frozen_parameter_bytes, parameter_count
from training.strategy import Strategy
from training.strategy_adapters import place_frozen_model
from training.tasks import Batch, Task

logger = get_logger(__name__)

Divergence = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def divergence(kind: str, temperature: float) -> Divergence:
    """(student logits, teacher logits) -> the divergence per position (over the last dim), in fp32, x T^2
    (Hinton's scaling: the gradients keep their size whatever the temperature)."""

    def forward_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        return F.kl_div(student, teacher, log_target=True, reduction="none").sum(-1)

    def reverse_kl(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        return F.kl_div(teacher, student, log_target=True, reduction="none").sum(-1)

    def jsd(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        mixture = torch.logsumexp(torch.stack([student, teacher]), dim=0) - math.log(2)
        return (forward_kl(mixture, teacher) + forward_kl(mixture, student)) / 2

    measure = {"forward_kl": forward_kl, "reverse_kl": reverse_kl, "jsd": jsd}[kind]

    def scaled(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        student = F.log_softmax(student_logits.float() / temperature, dim=-1)
        teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
        return measure(student, teacher) * temperature**2

    return scaled


class Distillation:
    """The distillation objective: per-example loss sums of the student, with the teacher's logits."""

    def __init__(self, accelerator: Accelerator, task: Task, teacher: torch.nn.Module, alpha: float,
                 temperature: float, kind: str) -> None:
        self.accelerator, self.task, self.teacher, self.alpha = accelerator, task, teacher, alpha
        self.divergence = divergence(kind, temperature)

    def loss_sums(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        logits = self.task.forward(model, batch)
        # The student's compute precision: accelerate wraps the student's forward in autocast, and the
        # teacher, never prepared by accelerate, runs inside the same context.
        with torch.no_grad(), self.accelerator.autocast():
            teacher_logits = self.task.forward(self.teacher, batch)
        label_sums = self.task.loss_sums(logits, batch)[0]
        teacher_sums = self.task.distillation_sums(logits, teacher_logits, batch, self.divergence)
        return (1 - self.alpha) * label_sums + self.alpha * teacher_sums


def frozen(model: torch.nn.Module) -> torch.nn.Module:
    """A model that is run, never trained: no gradients, eval mode (no dropout, BatchNorm's running statistics)."""
    return model.requires_grad_(False).eval()


def build_distillation(accelerator: Accelerator, task: Task, strategy: Strategy, path: str, args) -> tuple[Distillation, int]:
    """Load the teacher, warn if it will not fit, place it under the strategy; the objective and the
    bytes of teacher weights this rank holds."""
    # Loading draws nothing from the RNG the student's run draws from (dropout, data order).
    with torch.random.fork_rng(devices=[]):
        teacher = frozen(task.load_teacher(path))
    parameters = parameter_count(teacher)  # (loaded partitioned under a ZeRO-3 student: by their full size)
    compute_bytes = compute_dtype(accelerator.mixed_precision).itemsize
    planned = teacher_bytes_per_rank(strategy, parameters, accelerator.num_processes, compute_bytes)
    if warning := memory_warning(path, planned, free_memory_bytes(accelerator.device), accelerator.device):
        logger.warning(warning, main_process_only=True)
    teacher = place_frozen_model(accelerator, teacher)
    held = frozen_parameter_bytes(teacher)
    logger.info(f"teacher {path}: {parameters:,} parameters, frozen, placed as {type(teacher).__name__} "
                f"({held / 2**20:,.1f} MiB of weights on this rank); distilled with {args.distillation_loss} at "
                f"temperature {args.distillation_temperature}, alpha {args.distillation_alpha}", main_process_only=True)
    return Distillation(accelerator, task, teacher, args.distillation_alpha, args.distillation_temperature,
                        args.distillation_loss), held


def teacher_bytes_per_rank(strategy: Strategy, parameters: int, processes: int, compute_bytes: int) -> float:
    """The planner's rule for weights that are never trained (training/memory_plan.py `model_state` with
    nothing trainable) under `place_frozen_model`'s layout: whole fp32 replicas under DDP, fp32 shards
    under FSDP2, compute-dtype partitions under a ZeRO-3 inference engine."""
    layout = {Strategy.FSDP: Layout("fsdp", "fsdp", sharded_parameters=True),
              Strategy.DEEPSPEED: Layout("zero3", "deepspeed_zero3", sharded_parameters=True, deepspeed=True)}
    chosen = layout.get(strategy, Layout("ddp", "ddp"))
    return model_state(chosen, parameters, processes, compute_bytes, trainable=0)["parameters"]


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where the teacher will live: the GPU's, or on CPU this process's share of the host's."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def memory_warning(path: str, planned_bytes: float, free_bytes: int, device: torch.device) -> str | None:
    if planned_bytes <= free_bytes:
        return None
    return (f"teacher {path} needs about {planned_bytes / 2**30:,.2f} GiB of weights per rank as this strategy places "
            f"it (training/memory_plan.py), more than the {free_bytes / 2**30:,.2f} GiB free on {device.type}: expect "
            "an out-of-memory error; shard it (fsdp.yaml or a ZeRO config, more processes) or use a smaller teacher")


def teacher_plan(task: Task, path: str, strategy: Strategy, processes: int, compute_bytes: int) -> str:
    """The dry run's line: the teacher checked from its config and tokenizer, its weights per rank planned."""
    config = task.check_teacher(path)
    with torch.device("meta"):  # no memory: the architecture only
        parameters = parameter_count(task.auto_model.from_config(config))
    planned = teacher_bytes_per_rank(strategy, parameters, processes, compute_bytes)
    return f"{path}, {parameters:,} parameters, frozen: {planned / 2**20:,.1f} MiB of weights per rank"
