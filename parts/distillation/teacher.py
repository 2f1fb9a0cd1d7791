"""Owns knowledge distillation's objective: a frozen teacher beside the trained student
(`--teacher_model_name_or_path`), loaded, checked against the task, placed and planned.

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
target count like every loss here (training/step.py): every split of the global batch, on
every strategy, trains the same student.

The teacher is an input, like the data: loaded once, in eval mode, without gradients, never in
the optimizer, never in a checkpoint or `final/`. The strategy places it as it places the
student (training/strategy/frozen.py). Evaluation reports the student's
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
from accelerate.utils import DeepSpeedPlugin
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from models.language import loading
from training.errors import ModelError
from training.loss import IGNORE_INDEX
from training.performance import compute_dtype, parameter_count, storage_bytes
from training.strategy import Strategy
from training.checkpoints.frozen import frozen_identity
from training.strategy.frozen import frozen, place_frozen_model
from training.tasks import Batch, CausalLM, Task

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


def check_teacher(task: Task, path: str) -> PretrainedConfig:
    """The teacher's config, read without its weights and checked to predict what the student predicts:
    the same tokens (a causal LM), or the same labels in the same order (a classifier)."""
    with loading("teacher", path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=task.model_args.trust_remote_code)
    if isinstance(task, CausalLM):
        check_same_vocabulary(task.processor, path, config.vocab_size, task.model_args.trust_remote_code)
        return config
    names = [config.id2label[i] for i in range(config.num_labels)]
    if names != task.labels:
        raise ModelError(f"teacher {path} classifies into {names[:5]}{'...' if len(names) > 5 else ''}, the data "
                         f"into {task.labels[:5]}{'...' if len(task.labels) > 5 else ''}: distillation compares "
                         "their answers label by label; use a teacher trained on these labels, in this order")
    return config


def check_same_vocabulary(tokenizer: PreTrainedTokenizerBase, teacher: str, teacher_vocab_size: int,
                          trust_remote_code: bool = False) -> None:
    """A distillation teacher predicts over the student's tokens: its own tokenizer (when it ships one)
    maps every token to the same id, and its output layer covers them all."""
    try:
        teacher_vocab = AutoTokenizer.from_pretrained(teacher, trust_remote_code=trust_remote_code).get_vocab()
    except (OSError, ValueError):  # weights without a tokenizer: the output's size is all there is to check
        teacher_vocab = None
    student_vocab = tokenizer.get_vocab()
    if teacher_vocab is not None and teacher_vocab != student_vocab:
        differ = sorted(set(teacher_vocab.items()) ^ set(student_vocab.items()), key=lambda item: item[1])[0][0]
        raise ModelError(
            f"teacher {teacher} has another vocabulary than the student's tokenizer ({len(teacher_vocab)} vs "
            f"{len(student_vocab)} tokens; e.g. {differ!r} differs): distillation compares next-token predictions "
            "token by token, so both must share one tokenizer; use a teacher of the student's family, or give the "
            "student the teacher's tokenizer (--tokenizer_name)")
    if teacher_vocab_size < len(tokenizer):
        raise ModelError(f"teacher {teacher} predicts {teacher_vocab_size} tokens, fewer than the student's tokenizer "
                         f"holds ({len(tokenizer)}): it was not trained with this tokenizer; use one that was")


def load_teacher(task: Task, path: str) -> PreTrainedModel:
    """The checked teacher, fp32, loaded by the task's Auto class."""
    check_teacher(task, path)
    with loading("teacher", path):
        return task.auto_model.from_pretrained(path, dtype=torch.float32,
                                               trust_remote_code=task.model_args.trust_remote_code)


def divergence_sums(task: Task, logits: torch.Tensor, teacher_logits: torch.Tensor, batch: Batch,
                    divergence: Divergence) -> torch.Tensor:
    """Per-example sums of `divergence` between the student's and the teacher's logits, over the targets the
    task's label loss counts: next tokens that are not ignored, or labelled examples."""
    if isinstance(task, CausalLM):
        # Over the tokenizer's tokens: the models' rows beyond it (vocabulary padding) may differ in number.
        vocab = len(task.processor)
        per_token = divergence(logits[:, :-1, :vocab], teacher_logits[:, :-1, :vocab])
        return torch.where(batch["labels"][:, 1:] != IGNORE_INDEX, per_token, 0).sum(dim=1)
    return torch.where(batch["labels"] != IGNORE_INDEX, divergence(logits, teacher_logits), 0)


