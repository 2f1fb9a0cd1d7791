"""Preference tuning (`--task dpo`): DPO, the policy trained against a frozen reference on pairs of a preferred
(`chosen`) and a `rejected` answer to one `prompt`, with TRL's data format, flag names and metrics. docs/dpo.md.

    accelerate launch train.py --task dpo --model_name_or_path outputs/sft/final

`task.py` is the `Task` (the answers' log-probabilities of both models, the loss and the rewards), `loss.py` the
formulas, `reference.py` the reference model (placed by the strategy as the policy, or the policy with its adapter
off), `default_dpo.py` the embedded pairs. The chat formats and the answer mask are SFT's (parts/sft).
"""

from models.configs import NAMED_CONFIGS
from parts.dpo.flags import LEARNING_RATE, DpoFlags
from training.errors import ArgumentError
from training.parts import CheckpointFiles, Conflict, Flags, Part, Started, TaskEntry, Training
from training.task_registry import TEXT_FLAGS


class Dpo(Part):
    name = "dpo"
    description = "preference tuning: DPO against a frozen reference, TRL's data, flags and metrics (--task dpo)"
    flags = DpoFlags
    needs = ("sft",)  # the chat formats, the chat template and the answer mask
    files = ("training/strategy/frozen.py", "training/checkpoints/frozen.py")  # (distillation's teacher shares them)
    conflicts = (Conflict("precompute_ref_log_probs", "reference_free", ": there is no reference to score"),)
    resume = None  # the checkpoint this run resumes (`resuming`)
    task = None  # the DPO task of this run, once prepared
    training = None  # what trains it (`after_prepare`)
    tasks = {"dpo": TaskEntry("parts.dpo.task:DirectPreference", NAMED_CONFIGS, "llama-small",
                              (*TEXT_FLAGS, "chat_template", "max_length", "truncation_mode", "eval_generation_samples", "beta",
                               "loss_type", "label_smoothing", "reference_free", "max_prompt_length",
                               "precompute_ref_log_probs"),
                              data_columns=(frozenset({"prompt", "chosen", "rejected"}),))}

    def check_flags(self, flags: Flags) -> None:
        if flags.model.task != "dpo":
            return
        from training.arguments import flags_given, split_model

        if not flags_given(flags.train, ["learning_rate"]):
            flags.train.learning_rate = LEARNING_RATE
        dpo = flags.data.parts.dpo
        if dpo.beta <= 0:
            raise ArgumentError(f"--beta must be > 0, got {dpo.beta}")
        if not 0 <= dpo.label_smoothing < 0.5:
            raise ArgumentError(f"--label_smoothing must be in [0, 0.5), got {dpo.label_smoothing}")
        if dpo.label_smoothing and dpo.loss_type != "sigmoid":
            raise ArgumentError(f"--label_smoothing smooths the sigmoid loss; drop it or --loss_type {dpo.loss_type}")
        if dpo.max_prompt_length < 1:
            raise ArgumentError(f"--max_prompt_length must be at least 1, got {dpo.max_prompt_length}")
        if not (flags.model.model_name_or_path or dpo.reference_free):
            raise ArgumentError("--task dpo tunes a trained model against itself: give --model_name_or_path (e.g. "
                                "outputs/sft/final), or --reference_free")
        if split := split_model(flags):
            raise ArgumentError(f"--task dpo with {split} is not supported; tune under a data-parallel config "
                                "(ddp.yaml, fsdp.yaml or a ZeRO config), which places the reference as the policy")

    def resuming(self, run: Started) -> None:
        """The checkpoint a resume continues, which may hold the precomputed reference scores."""
        self.resume = run.resume

    def after_prepare(self, training: Training) -> None:
        """The reference, once the policy is placed: loaded and placed alike, or the policy with its adapter off;
        under --precompute_ref_log_probs its scores of every pair instead (one pass now, the reference then freed,
        or a resumed checkpoint's, read once its files are checked: `load_state`)."""
        from parts.dpo.task import DirectPreference

        self.task = training.task if isinstance(training.task, DirectPreference) else None
        if self.task is None:
            return
        from parts.dpo.reference import TABLE_FILE, set_up_reference

        self.training = training
        if not (self.task.dpo.precompute_ref_log_probs and self.resume and (self.resume / TABLE_FILE).exists()):
            set_up_reference(training.accelerator, self.task, training.model, training.args)

    def save_state(self, checkpoint: CheckpointFiles) -> None:
        """The loaded reference's record, and the precomputed reference scores, so that a resume continues against
        the very same reference."""
        if self.task is None or not checkpoint.accelerator.is_main_process:
            return
        from parts.dpo.reference import IDENTITY, TABLE_FILE
        from training.checkpoints.frozen import save_frozen_identity

        if self.task.reference_identity is not None:
            save_frozen_identity(checkpoint.directory, IDENTITY, self.task.reference_identity)
        if self.task.reference_table is not None:
            from safetensors.torch import save_file

            save_file({"table": self.task.reference_table.cpu()}, checkpoint.directory / TABLE_FILE,
                      metadata=dict(checkpoint.stamp))

    def load_state(self, checkpoint: CheckpointFiles) -> None:
        """The reference this run reads checked against the checkpoint's (refused if another), and under
        --precompute_ref_log_probs the checkpoint's scores (computed now where it holds none)."""
        if self.task is None:
            return
        from parts.dpo.reference import IDENTITY, TABLE_FILE, set_up_reference
        from training.checkpoints.frozen import check_frozen_identity, frozen_identity

        args, path = self.training.args, self.task.model_args.model_name_or_path
        pending = self.task.dpo.precompute_ref_log_probs and self.task.reference_table is None
        identity = self.task.reference_identity or (frozen_identity(path, None, checkpoint.accelerator)
                                                    if pending and path else None)
        if identity is not None:  # (the record kept: the checkpoint's, where the scores stand for the reference)
            identity = check_frozen_identity(checkpoint.directory, IDENTITY, identity, "model_name_or_path",
                                             args.allow_config_changes)
            self.task.reference_identity = identity
        if not pending:
            return
        if (checkpoint.directory / TABLE_FILE).exists():
            from safetensors.torch import load_file

            self.task.reference_table = load_file(checkpoint.directory / TABLE_FILE)["table"].to(
                checkpoint.accelerator.device)
        else:  # (listed in no manifest: not read)
            set_up_reference(checkpoint.accelerator, self.task, self.training.model, args)

    def logged_figures(self, training: Training):
        """The rewards and log-probabilities of the pairs trained since the last log (TRL's names)."""
        from parts.dpo.task import DirectPreference, PairFigures

        if not isinstance(training.task, DirectPreference):
            return None
        training.task.figures = PairFigures()  # from the first step on (a micro-batch search ran the objective)
        return training.task.figures


PART = Dpo()
