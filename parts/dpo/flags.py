"""DPO's flags (TRL's names), read as `args.parts.dpo`: nothing heavy, for `train.py --help`."""

from dataclasses import dataclass, field

LOSS_TYPES = ("sigmoid", "ipo", "hinge")  # the formulas: parts/dpo/loss.py
# where --learning_rate is not given (the core's 1e-3 is for training from scratch)
# (docs/dpo.md: the default job measured at 3e-5, 5e-5 and 1e-4)
LEARNING_RATE = 5e-5


@dataclass
class DpoFlags:
    beta: float = field(default=0.1, metadata={
        "help": "DPO: how far the policy may move from the reference (the rewards' scale); TRL's default 0.1."})
    loss_type: str = field(default="sigmoid", metadata={
        "help": "DPO: sigmoid (the DPO paper's), ipo (IPO, on the answers' mean log-probabilities) or hinge.",
        "choices": list(LOSS_TYPES)})
    label_smoothing: float = field(default=0.0, metadata={
        "help": "DPO, sigmoid: the share of pairs assumed mislabelled (robust/cDPO), in [0, 0.5)."})
    reference_free: bool = field(default=False, metadata={
        "help": "DPO: no reference model (its log-probabilities taken as 0)."})
    max_prompt_length: int = field(default=512, metadata={
        "help": "DPO: prompt tokens at most; a longer prompt keeps its end (counted in the log)."})
    precompute_ref_log_probs: bool = field(default=False, metadata={
        "help": "DPO: score every pair with the reference once, before training, and free it (checkpoints keep "
                "the scores)."})