class Distillation:
    """The distillation objective: per-example loss sums of the student, with the teacher's logits."""

    def __init__(self, accelerator: Accelerator, task: Task, teacher: torch.nn.Module, alpha: float,
                 temperature: float, kind: str) -> None:
        self.accelerator, self.task, self.teacher, self.alpha = accelerator, task, teacher, alpha
        self.divergence = divergence(kind, temperature)
        self.identity: dict | None = None  # the teacher's record (training/checkpoints/frozen.py)

    def loss_sums(self, model: torch.nn.Module, batch: Batch) -> torch.Tensor:
        logits = self.task.forward(model, batch)
        # The student's compute precision: accelerate wraps the student's forward in autocast, and the
        # teacher, never prepared by accelerate, runs inside the same context.
        with torch.no_grad(), self.accelerator.autocast():
            teacher_logits = self.task.forward(self.teacher, batch)
        label_sums = self.task.objective_sums(logits, batch)
        teacher_sums = divergence_sums(self.task, logits, teacher_logits, batch, self.divergence)
        return (1 - self.alpha) * label_sums + self.alpha * teacher_sums


IDENTITY = "teacher_model"  # <IDENTITY>.json in a checkpoint: the teacher's record; --allow_config_changes


def build_distillation(accelerator: Accelerator, task: Task, strategy: Strategy, path: str, args) -> tuple[Distillation, int]:
    """Load the teacher, warn if it will not fit, place it under the strategy; the objective and the
    bytes of teacher weights this rank holds."""
    # Loading draws nothing from the RNG the student's run draws from (dropout, data order).
    with torch.random.fork_rng(devices=[]):
        teacher = frozen(load_teacher(task, path))
    parameters = parameter_count(teacher)  # (loaded partitioned under a ZeRO-3 student: by their full size)
    compute_bytes = compute_dtype(accelerator.mixed_precision).itemsize
    stage = accelerator.state.deepspeed_plugin.zero_stage if strategy is Strategy.DEEPSPEED else 0
    planned = teacher_bytes_per_rank(strategy, parameters, accelerator.num_processes, compute_bytes, stage)
    if warning := memory_warning(path, planned, free_memory_bytes(accelerator.device), accelerator.device):
        logger.warning(warning, main_process_only=True)
    identity = frozen_identity(path, teacher, accelerator)  # (recorded in checkpoints: a resume checks it)
    teacher = place_frozen_model(accelerator, teacher)
    held = storage_bytes(teacher.parameters(), set())  # the frozen weights this rank holds
    logger.info(f"teacher {path}: {parameters:,} parameters, frozen, placed as {type(teacher).__name__} "
                f"({held / 2**20:,.1f} MiB of weights on this rank); distilled with {args.parts.distillation.distillation_loss} at "
                f"temperature {args.parts.distillation.distillation_temperature}, alpha {args.parts.distillation.distillation_alpha}", main_process_only=True)
    distillation = Distillation(accelerator, task, teacher, args.parts.distillation.distillation_alpha,
                                args.parts.distillation.distillation_temperature,
                                args.parts.distillation.distillation_loss)
    distillation.identity = identity
    return distillation, held


def teacher_bytes_per_rank(strategy: Strategy, parameters: int, processes: int, compute_bytes: int,
                           stage: int = 3) -> float:
    """Weights that are never trained, as `place_frozen_model` lays them out (the memory planner's rule with nothing
    trained): whole fp32 replicas under DDP, fp32 shards under FSDP2, under DeepSpeed an inference engine's
    compute-dtype weights, partitioned under ZeRO-3 (`stage`), whole under ZeRO-1/2."""
    if strategy is Strategy.DEEPSPEED:
        return parameters * compute_bytes / (processes if stage == 3 else 1)
    return parameters * (4 / processes if strategy is Strategy.FSDP else 4)


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where the teacher will live: the GPU's, or on CPU this process's share of the host's."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def memory_warning(path: str, planned_bytes: float, free_bytes: int, device: torch.device) -> str | None:
    if planned_bytes <= free_bytes:
        return None
    return (f"teacher {path} needs about {planned_bytes / 2**30:,.2f} GiB of weights per rank as this strategy places "
            f"it, more than the {free_bytes / 2**30:,.2f} GiB free on {device.type}: expect "
            "an out-of-memory error; shard it (fsdp.yaml or a ZeRO config, more processes) or use a smaller teacher")


def teacher_plan(task: Task, path: str, strategy: Strategy, processes: int, compute_bytes: int) -> str:
    """The dry run's line: the teacher checked from its config and tokenizer, its weights per rank planned."""
    config = check_teacher(task, path)
    with torch.device("meta"):  # no memory: the architecture only
        parameters = parameter_count(task.auto_model.from_config(config))
    stage = DeepSpeedPlugin().zero_stage if strategy is Strategy.DEEPSPEED else 0
    planned = teacher_bytes_per_rank(strategy, parameters, processes, compute_bytes, stage)
    return f"{path}, {parameters:,} parameters, frozen: {planned / 2**20:,.1f} MiB of weights per rank"
