"""A custom model (recipes/conv_lm.py: a plain nn.Module wrapped once, trained by recipes/conv_lm_task.py) trains
under a sharded strategy, and its export loads outside this repository through transformers' trust_remote_code."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from recipes.conv_lm import ConvLMForCausalLM, register_custom_model
from tests.harness import REPO
from training.metrics import read_metrics

pytestmark = [pytest.mark.quick, pytest.mark.forked]  # every test here: the quick tier (pytest -m quick)

PROMPT_IDS = [[5, 17, 42, 8, 99, 3]]


@pytest.fixture(scope="module")
def fsdp_run(cached_run):
    return cached_run("fsdp", "--task", "recipes.conv_lm_task:ConvLMTask", "--max_steps", "6", "--logging_steps", "1")


def test_a_custom_model_trains_under_fsdp2_with_its_blocks_as_units(fsdp_run) -> None:
    log = (fsdp_run / "launch.log").read_text()
    assert "model wrapped as FSDPConvLMForCausalLM" in log  # FSDP2, one unit per ConvBlock (`_no_split_modules`)
    losses = [m["loss"] for m in read_metrics(fsdp_run) if "loss" in m]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert json.loads((fsdp_run / "summary.json").read_text())["strategy"] == "fsdp"


def test_the_export_loads_outside_the_repository_with_trust_remote_code(fsdp_run, tmp_path) -> None:
    final = fsdp_run / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["auto_map"] == {"AutoConfig": "conv_lm.ConvLMConfig", "AutoModelForCausalLM": "conv_lm.ConvLMForCausalLM"}
    assert (final / "conv_lm.py").read_text() == (REPO / "recipes" / "conv_lm.py").read_text()  # the code travels along
    # A fresh interpreter in another directory, without this repository on its path.
    outside = f"""
import json, torch
from transformers import AutoModelForCausalLM
try:
    AutoModelForCausalLM.from_pretrained({str(final)!r})
    refused = False
except ValueError as error:
    refused = "trust_remote_code" in str(error)
model = AutoModelForCausalLM.from_pretrained({str(final)!r}, trust_remote_code=True)
with torch.no_grad():
    logits = model(input_ids=torch.tensor({PROMPT_IDS})).logits
print("loaded:", json.dumps({{"module": type(model).__module__, "refused": refused, "logits": logits.flatten()[:64].tolist()}}))
"""
    result = subprocess.run([sys.executable, "-c", outside], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr[-3000:]
    loaded = json.loads(result.stdout.split("loaded:")[1])  # after transformers' own prompt text
    assert loaded["refused"]  # without trust_remote_code: refused, naming the flag
    assert loaded["module"].startswith("transformers_modules.")  # the code shipped in final/, not this repository's
    register_custom_model()
    here = ConvLMForCausalLM.from_pretrained(final)
    with torch.no_grad():
        expected = here(input_ids=torch.tensor(PROMPT_IDS)).logits.flatten()[:64]
    torch.testing.assert_close(torch.tensor(loaded["logits"]), expected, atol=1e-6, rtol=0)
