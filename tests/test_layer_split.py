"""`--device_map`: one process splitting its model's layers over its GPUs, with single.yaml.

On this CPU-only machine there is one device, so the run proves the flag trains end to end
and the refusals; the split over several GPUs itself needs a machine with two or more.
"""

from __future__ import annotations

import pytest

from parts.layer_split.split import split_layers
from tests.harness import TINY_RUN, tiny_resnet, train
from training.arguments import ArgumentError, parse_args
from training.errors import StrategyError

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


def test_device_map_trains_in_one_process(tmp_path) -> None:
    result = train("single", tmp_path, "--device_map", "balanced", "--max_steps", "3", "--eval_steps", "3")
    assert "--device_map balanced: the whole model fits on cpu; nothing to split" in result.stderr + result.stdout
    assert (tmp_path / "final" / "model.safetensors").is_file()


@pytest.mark.quick
@pytest.mark.parametrize("launched", [{"WORLD_SIZE": "2"}, {"ACCELERATE_USE_FSDP": "true"}], ids=["ddp", "fsdp"])
def test_device_map_is_refused_with_any_other_strategy(launched, tmp_path, monkeypatch) -> None:
    for name, value in launched.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match="use --config_file accelerate_configs/single.yaml"):
        parse_args([*TINY_RUN, "--device_map", "auto", "--output_dir", str(tmp_path)])


@pytest.mark.quick
def test_layers_that_would_be_offloaded_and_never_train_are_refused() -> None:
    model = tiny_resnet()
    with pytest.raises(StrategyError, match=r"would be offloaded, where they do not train"):
        split_layers(model, "sequential", max_memory={"cpu": 100_000})  # the rest would go to disk
