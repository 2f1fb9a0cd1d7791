"""The average itself: of each trained parameter, this rank's share (training/strategy/shares.py: the whole under DDP,
FSDP2's rows, ZeRO's fp32 partition), in float32 at least, updated in place without a host sync; swapped into the
weights the forward reads and back; saved and loaded in the tensor format of model_state/."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from training.checkpoints.tensors import load_shares, save_shares
from training.errors import ResumeError
from training.strategy.shares import Share, shares_of, trained_parameters, whole_shape, write_shares

FOLDER = "ema"  # in each checkpoint: rank<N>.safetensors, each rank's share of the average

logger = get_logger(__name__)


class WeightAverage:
    """ema = decay * ema + (1 - decay) * weights, counted as ema-pytorch counts its `update()` calls: with the steps
    numbered from 0 (the first optimizer step is 0), at steps 0, every, 2 * every, ..., and a copy of the weights
    at those up to `after` (its `update_after_step`). The trained parameters only (under LoRA, the adapter's)."""

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, decay: float, after: int, every: int) -> None:
        self.accelerator, self.model, self.decay, self.after, self.every = accelerator, model, decay, after, every
        # found once, not at every update: the prepared parameters stay the same objects (FSDP2's the sharded ones)
        self.parameters = trained_parameters(accelerator, model)
        self.shapes = {name: whole_shape(tensor) for name, tensor in self.parameters.items()}
        self.shares: dict[str, Share | None] = {}
        self.start_from_weights()

    def start_from_weights(self) -> None:
        """The average set to the weights as they are, in float32 at least."""
        self.shares = {name: Share(share.start, share.values.to(torch.promote_types(share.values.dtype, torch.float32),
                                                                copy=True), share.replicated) if share else None
                       for name, share in self._live().items()}

    def _live(self) -> dict[str, Share | None]:
        """This rank's share of each trained parameter's value as the optimizer steps it (None: it holds none)."""
        return {name: shares_of(tensor).get("value") for name, tensor in self.parameters.items()}

    def update(self, step: int, skipped: torch.Tensor | bool) -> None:
        """After optimizer step `step` (from 1): the average moved towards the weights, unless the update was skipped
        (fp16: a device tensor, read without a host sync where the average is on that device)."""
        counted = step - 1  # ema-pytorch's count of the calls before this one
        if counted % self.every:
            return
        weight = 1.0 if counted <= self.after else 1.0 - self.decay  # lerp by 1 is the weights exactly
        weights = {}  # by device: the skip tensor moved once to each (a CPU copy of a GPU one is a sync)
        live = self._live()
        for name, share in self.shares.items():
            if share is None:
                continue
            device = share.values.device
            if torch.is_tensor(skipped) and device not in weights:
                weights[device] = torch.where(skipped, 0.0, weight).to(device, share.values.dtype)
            share.values.lerp_(live[name].values.to(share.values.dtype), weights.get(device, weight))

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The average's weights in the model the forward reads, and the trained ones back on leaving (on every
        rank: a collective may run)."""
        trained = {name: share.values.clone() if share else None for name, share in self._live().items()}
        write_shares(self.accelerator, self.model, {name: share.values if share else None
                                                    for name, share in self.shares.items()})
        try:
            yield
        finally:
            write_shares(self.accelerator, self.model, trained)

    def save(self, checkpoint: Path, stamp: Mapping[str, str]) -> None:
        """This rank's shares into `checkpoint`/ema/, stamped with the run and step (the manifest hashes the files)."""
        save_shares(self.accelerator, checkpoint / FOLDER, self.shares, self.shapes, dict(stamp))

    def load(self, checkpoint: Path, required: bool = False) -> None:
        """The saved average cut to this run's shares; a checkpoint without one leaves the average at the resumed
        weights (it starts now), or is refused where `required` (an evaluation of the average)."""
        if not (checkpoint / FOLDER).is_dir() and required:
            raise ResumeError(f"{checkpoint} holds no average of the weights (saved without --ema_decay), so "
                              "--do_train false --ema_decay has none to evaluate; drop --ema_decay")
        if not (checkpoint / FOLDER).is_dir():
            logger.warning(f"{checkpoint} holds no average of the weights (saved without --ema_decay): the average "
                           "starts from the resumed weights", main_process_only=True)
            self.start_from_weights()
            return
        loaded = load_shares(checkpoint, FOLDER, self.shares, self.shapes)
        for name, share in self.shares.items():
            if share is not None:
                share.values.copy_(loaded[name])
