"""Every flag of train.py (Hugging Face `TrainingArguments` and example-script names), defaults and help. Imports
nothing heavy, so `train.py --help` prints before torch loads; `training/arguments.py` parses and checks them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, NoReturn

from transformers.hf_argparser import HfArgumentParser

from training.task_registry import TaskChoices, tasks
from training.errors import ArgumentError
from training.optim import OPTIMIZERS
from training.parts import PartFlags, part_flags


class FlagParser(HfArgumentParser):
    """Its own errors (an unknown choice, a missing value) are ArgumentErrors: one `error:` line, as any bad input."""

    def error(self, message: str) -> NoReturn:
        raise ArgumentError(f"{message}; see train.py --help")


INTERVALS = ["steps", "epoch", "no"]
SAMPLE_BY = ("document", "paragraph", "line")  # what one document of a .txt file is (datasets' text builder)


def installed_part_flags() -> PartFlags:
    """Every installed part's flags at their defaults (`parse_args` fills them from the command line)."""
    return PartFlags(**{name: flags() for name, flags in part_flags().items()})


@dataclass
class Parsed:
    """What parsing adds to the three argument objects, the same on all three (init=False: the parser skips them)."""

    parts: PartFlags = field(default_factory=installed_part_flags, init=False, repr=False, compare=False)
    # the flags named on the command line or in the recipe file, whatever their value (`flags_given`)
    given: frozenset[str] = field(default=frozenset(), init=False, repr=False, compare=False)


