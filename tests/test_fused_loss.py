"""parts/fused_loss: `--fused_linear_cross_entropy` computes the causal LM's training loss with the output layer, in
chunks, without logits. The same loss and gradients as the logits' (fp32, and under bf16 autocast); every sharding
strategy's parity run with it gives one process's losses and weights; with bf16 parameters it trains what they
train; and the refusals, each one line."""

from __future__ import annotations

import copy
import math
import shutil
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from parts.fused_loss import PART
from parts.fused_loss.head import LossHead, torch_kernel
from scripts.compare_metrics import compare, worst_difference
from tests.harness import (
    TINY_RUN,
    assert_same_final_weights,
    bad_input_errors,
    launch,
    logged_after,
    parity_args,
    read_metrics,
    train,
)
from tests.test_parity import LOSS_TOLERANCE, WEIGHT_TOLERANCE
from training.arguments import parse_args
from training.errors import ArgumentError
from training.loss import IGNORE_INDEX, token_loss_sums
from training.parts import Training
from training.tasks import CausalLM

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

FLAG = "--fused_linear_cross_entropy"
CAUSAL_LM = SimpleNamespace(forward=partial(CausalLM.forward, None))  # the task's forward, all the head runs
NO_WRAPPER = SimpleNamespace(unwrap_model=lambda model, keep_torch_compile: model)  # an Accelerator's, one process


def batch_of(vocabulary: int) -> dict[str, torch.Tensor]:
    input_ids = torch.randint(0, vocabulary, (3, 16), generator=torch.Generator().manual_seed(0))
    labels = input_ids.clone()
    labels[0, 10:] = IGNORE_INDEX  # padding
    return {"input_ids": input_ids, "labels": labels, "attention_mask": torch.ones_like(input_ids)}


@pytest.mark.quick
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 5e-6), (torch.bfloat16, 3e-2)],
                         ids=["fp32", "bf16"])  # measured over 15 initialisations: up to 8.7e-7 and 1.1e-2
def test_the_output_layer_gives_the_logits_loss_and_gradients(tiny_model, dtype, tolerance) -> None:
    """Against the logits' cross-entropy: the same sum and parameter gradients, in fp32 and under bf16 autocast
    (the matmul then in bf16, as the logits' is); with no targets set the layer gives the logits again."""
    plain, fused = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    batch = batch_of(plain.config.vocab_size)
    head = LossHead(fused.get_output_embeddings(), torch_kernel)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype != torch.float32):
        expected = token_loss_sums(CAUSAL_LM.forward(plain, batch), batch["labels"])[0].sum()
        loss = head.loss_sums(CAUSAL_LM, fused, batch)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, expected, rtol=tolerance / 10, atol=0)  # measured: 1e-8 and 3.1e-4
    expected.backward()
    loss.backward()
    for (name, parameter), fused_parameter in zip(plain.named_parameters(), fused.parameters(), strict=True):
        torch.testing.assert_close(fused_parameter.grad, parameter.grad, rtol=0,  # relative to the largest entry
                                   atol=tolerance * parameter.grad.abs().max().item(), msg=name)
    with torch.no_grad():  # evaluation: the logits
        torch.testing.assert_close(CAUSAL_LM.forward(fused, batch), CAUSAL_LM.forward(plain, batch))


@pytest.mark.quick
def test_a_model_that_changes_its_output_layers_result_is_refused_in_one_line(tiny_model) -> None:
    """A softcap or a scaling of the logits after the output layer would act on the loss: the first step stops. So
    does a forward that never calls the layer as a module."""
    model = copy.deepcopy(tiny_model)
    head = LossHead(model.get_output_embeddings(), torch_kernel)
    model.get_output_embeddings().register_forward_hook(lambda layer, inputs, output: output * 2)
    with pytest.raises(ArgumentError, match="^--fused_linear_cross_entropy: the model changes what its output "
                                            r"layer returns \(a scaling or a softcap of the logits\).*drop the flag$"):
        head.loss_sums(CAUSAL_LM, model, batch_of(model.config.vocab_size))
    elsewhere = LossHead(torch.nn.Linear(2, 2), torch_kernel)  # a layer the model does not call
    with pytest.raises(ArgumentError, match="^--fused_linear_cross_entropy: the model's forward does not call its "
                                            r"output layer \(get_output_embeddings\(\)\) as a module: drop the flag$"):
        elsewhere.loss_sums(CAUSAL_LM, model, batch_of(model.config.vocab_size))


