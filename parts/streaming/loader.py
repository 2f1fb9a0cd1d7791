"""The training batches of a stream (`--streaming`): each rank's share, its shuffle buffer, and its place in checkpoints.

- **Shares.** `split_dataset_by_node` gives each rank whole files when their count divides by the number of
  ranks, otherwise every n-th sequence of the whole stream (each rank then reads, tokenises and packs all of
  it): disjoint shares that together hold every sequence once per epoch.
- **Epochs are per rank.** Shares pack into different numbers of blocks, so each rank starts its next pass
  when its own share ends (shard order and shuffle buffer reseeded by epoch), and the run ends at `--max_steps`.
- **Shuffling.** A buffer of `--shuffle_buffer_size` blocks, drawn from with a generator seeded by seed, rank
  and epoch. The buffer and the generator go into checkpoints with the loader's position
  (torchdata's `StatefulDataLoader`, holding `datasets`' `state_dict`), one file per rank: a resumed run
  reads on from where it stopped, exactly, without reading the stream again.
- **No rank left waiting.** Before each micro-batch the ranks agree (an all-reduce on the CPU group) that each
  has one; if a rank's stream failed, every rank stops with that rank's error line.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import send_to_device
from datasets import IterableDataset
from datasets.distributed import split_dataset_by_node
from torchdata.stateful_dataloader import StatefulDataLoader

from data import DataError
from training.collectives import cpu_group
from training.errors import ResumeError

STREAM_STATE = "stream_rank{rank}.pt"  # in each checkpoint, one per rank
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata 0.11 calls it on every loader


class StreamLoader:
    """This rank's micro-batches, endlessly, epoch after epoch of its share of `stream`."""

    def __init__(self, accelerator: Accelerator, stream: IterableDataset, batch_size: int, loading: dict,
                 seed: int, buffer_size: int, timeout_s: int) -> None:
        """`loading`: the core's DataLoader settings (collate_fn, num_workers, a worker_init_fn)."""
        self.accelerator, self.batch_size, self.collate = accelerator, batch_size, loading["collate_fn"]
        self.rank, self.seed, self.buffer_size, self.timeout_s = accelerator.process_index, seed, max(1, buffer_size), timeout_s
        self.share = split_dataset_by_node(stream, rank=self.rank, world_size=accelerator.num_processes)
        self.loader = StatefulDataLoader(self.share, batch_size=None, num_workers=loading["num_workers"],
                                         worker_init_fn=loading.get("worker_init_fn"))
        self.epoch, self.buffer, self.exhausted, self.blocks_this_epoch = 0, [], False, 0
        self.generator = torch.Generator()
        self._new_epoch(0)

    def _new_epoch(self, epoch: int) -> None:
        self.epoch, self.exhausted, self.blocks_this_epoch = epoch, False, 0
        self.share.set_epoch(epoch)  # before the loader's iterator: its saved position is for this epoch's order
        self.generator.manual_seed(self.seed * 1_000_003 + self.rank * 1_009 + epoch)
        self.blocks = None

    def _next_block(self) -> dict:
        """The next block from the shuffle buffer, refilled from the stream; the next epoch when both are empty."""
        while True:
            if self.blocks is None:
                self.blocks = iter(self.loader)
            while not self.exhausted and len(self.buffer) < self.buffer_size:
                try:
                    self.buffer.append(next(self.blocks))
                    self.blocks_this_epoch += 1
                except StopIteration:
                    self.exhausted = True
            if self.buffer:
                chosen = int(torch.randint(len(self.buffer), (), generator=self.generator))
                self.buffer[chosen], self.buffer[-1] = self.buffer[-1], self.buffer[chosen]
                return self.buffer.pop()
            if self.blocks_this_epoch == 0:
                raise DataError(f"rank {self.rank}'s share of the training stream holds no complete sequence: the stream "
                                "is shorter than one block per rank; give more data or a smaller --block_size")
            self._new_epoch(self.epoch + 1)

    def _agreed(self, failure: str | None) -> None:
        """Raise on every rank if any rank's stream failed, with the first failing rank's message."""
        if self.accelerator.num_processes > 1:
            group = cpu_group(self.timeout_s)
            failed = torch.tensor([int(failure is not None)])
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
            if failed:
                messages = [None] * self.accelerator.num_processes
                dist.all_gather_object(messages, failure, group=group)
                failure = next(message for message in messages if message)
        if failure:
            raise DataError(failure)

    def __iter__(self) -> Iterator[dict]:
        while True:
            failure, batch = None, None
            try:
                batch = self.collate([self._next_block() for _ in range(self.batch_size)])
            except DataError as error:
                failure = str(error)
            self._agreed(failure)
            yield send_to_device(batch, self.accelerator.device, non_blocking=self.accelerator.non_blocking)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "exhausted": self.exhausted, "blocks_this_epoch": self.blocks_this_epoch,
                "buffer": self.buffer, "generator": self.generator.get_state(), "loader": self.loader.state_dict()}

    def save(self, directory: Path) -> None:
        """This rank's position, in the checkpoint being written."""
        torch.save(self.state_dict(), directory / STREAM_STATE.format(rank=self.rank))

    def load(self, directory: Path) -> None:
        """This rank's position from the checkpoint a run resumes; refused alike on every rank where the checkpoint's
        ranks were not this run's (each read its own share)."""
        saved = len(list(directory.glob(STREAM_STATE.format(rank="*"))))
        if saved != self.accelerator.num_processes:
            held = f"the stream positions of {saved} processes" if saved else "no stream position"
            raise ResumeError(f"{directory} holds {held}, and this run has {self.accelerator.num_processes}: a "
                              "streaming run resumes on as many processes as saved it")
        self.load_state_dict(torch.load(directory / STREAM_STATE.format(rank=self.rank), weights_only=True))

    def load_state_dict(self, state: dict) -> None:
        self._new_epoch(state["epoch"])
        self.exhausted, self.blocks_this_epoch, self.buffer = state["exhausted"], state["blocks_this_epoch"], state["buffer"]
        self.generator.set_state(state["generator"])
        if not self.exhausted:  # an ended pass's position would be applied to the next pass
            self.loader.load_state_dict(state["loader"])

