"""Start-up work skipped: what DeepSpeed and py-cpuinfo do at every start that train.py never uses, each with its
measured saving (deepspeed.py). A project without this part trains the same, and starts slower: about 1.5 s of CPU
per rank at every DeepSpeed start, 3.6 s per rank at every ZeRO offload start, 45-60 s at the first DeepSpeed launch
on CPU in each environment, 16 s at the one CPU Adam build. It also releases a CPU Adam build's lock file that a
killed build left behind (build_lock.py), on which every later ZeRO-offload start would wait forever. See
docs/fast_start.md.
"""

from training.parts import Launch, Part


class FastStart(Part):
    name = "fast_start"
    description = ("DeepSpeed's start-up work that train.py never uses, skipped (seconds per rank per start); a CPU "
                   "Adam build lock left by a killed build, released")

    def at_start(self, launch: Launch) -> None:
        """Before the Accelerator and DeepSpeed start (and before DeepSpeed's CPU Adam compiles or loads): DeepSpeed's
        start-up work that train.py does not use, skipped, and a CPU Adam build's lock file left by a build killed
        while it held it, removed (torch would wait on it forever, at every later offload start)."""
        if launch.strategy.value != "deepspeed":
            return
        from parts.fast_start.build_lock import release_abandoned_build_lock
        from parts.fast_start.deepspeed import (ask_cpuinfo_once, build_without_debug_symbols,
                                                skip_deepspeed_inference_kernel, skip_deepspeed_muon_check)

        skip_deepspeed_muon_check()
        if launch.on_cpu:
            skip_deepspeed_inference_kernel()
        ask_cpuinfo_once()
        build_without_debug_symbols()
        release_abandoned_build_lock("cpu_adam")


PART = FastStart()
