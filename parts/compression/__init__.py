"""Gradient compression for DDP (`--ddp_comm_hook`): torch's fp16, bf16 and PowerSGD hooks, with the bytes
each rank all-reduces counted (summary.json's `gradient_allreduce_bytes_per_step`) and PowerSGD's state
kept in checkpoints (parts/compression/hooks.py). See docs/compression.md.
"""

from dataclasses import dataclass, field

from training.errors import ArgumentError
from training.parts import CheckpointFiles, Flags, Launch, Part, Training

# accelerate's DDPCommunicationHookType values; "allreduce" is DDP's own all-reduce as a counted hook
DDP_COMM_HOOKS = ["allreduce", "fp16", "bf16", "power_sgd", "batched_power_sgd"]
ONE_BUCKET_MB = 2**20  # DDP's bucket size when every gradient must share one bucket


@dataclass
class CompressionFlags:
    ddp_comm_hook: str | None = field(
        default=None,
        metadata={"help": "Compress DDP's gradient all-reduce (ddp config only; see parts/compression): fp16, "
                          "bf16 (GPUs), power_sgd, batched_power_sgd; allreduce: uncompressed, with its bytes counted. "
                          "Pays on a slow interconnect with a large model.", "choices": DDP_COMM_HOOKS},
    )
    power_sgd_rank: int = field(default=1, metadata={"help": "PowerSGD: rank of the low-rank gradient approximation."})
    power_sgd_start_step: int = field(
        default=1000,
        metadata={"help": "PowerSGD: optimizer steps of plain all-reduce before compression starts (torch's "
                          "start_powerSGD_iter; at least 2; about 10%% of the run, and no fewer than the warmup)."},
    )


class Compression(Part):
    name = "compression"
    description = "DDP gradient compression: fp16, bf16 and PowerSGD hooks, bytes counted (--ddp_comm_hook)"
    flags = CompressionFlags
    files = ("docs/compression.png",)
    # PowerSGD's saved state (each bucket's low-rank factors, its error feedback) is shaped by the hook and its rank
    fixed_on_resume = {"ddp_comm_hook": "PowerSGD's saved state is the hook's own, shaped by its kind and rank",
                       "power_sgd_rank": "PowerSGD's saved low-rank factors and warm start are of this rank"}

    def __init__(self) -> None:
        self.traffic = None  # the bytes the hook sent, counted (parts/compression/hooks.py)
        self.power_sgd = None  # the hook's PowerSGDState: what checkpoints keep

    def check_flags(self, flags: Flags) -> None:
        """--power_sgd_* set PowerSGD, and PowerSGD needs two plain steps first (torch's rule with error feedback);
        a model split over processes (pipeline stages) has no DDP buckets to hook."""
        from training.arguments import flags_given, split_model

        args = flags.train
        if args.parts.compression.ddp_comm_hook and (split := split_model(flags)):
            raise ArgumentError(f"--ddp_comm_hook with {split} is not supported (DDP's gradient buckets are hooked "
                                "where every process holds the whole model); drop it, or train without the split")
        if "power_sgd" not in (args.parts.compression.ddp_comm_hook or ""):
            if given := flags_given(args, ("power_sgd_rank", "power_sgd_start_step")):
                raise ArgumentError(f"--{given[0]} is for --ddp_comm_hook power_sgd or batched_power_sgd: add one, or "
                                    "drop it")
        if args.parts.compression.power_sgd_rank < 1 or args.parts.compression.power_sgd_start_step < 2:
            raise ArgumentError(f"--power_sgd_rank must be >= 1 and --power_sgd_start_step >= 2; got "
                                f"{args.parts.compression.power_sgd_rank}, {args.parts.compression.power_sgd_start_step}")

    def check_launch(self, launch: Launch) -> None:
        from parts.compression.hooks import check_comm_hook

        check_comm_hook(launch.args.parts.compression.ddp_comm_hook, launch.strategy, launch.processes, launch.on_cpu)

    def ddp_settings(self, launch: Launch) -> dict:
        """PowerSGD keeps state per gradient bucket, and DDP re-orders its buckets after the first step of every
        launch (by the order gradients arrived): a resumed run would apply the saved state to other parameters.
        Looking for unused parameters keeps the buckets in their first order, in every launch. On gloo (CPU)
        torch's PowerSGD hooks deadlock at the first compressed step once there are two buckets or more
        (measured, torch 2.13): one bucket holds every gradient there."""
        if "power_sgd" not in (launch.args.parts.compression.ddp_comm_hook or ""):
            return {}
        return {"find_unused_parameters": True, **({"bucket_cap_mb": ONE_BUCKET_MB} if launch.on_cpu else {})}

    def after_prepare(self, training: Training) -> None:
        """The hook on the prepared DDP model (PowerSGD's state then goes into every checkpoint)."""
        from parts.compression.hooks import power_sgd_state, register_comm_hook

        args = training.args
        self.traffic = register_comm_hook(training.model, args.parts.compression.ddp_comm_hook, args.parts.compression.power_sgd_rank,
                                          args.parts.compression.power_sgd_start_step)
        self.power_sgd = power_sgd_state(training.model)

    def save_state(self, checkpoint: CheckpointFiles) -> None:
        """Each rank's PowerSGD state (its error feedback differs per rank)."""
        if self.power_sgd is not None:
            from parts.compression.hooks import save_power_sgd

            save_power_sgd(self.power_sgd, checkpoint.accelerator, checkpoint.directory)

    def load_state(self, checkpoint: CheckpointFiles) -> None:
        """PowerSGD's state, alike on every rank whatever number of processes saved it."""
        if self.power_sgd is not None:
            from parts.compression.hooks import load_power_sgd

            load_power_sgd(self.power_sgd, checkpoint.accelerator, checkpoint.directory)

    def summary(self, steps_run: int) -> dict:
        """The bytes per step the hook sent."""
        if self.traffic is None or not steps_run:
            return {}
        return {"gradient_allreduce_bytes_per_step": self.traffic.bytes_sent / steps_run}


PART = Compression()
