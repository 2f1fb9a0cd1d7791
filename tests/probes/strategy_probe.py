"""Launched by tests/test_cpu_accommodation.py in 2 real processes under an accelerate config.

Builds the Accelerator the way SCENARIO says, then records what accelerate set up and
what `verify_strategy` concluded, as JSON in OUT_DIR/rank_<rank>.json.
  plain        Accelerator()                                  accelerate's own choice on CPU
  gloo_kwarg   Accelerator(kwargs_handlers=[gloo])            a common "fix" found online
  cpu_flag     Accelerator(cpu=True)                          the DDP-on-CPU switch
  template     training.strategy.accelerator.build_accelerator(args)   what train.py does (--ddp_timeout 123)
"""

import json
import os
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import InitProcessGroupKwargs

from training.arguments import parse_args
from training.errors import StrategyError
from training.process_exit import exit_process
from training.strategy import verify_strategy
from training.strategy.accelerator import build_accelerator

scenario, out_dir = sys.argv[1], Path(sys.argv[2])
builders = {
    "plain": lambda: Accelerator(),
    "gloo_kwarg": lambda: Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")]),
    "cpu_flag": lambda: Accelerator(cpu=True),
    "template": lambda: build_accelerator(parse_args(["--ddp_timeout", "123", "--output_dir", str(out_dir)])[2]),  # not 1800 s
}
accelerator = builders[scenario]()
record = {
    "distributed_type": accelerator.distributed_type.value,
    "num_processes": accelerator.num_processes,
    "device": accelerator.device.type,
    "backend": accelerator.state.backend,
}
try:
    verify_strategy(accelerator)
    if scenario == "template":
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)  # DeepSpeed sizes its batch from it
        model, _, _ = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
        verify_strategy(accelerator, model)
        record["wrapper"] = type(model).__name__
        group = torch.distributed.distributed_c10d._get_default_group()
        record["timeout_s"] = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    record["verdict"] = "ok"
except StrategyError as error:
    record["verdict"] = f"refused: {error}"
out_dir.mkdir(parents=True, exist_ok=True)
(out_dir / f"rank_{os.environ['RANK']}.json").write_text(json.dumps(record))
exit_process(0)  # as train.py ends: gloo's worker threads can abort the interpreter's teardown (issue 22)
