"""parts/compile: --torch_compile trains what eager trains, its options, and the refusals."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from parts.compile import PART
from parts.compile.graph import compile_options, dynamo_plugin
from tests.test_performance import SHORT_RUN
from training.arguments import ArgumentError, parse_args
from training.errors import StrategyError
from training.metrics import read_metrics
from training.parts import Launch
from training.strategy import requested_strategy

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


def test_torch_compile_trains_the_same_model_on_ddp(cached_run) -> None:
    """Also with a checkpoint saved midway: unwrapping the model to save it once pointed torch.compile's wrapper
    at the module inside DDP, and the steps after it no longer averaged their gradients."""
    eager, compiled = cached_run("ddp", *SHORT_RUN), cached_run("ddp", *SHORT_RUN, "--torch_compile")
    saved_midway = cached_run("ddp", *SHORT_RUN, "--torch_compile", "--save_steps", "2")
    assert "model wrapped as OptimizedModule" in (compiled / "launch.log").read_text()  # compiled, around DDP
    losses = [[m["loss"] for m in read_metrics(run) if "loss" in m] for run in (eager, compiled, saved_midway)]
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)  # inductor reorders float math, nothing more
    assert (saved_midway / "checkpoints" / "step_2").is_dir() and losses[2] == pytest.approx(losses[1], rel=1e-6)
    # final/ holds the model's own weight names (not torch.compile's `_orig_mod.` ones): it loads whole,
    # with the weights the eager run trained
    models = [AutoModelForCausalLM.from_pretrained(run / "final", output_loading_info=True) for run in (eager, compiled)]
    assert models[1][1]["missing_keys"] == set() and models[1][1]["unexpected_keys"] == set()
    for name, weight in models[1][0].state_dict().items():
        torch.testing.assert_close(weight, models[0][0].state_dict()[name], rtol=0, atol=1e-4)


@pytest.mark.quick
def test_a_compile_mode_switches_compilation_on_as_in_transformers(tmp_path) -> None:
    _, _, train_args = parse_args(["--torch_compile_mode", "max-autotune-no-cudagraphs", "--torch_compile_fullgraph",
                                   "--output_dir", str(tmp_path)])
    assert train_args.parts.compile.torch_compile and train_args.parts.compile.torch_compile_fullgraph
    assert compile_options(train_args) == {"mode": "max-autotune-no-cudagraphs", "fullgraph": True, "dynamic": None}
    plugin = dynamo_plugin(train_args)
    assert (plugin.backend.value, plugin.mode, plugin.fullgraph) == ("INDUCTOR", "max-autotune-no-cudagraphs", True)
    _, _, eager = parse_args(["--output_dir", str(tmp_path)])
    assert dynamo_plugin(eager).backend.value == "NO"


@pytest.mark.quick
@pytest.mark.parametrize(("argv", "message"), [
    (["--torch_compile_fullgraph"], "--torch_compile_fullgraph is an option of --torch_compile: add "),
    (["--torch_compile_regional"], "--torch_compile_regional is an option of --torch_compile"),
    (["--torch_compile_mode", "fast"], "argument --torch_compile_mode.*: invalid choice: 'fast'"),
])
def test_compile_options_without_compilation_are_refused(tmp_path, argv, message) -> None:
    with pytest.raises(ArgumentError, match=message):
        parse_args([*argv, "--output_dir", str(tmp_path / "out")])


@pytest.mark.quick
def test_the_launchers_own_torch_compile_is_refused_before_any_process_group(monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    with pytest.raises(StrategyError, match="dynamo backend inductor, which train.py would replace"):
        PART.check_launch(Launch(None, requested_strategy(), 1, True))


@pytest.mark.quick
@pytest.mark.parametrize(("older_torch", "mask_skip"), [
    pytest.param(False, False, id="pinned torch"), pytest.param(True, False, id="older torch"),
    pytest.param(True, True, id="older torch, profile_run --causal_mask_skip", marks=pytest.mark.parts("benchmarks"))])
def test_compiled_attention_on_packed_blocks_gets_no_mask_tensor(older_torch: bool, mask_skip: bool,
                                                                 monkeypatch) -> None:
    """A packed batch carries no attention_mask, so under torch.compile transformers calls SDPA with `is_causal`
    and no (batch, 1, T, T) mask: the fast causal kernels. A torch older than the pin (before pytorch#176499; an
    H200 image's 2.11, where compiled attention ran 2.2x slower per call) read `is_exporting()` as True while
    compiling and built the mask, as a patch makes the pinned one do here; profile_run's switch undoes it."""
    import transformers.masking_utils as masking

    import scripts.profile_run as profile_run
    from models.language import build_model, build_tokenizer
    from training.tasks import CausalLM

    if older_torch:
        monkeypatch.setattr(masking, "is_torchdynamo_exporting", lambda: True)  # undone after the test
    if mask_skip:
        profile_run.skip_causal_mask_under_compile()
    model = build_model(None, "llama-tiny", build_tokenizer(None, None))
    calls = []

    def inspecting_backend(graph: torch.fx.GraphModule, _inputs) -> Callable:
        calls.extend(node.kwargs for node in graph.graph.nodes if "scaled_dot_product" in str(node.target))
        return graph.forward

    torch._dynamo.reset()
    batch = {"input_ids": torch.randint(0, 100, (2, 16))}
    torch.compile(CausalLM.forward, backend=inspecting_backend)(None, model, batch)
    assert len(calls) == model.config.num_hidden_layers
    masked = older_torch and not mask_skip
    assert all((call["attn_mask"] is not None, call["is_causal"]) == (masked, not masked) for call in calls)