@pytest.mark.quick
def test_a_non_finite_first_loss_goes_on_to_the_non_finite_guard(tiny_model) -> None:
    """A NaN sum is not a change of the layer's result: the step returns it, and the loop's guard names it."""
    model = copy.deepcopy(tiny_model)
    head = LossHead(model.get_output_embeddings(), lambda hidden, weight, bias, targets: (hidden.sum() * math.nan))
    assert head.loss_sums(CAUSAL_LM, model, batch_of(model.config.vocab_size)).isnan()


@pytest.mark.quick
def test_a_sum_cast_to_bf16_on_its_way_out_keeps_the_layers_fp32_value_and_gradient(tiny_model) -> None:
    """As FSDP2's bf16 policy casts a module's output: the loss is the layer's fp32 sum, its gradient the same."""
    cast, plain = copy.deepcopy(tiny_model), copy.deepcopy(tiny_model)
    batch = batch_of(cast.config.vocab_size)
    heads = [LossHead(model.get_output_embeddings(), torch_kernel) for model in (cast, plain)]
    cast.get_output_embeddings().register_forward_hook(lambda layer, inputs, output: output.to(torch.bfloat16))
    losses = [head.loss_sums(CAUSAL_LM, model, batch) for head, model in zip(heads, (cast, plain))]
    assert losses[0].dtype == torch.float32 and torch.equal(losses[0], losses[1])
    for loss in losses:
        loss.backward()
    for parameter, expected in zip(cast.parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(parameter.grad, expected.grad, rtol=2**-8, atol=0)  # the scale rounded to bf16


@pytest.mark.quick
@pytest.mark.parametrize("clash", [
    pytest.param(("--pipeline_parallel_size", "2"), marks=pytest.mark.parts("pipeline")),
    pytest.param(("--torch_compile",), marks=pytest.mark.parts("compile")),
    pytest.param(("--teacher_model_name_or_path", "teacher"), marks=pytest.mark.parts("distillation")),
], ids=lambda clash: clash[0])
def test_a_step_that_computes_its_loss_elsewhere_is_refused(clash: tuple[str, ...], tmp_path) -> None:
    """torch.compile fuses the loss with the model itself; pipeline stages and distillation run their own loss."""
    with pytest.raises(ArgumentError, match=f"^{FLAG} with {clash[0]} is not supported: drop one$"):
        parse_args([FLAG, *clash, "--output_dir", str(tmp_path)])


@pytest.mark.quick
def test_the_dry_run_names_the_kernel(tmp_path) -> None:
    from tests.test_dry_run import planned

    assert ("loss:            fused with the output layer (torch's F.linear_cross_entropy, 1024 tokens per chunk); "
            "no logits") in planned(tmp_path, FLAG)


@pytest.mark.quick
@pytest.mark.parts("recipes")
def test_the_dry_run_refuses_a_task_with_its_own_objective(tmp_path) -> None:
    from tests.test_dry_run import planned

    with pytest.raises(ArgumentError, match="task recipes.label_smoothing:LabelSmoothedLM has its own forward or "
                                            "objective: drop the flag$"):
        planned(tmp_path, FLAG, "--task", "recipes.label_smoothing:LabelSmoothedLM")


@pytest.mark.quick
def test_a_model_without_a_linear_output_layer_is_refused(tmp_path) -> None:
    args = parse_args([FLAG, "--output_dir", str(tmp_path)])[2]
    task = object.__new__(CausalLM)  # the core's task (its methods are all the check reads)
    with pytest.raises(ArgumentError, match=f"^{FLAG} needs a model whose get_output_embeddings.. is an nn.Linear "
                                            r"\(a transformers causal LM\); Sequential has none: drop the flag$"):
        PART.training_objective(None, Training(NO_WRAPPER, args, task, None, torch.nn.Sequential(torch.nn.Embedding(4, 2))))


@pytest.mark.parts("recipes")
def test_a_task_with_its_own_objective_is_refused_in_one_line_and_exit_2(tmp_path) -> None:
    """A real launch (2 processes): label smoothing (recipe c) would be dropped, so the flag is refused."""
    result = launch("ddp", "train.py", *TINY_RUN, "--output_dir", str(tmp_path), FLAG,
                    "--task", "recipes.label_smoothing:LabelSmoothedLM")
    assert bad_input_errors(result) == [
        f"error: {FLAG} computes the causal LM's next-token cross-entropy; task recipes.label_smoothing:LabelSmoothedLM "
        "has its own forward or objective: drop the flag"]


@pytest.mark.parametrize("config", ["ddp", "fsdp", "deepspeed_zero3"])
def test_every_sharding_matches_one_process_without_logits(config: str, cached_run, strategy_run, base_model) -> None:
    """The parity run (tests/conftest.py `parity_args`) with the flag, against one process's without it: under FSDP2
    and ZeRO-3 the output layer's weight is gathered inside the model's forward, where the loss now runs."""
    run = cached_run(config, *parity_args(config, base_model), FLAG)
    reference = strategy_run("single")
    assert "--fused_linear_cross_entropy: the training loss is computed with the output layer" in (
        run / "launch.log").read_text()
    differences = compare(reference, run, keys=("loss", "lr", "eval_loss"))
    assert len(differences) == 12 * 2 + 3  # as tests/test_parity.py: every step, and the three evaluations
    assert (worst := worst_difference(differences)).absolute <= LOSS_TOLERANCE, worst
    assert_same_final_weights(reference, run, atol=WEIGHT_TOLERANCE)


def test_a_fused_run_resumed_under_another_strategy_continues_one_process_run(cached_run, strategy_run, base_model,
                                                                              tmp_path) -> None:
    """fsdp.yaml's step-6 checkpoint of the fused parity run, resumed under deepspeed_zero3.yaml with the flag:
    steps 7 to 12, the last evaluation and the final weights are one process's without it."""
    saved = cached_run("fsdp", *parity_args("fsdp", base_model), FLAG)
    shutil.copytree(saved / "checkpoints" / "step_6", tmp_path / "checkpoints" / "step_6")
    result = train("deepspeed_zero3", tmp_path, *parity_args("deepspeed_zero3", base_model), FLAG,
                   "--resume_from_checkpoint", "latest")
    assert "resuming a fsdp checkpoint of 2 processes under deepspeed_zero3 with 2\n" in result.stderr
    reference = strategy_run("single")
    expected, logged = logged_after(reference, 6), logged_after(tmp_path, 6)
    assert logged.keys() == expected.keys() and len(logged) == 13  # loss and lr at steps 7-12, the evaluation at 12
    assert all(logged[entry] == pytest.approx(expected[entry], abs=LOSS_TOLERANCE) for entry in expected), logged
    assert_same_final_weights(reference, tmp_path, atol=WEIGHT_TOLERANCE)


@pytest.mark.parametrize(("config", "flags"), [
    pytest.param("ddp", ("--mixed_precision_param", "bfloat16"), marks=pytest.mark.parts("bf16_params"),
                 id="ddp, bf16 parameters"),
    pytest.param("fsdp", (), id="fsdp"),
    pytest.param("deepspeed_zero3", (), id="deepspeed_zero3"),
])
def test_in_bf16_it_trains_what_the_logits_train(config: str, flags: tuple[str, ...], bf16_run) -> None:
    """2 processes, launched with bf16, 8 steps, against the same run without the flag. ddp.yaml with the eager GPU
    step's other lever, bf16 parameters: the layer's matmul on the bf16 copy of its weight; fsdp.yaml: FSDP2's bf16
    policy casts the sum to bf16 on its way out of the model (the logged loss stays the layer's fp32 sum);
    deepspeed_zero3.yaml: bf16 weights without autocast, the weight gathered in the forward."""
    runs = {"logits": bf16_run(config, *flags), "fused": bf16_run(config, *flags, FLAG)}
    losses = {name: [m["loss"] for m in read_metrics(run) if "loss" in m] for name, run in runs.items()}
    assert len(losses["fused"]) == 8
    assert losses["fused"] == pytest.approx(losses["logits"], rel=2e-3)
