"""CPU defaults that a run would otherwise leave slow: each process computes on its share of the cores, and keeps the
memory a step freed for the next (settings.py). No effect on GPUs. See docs/cpu_settings.md."""

import os

from training.parts import Part, Started


class CpuSettings(Part):
    name = "cpu_settings"
    description = "CPU defaults: each process's share of the cores, freed memory kept for the next step"

    def started(self, run: Started) -> str | None:
        """Without a GPU: the threads set (before parts/mfu's peak-FLOP probe, which measures them) and malloc kept."""
        if run.accelerator.device.type != "cpu":
            return None
        from parts.cpu_settings.settings import keep_freed_memory, use_share_of_cores

        keep_freed_memory()
        return use_share_of_cores(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


PART = CpuSettings()
