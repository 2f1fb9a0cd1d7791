"""A learning-rate schedule of your own, as a part: after the core's warmup, a stable rate, then a 1-sqrt cooldown over
the run's last fraction (warmup-stable-decay, as Hägele et al. 2024 train beyond a fixed length). Copy this file to
parts/wsd/__init__.py: the core finds the part there (training/parts.py), adds its flag, and builds the schedule from
its `lr_multiplier` after its own linear warmup; the scheduler's checkpoint state stays the core's. transformers'
built-in version needs no code: --lr_scheduler_type warmup_stable_decay (docs/recipes.md)."""

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from training.parts import Part, Schedule


@dataclass
class WsdFlags:
    wsd_decay_fraction: float = field(default=0.0, metadata={
        "help": "Decay the learning rate (1-sqrt) over this last fraction of the run, stable before it; 0: off."})


class WarmupStableDecay(Part):
    name = "wsd"
    description = "warmup, a stable rate, then a 1-sqrt cooldown over the run's last fraction (--wsd_decay_fraction)"
    flags = WsdFlags

    def lr_multiplier(self, schedule: Schedule) -> Callable[[int], float] | None:
        """1 until the cooldown, then 1 - sqrt(its progress), falling towards 0 over the run's last steps."""
        fraction = schedule.args.parts.wsd.wsd_decay_fraction
        if not fraction:
            return None
        decay_steps = max(1, round(fraction * schedule.total_steps))
        decay_start = schedule.total_steps - decay_steps
        return lambda step: 1.0 if step < decay_start else 1.0 - math.sqrt((step - decay_start) / decay_steps)


PART = WarmupStableDecay()
