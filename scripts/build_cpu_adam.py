"""Compile DeepSpeed's CPU Adam now, the optimizer that ZeRO optimizer offload steps on the CPU
(accelerate_configs/deepspeed_zero3_offload.yaml).

`pip install deepspeed` does not compile it: DeepSpeed builds it on first use, a minute or two
on 2 CPU cores, inside whichever run or test needs it first. The README's test command runs
this as part of setting up, so that the suite's time is the tests'. The build is cached per
machine (TORCH_EXTENSIONS_DIR, by default ~/.cache/torch_extensions): run again, it takes a
second or two.

    python scripts/build_cpu_adam.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from training.flags import TrainArguments  # noqa: E402
from training.optim import prepare_cpu_adam  # noqa: E402


def main() -> int:
    started = time.perf_counter()
    print("building DeepSpeed's CPU Adam (a minute or two, once per machine)", file=sys.stderr, flush=True)
    prepare_cpu_adam(TrainArguments())  # as train.py does: the same build flags, so its runs find this build
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load(verbose=False)
    except Exception as error:  # the compiler's or ninja's failure, in its last line
        cause = str(error.__cause__ or error).strip().splitlines()[-1]
        print(f"error: DeepSpeed's CPU Adam did not build ({cause}); install a C++ compiler and ninja "
              "(`pip install ninja`), or leave out the offload configs", file=sys.stderr)
        return 1
    print(f"DeepSpeed's CPU Adam is built ({time.perf_counter() - started:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
