"""parts/compile: --torch_compile trains what eager trains, its options, and the refusals."""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from parts.compile import PART
from parts.compile.graph import compile_options, dynamo_plugin
from tests.harness import assert_continues_exactly, train
from tests.test_parity import LOSS_TOLERANCE, WEIGHT_TOLERANCE
from tests.test_performance import SHORT_RUN
from training.arguments import ArgumentError, parse_args
from training.errors import StrategyError
from training.metrics import read_metrics
from training.parts import Launch, Training
from training.strategy import Strategy, requested_strategy

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)


def test_torch_compile_trains_the_same_model_on_ddp(cached_run, tmp_path) -> None:
    """Also with a checkpoint saved midway: unwrapping the model to save it once pointed torch.compile's wrapper
    at the module inside DDP, and the steps after it no longer averaged their gradients; and resumed from it,
    compiled again: the same steps, to a resume's tolerance."""
    eager, compiled = cached_run("ddp", *SHORT_RUN), cached_run("ddp", *SHORT_RUN, "--torch_compile")
    saved_midway = cached_run("ddp", *SHORT_RUN, "--torch_compile", "--save_steps", "2")
    assert "model wrapped as OptimizedModule" in (compiled / "launch.log").read_text()  # compiled, around DDP
    losses = [[m["loss"] for m in read_metrics(run) if "loss" in m] for run in (eager, compiled, saved_midway)]
    # inductor reorders float math, nothing more: within the parity tests' tolerances
    assert len(losses[0]) == len(losses[1]) == 4 and max(abs(a - b) for a, b in zip(losses[1], losses[0])) <= LOSS_TOLERANCE
    assert (saved_midway / "checkpoints" / "step_2").is_dir() and losses[2] == pytest.approx(losses[1], rel=1e-6)
    resumed = tmp_path / "resumed"
    train("ddp", resumed, *SHORT_RUN, "--torch_compile", "--save_steps", "2",
          "--resume_from_checkpoint", str(saved_midway / "checkpoints" / "step_2"))
    assert_continues_exactly(saved_midway, resumed, from_step=2, last_step=4)
    # final/ holds the model's own weight names (not torch.compile's `_orig_mod.` ones): it loads whole,
    # with the weights the eager run trained
    models = [AutoModelForCausalLM.from_pretrained(run / "final", output_loading_info=True) for run in (eager, compiled)]
    assert models[1][1]["missing_keys"] == set() and models[1][1]["unexpected_keys"] == set()
    for name, weight in models[1][0].state_dict().items():
        torch.testing.assert_close(weight, models[0][0].state_dict()[name], rtol=0, atol=WEIGHT_TOLERANCE)


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


def test_unset_torch_compile_compiles_a_run_long_enough_to_pay_back(cached_run) -> None:
    """A run of 1,000 steps compiles its training step without being asked (on DDP, accumulating 2 micro-batches: DDP's
    no_sync micro-step is another graph), and trains what eager trains; a shorter one stays eager. The schedule is
    constant, so the two runs' first steps are the same steps."""
    flags = ("--per_device_train_batch_size", "1", "--block_size", "16", "--gradient_accumulation_steps", "2",
             "--lr_scheduler_type", "constant", "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no")
    long_run, short_run = cached_run("ddp", *flags, "--max_steps", "1000"), cached_run("ddp", *flags, "--max_steps", "4")
    assert "torch.compile: on (--torch_compile unset: 1000 steps, at least the 1,000" in (long_run / "launch.log").read_text()
    assert "torch.compile: off (--torch_compile unset: 4 steps, under the 1,000" in (short_run / "launch.log").read_text()
    assert [json.loads((run / "summary.json").read_text())["torch_compile"] for run in (long_run, short_run)] == [True, False]
    losses = [[m["loss"] for m in read_metrics(run) if "loss" in m][:4] for run in (long_run, short_run)]
    assert len(losses[0]) == 4 and max(abs(a - b) for a, b in zip(*losses)) <= LOSS_TOLERANCE  # the parity tests' own


def _training(argv: list[str], strategy: Strategy, max_steps: int, task_class: type | None = None,
              checkpointing: bool = False) -> Training:
    """What the compile part sees once the model is prepared: parsed flags, a task of `task_class`."""
    from training.tasks import CausalLM

    _, data_args, args = parse_args([*argv, "--output_dir", "/tmp/unused"])
    task = (task_class or CausalLM).__new__(task_class or CausalLM)
    task.name, task.data_args = "causal-lm", data_args
    model = SimpleNamespace(is_activation_checkpointing=checkpointing)
    return Training(SimpleNamespace(unwrap_model=lambda m: m), args, task, strategy, model, max_steps=max_steps)


@pytest.mark.quick
@pytest.mark.parametrize(("argv", "strategy", "max_steps", "other", "compiled", "why"), [
    ([], Strategy.SINGLE, 1000, {}, True, "1000 steps, at least the 1,000 that pay back"),
    ([], Strategy.DDP, 20000, {}, True, "20000 steps"),
    ([], Strategy.SINGLE, 999, {}, False, "999 steps, under the 1,000"),
    ([], Strategy.FSDP, 5000, {}, False, "fsdp: compiled by default on one process or DDP only"),
    ([], Strategy.DEEPSPEED, 5000, {}, False, "deepspeed: compiled by default"),
    ([], Strategy.DDP, 5000, {"objective": "a part's"}, False, "a part computes the loss"),
    ([], Strategy.DDP, 5000, {"task": "own loss"}, False, "task causal-lm has its own forward or loss"),
    ([], Strategy.DDP, 5000, {"checkpointing": True}, False, "--gradient_checkpointing"),
    (["--packing", "false"], Strategy.DDP, 5000, {}, False, "--packing false: batches of many shapes"),
    ([], Strategy.DDP, 5000, {"lora": "use_peft"}, False, "--use_peft True"),  # (parsing it needs a pretrained model)
    (["--pipeline_parallel_size", "2"], Strategy.DDP, 5000, {}, False, "--pipeline_parallel_size 2"),
    (["--ddp_comm_hook", "power_sgd"], Strategy.DDP, 5000, {}, False, "--ddp_comm_hook power_sgd"),
    (["--auto_find_batch_size"], Strategy.DDP, 5000, {}, False, "--auto_find_batch_size True"),
    (["--torch_compile", "false"], Strategy.DDP, 5000, {}, False, "--torch_compile false"),
    (["--do_train", "false", "--model_name_or_path", "."], Strategy.DDP, 5000, {}, False, "--do_train false"),
    (["--torch_compile"], Strategy.FSDP, 4, {"objective": "a part's"}, True, "--torch_compile true"),
])
def test_unset_torch_compile_compiles_the_plain_path_where_it_pays_back(argv, strategy, max_steps, other, compiled,
                                                                        why) -> None:
    from functools import partial

    from parts.compile.auto import compiles
    from training.step import objective_sums
    from training.tasks import CausalLM

    class OwnLoss(CausalLM):
        def loss_sums(self, logits, batch):
            return super().loss_sums(logits, batch)

    training = _training(argv, strategy, max_steps, OwnLoss if other.get("task") else None,
                         other.get("checkpointing", False))
    if switched := other.get("lora"):
        setattr(training.args.parts.lora, switched, True)
    objective = (lambda model, batch: None) if other.get("objective") else partial(objective_sums, training.task)
    decided, reason = compiles(objective, training)
    assert decided is compiled and why in reason, reason