@dataclass
class ModelArguments(Parsed):
    """The core's model flags, and each installed part's flags (`parts`)."""

    task: str = field(default="causal-lm", metadata={"help": "What to learn: the core's next-token text, a task an "
        "installed part adds, or your own Task subclass as module:Class (recipes/).", "choices": TaskChoices(tasks())})
    model_name_or_path: str | None = field(default=None, metadata={
        "help": "Hub id or local directory of a pretrained model for --task. Unset: train from scratch."})
    model_config: str | None = field(default=None, metadata={"help": "Named config to train from scratch. Default: "
        + ", ".join(f"{entry.default_config} ({name})" for name, entry in tasks().items()) + ".",
        "choices": sorted({name for entry in tasks().values() for name in entry.configs})})
    config_overrides: str | None = field(default=None, metadata={
        "help": "Change the --model_config before it is built: e.g. vocab_size=50304,max_position_embeddings=2048."})
    tokenizer_name: str | None = field(default=None, metadata={"help": "Tokenizer if not the model's own."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow model/tokenizer code from the Hub."})
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations to save memory."})


@dataclass
class DataArguments(Parsed):
    """The core's data flags, and each installed part's flags (`parts`)."""

    dataset_name: str | None = field(default=None, metadata={"help": "Hub dataset id or local dataset directory."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Configuration of --dataset_name."})
    train_file: str | None = field(default=None, metadata={"help": "Local txt, json/jsonl, csv or parquet file."})
    validation_file: str | None = field(default=None, metadata={"help": "Same format as --train_file."})
    text_column: str = field(default="text", metadata={"help": "Column that holds the documents."})
    sample_by: str = field(default="document", metadata={
        "help": "What one document of a .txt file is (datasets' text builder): the whole file, its line breaks and "
                "blank lines kept; a paragraph (documents separated by blank lines); or a line. The end-of-text "
                "token goes between documents.", "choices": list(SAMPLE_BY)})
    keep_linebreaks: bool = field(default=True, metadata={
        "help": "With --sample_by line: each line keeps its line break (transformers' run_clm flag)."})
    sample_prompt: str = field(default="Once upon a time", metadata={
        "help": "Text the exported model continues at the end of the run."})
    validation_split_percentage: int = field(default=5, metadata={
        "help": "Percent of train held out when there is no validation split."})
    packing: bool = field(default=True, metadata={
        "help": "Pack documents into full blocks; false: one padded sequence per document."})
    block_size: int | None = field(default=None, metadata={
        "help": "Tokens per training sequence. Default: the model's maximum, at most 1024."})
    max_train_samples: int | None = field(default=None, metadata={
        "help": "Train on the first N training examples only (packed sequences, or images)."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on the first N validation examples only."})


@dataclass
class TrainArguments(Parsed):
    """The core's training flags, and each installed part's flags (`parts`)."""

    output_dir: str = field(default="outputs/default", metadata={"help": "Checkpoints, metrics and the final model."})
    overwrite_output_dir: bool = field(default=False, metadata={"help": "Start afresh in an output_dir that holds a "
        "run: its checkpoints, final model, metrics and tracker logs are deleted just before training starts."})
    do_train: bool = field(default=True, metadata={"help": "false: train nothing; evaluate --model_name_or_path or "
        "--resume_from_checkpoint once (with the parts' passes, as during training) into metrics.jsonl and summary.json."})
    max_steps: int = field(default=-1, metadata={"help": "Optimizer steps to run; -1 means --num_train_epochs."})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Epochs over the training set if max_steps is -1."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Sequences per process per micro-step."})
    per_device_eval_batch_size: int = field(default=8, metadata={"help": "Sequences per process per eval step."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-steps per optimizer step."})
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate."})
    weight_decay: float = field(default=0.1, metadata={"help": "Decoupled weight decay; never on biases and norms."})
    optim: str = field(default="adamw_torch_fused", metadata={
        "help": "The optimizer (transformers' names). Under ZeRO optimizer offload, the AdamW ones run as "
                "DeepSpeed's CPU Adam with the same settings.", "choices": list(OPTIMIZERS)})
    adam_beta1: float = field(default=0.9, metadata={"help": "AdamW beta1."})
    adam_beta2: float = field(default=0.95, metadata={
        "help": "AdamW beta2: 0.95 as in LLM pretraining (transformers' default is 0.999)."})
    adam_epsilon: float = field(default=1e-8, metadata={"help": "AdamW epsilon."})
    warmup_steps: int | None = field(default=None, metadata={
        "help": "Linear warmup, in optimizer steps; overrides --warmup_ratio."})
    warmup_ratio: float = field(default=0.1, metadata={
        "help": "Linear warmup as a fraction of the run's steps (rounded down), in [0, 1), unless --warmup_steps is given."})
    lr_scheduler_type: str = field(default="cosine", metadata={
        "help": "Decay after warmup: a transformers scheduler (SchedulerType), e.g. linear, cosine, constant, "
                "cosine_with_min_lr (with --lr_scheduler_kwargs), warmup_stable_decay."})
    lr_scheduler_kwargs: str | None = field(default=None, metadata={
        "help": 'JSON object of the scheduler\'s own arguments, e.g. \'{"min_lr_rate": 0.1}\' for cosine_with_min_lr.'})
    max_grad_norm: float = field(default=1.0, metadata={
        "help": "Clip the global gradient norm to this on every strategy; 0 disables."})
    seed: int = field(default=42, metadata={"help": "Seeds model init, data order and dropout."})
    logging_steps: int = field(default=10, metadata={"help": "Log training metrics every N optimizer steps."})
    logging_first_step: bool = field(default=False, metadata={"help": "Also log the run's first optimizer step."})
    eval_strategy: str = field(default="steps", metadata={"help": "When to evaluate: every --eval_steps, at each "
        "epoch's end, or never; steps and epoch also at the end.", "choices": INTERVALS})
    eval_steps: int = field(default=100, metadata={"help": "Evaluate every N optimizer steps (and at the end)."})
    eval_on_start: bool = field(default=True, metadata={"help": "Evaluate before the first step (the step-0 baseline)."})
    save_strategy: str = field(default="steps", metadata={"help": "When to save a checkpoint: every --save_steps, at "
        "each epoch's end, or never (a stop signal still saves).", "choices": INTERVALS})
    save_steps: int = field(default=200, metadata={"help": "Save a resumable checkpoint every N optimizer steps."})
    save_total_limit: int | None = field(default=None, metadata={"help": "Keep only the newest N checkpoints."})
    resume_from_checkpoint: str | None = field(default=None, metadata={
        "help": "A checkpoint directory, or 'latest' for the newest in output_dir."})
    allow_config_changes: str | None = field(default=None, metadata={
        "help": "Fields of the model's configuration a resume changes on purpose, comma-separated (e.g. "
                "rope_parameters,max_position_embeddings to extend the context), or a frozen model it reads "
                "otherwise (reference_model: DPO's, teacher_model: distillation's); any other difference from the "
                "checkpoint's is refused."})
    resume_unchecked: bool = field(default=False, metadata={
        "help": "Resume a checkpoint whose files cannot be proven whole and of one run (no manifest.json, or one "
                "without SHA-256s: saved before 2026-12-04), on purpose; logged."})
    ddp_timeout: int = field(default=1800, metadata={
        "help": "Seconds a collective may wait before every rank aborts (a stalled rank)."})
    dataloader_num_workers: int | None = field(default=None, metadata={
        "help": "Worker processes loading batches per process; 0: in the main process. Default: 0 on CPU "
                "(the ranks need the cores), up to 4 on GPUs (parts/cuda_settings)."})
    dataloader_pin_memory: bool = field(default=True, metadata={"help": "Pin batches in page-locked memory (GPUs only)."})
    report_to: list[str] = field(default_factory=lambda: ["none"], metadata={
        "help": "Trackers: tensorboard, wandb, trackio, mlflow (one or more), all (every one installed) or none."})
    dry_run: bool = field(default=False, metadata={
        "help": "Check the flags, the launcher config, the data and the model, and print the plan (strategy, "
                "global batch, steps, memory per rank) without training: rank 0 alone, no process group."})
    run_name: str | None = field(default=None, metadata={
        "help": "The run's name in the trackers (wandb project, ...). Default: output_dir's name."})


ALL_ARGUMENT_CLASSES = (ModelArguments, DataArguments, TrainArguments)
FLAG_CLASSES = (*ALL_ARGUMENT_CLASSES, *part_flags().values())  # every class whose fields are train.py flags
KNOWN_KEYS = {f.name for cls in FLAG_CLASSES for f in fields(cls) if f.init}


def build_parser() -> FlagParser:
    parser = FlagParser(FLAG_CLASSES, allow_abbrev=False,  # --learning_rat is a typo, not --learning_rate
                        description="Train a causal LM or an image classifier with any accelerate strategy.")
    parser.add_argument("--config", help="Recipe YAML of flag values; the command line overrides it.")
    return parser


def every_flag(*arguments) -> dict[str, Any]:
    """Every flag's value by its name: the core's of `arguments` (model, data, training) and every part's they hold
    (the trackers' config; the checks of flags named by a task, a run input or a conflict)."""
    values = {f.name: getattr(args, f.name) for args in arguments for f in fields(args) if f.init}
    return values | {f.name: getattr(flags, f.name) for flags in vars(arguments[0].parts).values() for f in fields(flags)}
