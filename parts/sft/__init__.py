"""Supervised fine-tuning (`--task sft`): instruction or chat data, the loss on the answers only, and
`eval_exact_match` from greedy answers at each evaluation. docs/sft.md.

    accelerate launch train.py --task sft --model_name_or_path HuggingFaceTB/SmolLM2-360M-Instruct --train_file chat.jsonl

`task.py` is the `Task` (the causal LM's, with its own data and generation metric); `chat.py` the formats,
the chat template and the answer mask; `default_sft.py` the embedded conversations. Nothing here imports
torch: `train.py --help` lists the task before it loads.
"""

from dataclasses import dataclass, field

from models.configs import NAMED_CONFIGS
from training.errors import ArgumentError
from training.parts import Flags, Part, TaskEntry
from training.task_registry import TEXT_FLAGS


@dataclass
class SftFlags:
    chat_template: str | None = field(default=None, metadata={
        "help": "SFT: a Jinja file that replaces the tokenizer's chat template."})
    assistant_only_loss: bool = field(default=True, metadata={
        "help": "SFT, messages: loss on the assistant's answers only; false: on every token."})
    completion_only_loss: bool = field(default=True, metadata={
        "help": "SFT, prompt/completion: loss on the completion only; false: on every token."})
    max_length: int | None = field(default=None, metadata={
        "help": "SFT: tokens per example at most. Default: the model's maximum, at most 1024."})
    truncation_mode: str = field(
        default="keep_start",
        metadata={"help": "SFT and DPO (TRL's name): an example over --max_length keeps its start (TRL 1.x's default), "
                          "its end (TRL 0.24's for DPO), or is dropped.",
                  "choices": ["keep_start", "keep_end", "drop"]},
    )
    eval_generation_samples: int = field(
        default=64,
        metadata={"help": "SFT: held-out prompts answered greedily at each evaluation, for eval_exact_match; 0: none."},
    )


class Sft(Part):
    name = "sft"
    description = "supervised fine-tuning on chat or instruction data, the loss on the answers (--task sft)"
    flags = SftFlags
    run_inputs = ("chat_template",)
    tasks = {"sft": TaskEntry("parts.sft.task:SupervisedFineTuning", NAMED_CONFIGS, "llama-small",
                              (*TEXT_FLAGS, "chat_template", "assistant_only_loss", "completion_only_loss", "max_length",
                               "truncation_mode", "eval_generation_samples"),
                              data_columns=(frozenset({"messages"}), frozenset({"prompt", "completion"})))}

    def check_flags(self, flags: Flags) -> None:
        data = flags.data
        if data.parts.sft.max_length is not None and data.parts.sft.max_length < 2:
            raise ArgumentError(f"--max_length must be at least 2, got {data.parts.sft.max_length}")
        if data.parts.sft.eval_generation_samples < 0:
            raise ArgumentError(f"--eval_generation_samples must be >= 0, got {data.parts.sft.eval_generation_samples}")


PART = Sft()
