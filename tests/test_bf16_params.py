"""parts/bf16_params: `--mixed_precision_param bfloat16` computes the training step on bf16 copies of the fp32
parameters (ddp.yaml, one process). Against autocast: the same losses within bf16's tolerance, fp32 weights kept,
trained and exported; the same losses on 1 and 2 processes; and the refusals."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from parts.bf16_params import PART
from parts.bf16_params.cast import on_bf16_copies
from tests.harness import read_metrics
from training.arguments import parse_args
from training.errors import ArgumentError, StrategyError
from training.parts import Launch
from training.strategy import Strategy

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

FLAG = ("--mixed_precision_param", "bfloat16")


@pytest.mark.quick
def test_the_step_sees_bf16_parameters_and_hands_fp32_gradients_to_the_masters() -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8))
    model[1].weight = model[0].weight  # tied, as an input embedding and an output layer
    seen = []

    def objective(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.extend(parameter.dtype for parameter in (module[0].weight, module[1].weight, module[1].bias))
        assert module[1].weight is module[0].weight  # still tied
        return module(batch).float().square().sum()

    on_bf16_copies(objective, lambda wrapped: wrapped)(model, torch.tensor([1, 2, 3])).backward()
    assert seen == [torch.bfloat16] * 3
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    assert {parameter.grad.dtype for parameter in model.parameters()} == {torch.float32}
    assert all(parameter.grad.abs().sum() > 0 for parameter in model.parameters())


@pytest.mark.quick
@pytest.mark.parametrize(("strategy", "launcher_precision", "message"), [
    (Strategy.FSDP, "bf16", "is for ddp.yaml and one process: under fsdp --mixed_precision bf16 already computes on "
                            "bf16 parameters; drop the flag"),
    (Strategy.DEEPSPEED, "bf16", "under deepspeed --mixed_precision bf16 already computes on bf16 parameters"),
    (Strategy.DDP, "no", "needs the launcher's --mixed_precision bf16: add it, or drop the flag"),
])
def test_the_flag_is_refused_where_it_would_change_nothing(strategy, launcher_precision, message, tmp_path,
                                                           monkeypatch) -> None:
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launcher_precision)
    _, _, args = parse_args([*FLAG, "--output_dir", str(tmp_path)])
    with pytest.raises(StrategyError, match=f"^--mixed_precision_param bfloat16 .*{message}"):
        PART.check_launch(Launch(args, strategy, 2, True))
    PART.check_launch(Launch(parse_args(["--output_dir", str(tmp_path)])[2], strategy, 2, True))  # default: none refused
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    for accepted in (Strategy.DDP, Strategy.SINGLE):
        PART.check_launch(Launch(args, accepted, 2, True))


@pytest.mark.quick
@pytest.mark.parametrize("clash", [
    ("--gradient_checkpointing",),
    pytest.param(("--pipeline_parallel_size", "2"), marks=pytest.mark.parts("pipeline")),
    pytest.param(("--torch_compile",), marks=pytest.mark.parts("compile")),
    pytest.param(("--teacher_model_name_or_path", "teacher"), marks=pytest.mark.parts("distillation")),
], ids=lambda clash: clash[0])
def test_a_step_that_would_not_run_on_the_copies_is_refused(clash: tuple[str, ...], tmp_path) -> None:
    """Gradient checkpointing recomputes the forward during the backward, when the parameters are fp32 again
    (torch's checkpoint then raises on the dtype); pipeline stages and distillation run their own forward and
    objective; torch.compile with it is untested."""
    with pytest.raises(ArgumentError, match=f"^--mixed_precision_param bfloat16 with {clash[0]} is not supported"):
        parse_args([*FLAG, *clash, "--output_dir", str(tmp_path)])


@pytest.mark.quick
def test_batch_norm_keeps_fp32_parameters_beside_its_fp32_statistics() -> None:
    """A convolution's bf16 output into BatchNorm with fp32 weight and statistics, as under autocast: bf16 weights
    beside fp32 running statistics stop torch's kernel with a dtype error."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                                torch.nn.Linear(4 * 6 * 6, 2))
    seen = {}

    def objective(module: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        seen.update(conv=module[0].weight.dtype, norm=module[1].weight.dtype)
        return module(batch).float().sum()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = on_bf16_copies(objective, lambda wrapped: wrapped)(model, torch.randn(2, 3, 8, 8))
    loss.backward()
    assert seen == {"conv": torch.bfloat16, "norm": torch.float32}
    assert {parameter.grad.dtype for parameter in model.parameters()} == {torch.float32}


def test_bf16_parameters_train_what_autocast_trains_and_keep_fp32_weights(bf16_run) -> None:
    """ddp.yaml on 2 processes with and without the flag, and one process at the same global batch with it (two
    micro-steps accumulated: the copies are made again for each)."""
    runs = {"autocast": bf16_run("ddp"), "bf16 parameters": bf16_run("ddp", *FLAG),
            "bf16 parameters, one process": bf16_run("single", *FLAG, "--gradient_accumulation_steps", "2")}
    logs = {name: (run / "launch.log").read_text() for name, run in runs.items()}
    assert "computes on bf16 copies of the fp32 parameters" in logs["bf16 parameters"]
    assert "computes on bf16 copies" not in logs["autocast"]
    losses = {name: [m["loss"] for m in read_metrics(run) if "loss" in m] for name, run in runs.items()}
    assert len(losses["bf16 parameters"]) == 8
    assert losses["bf16 parameters"] == pytest.approx(losses["autocast"], rel=2e-3)  # measured: 2e-4
    assert losses["bf16 parameters"] != losses["autocast"]  # the residual stream and the norms ran in bf16
    assert losses["bf16 parameters, one process"] == pytest.approx(losses["bf16 parameters"], rel=1e-5)  # 4e-8
    weights = {name: load_file(run / "final" / "model.safetensors") for name, run in runs.items()}
    assert {tensor.dtype for tensor in weights["bf16 parameters"].values()} == {torch.float32}  # the masters
    for name, tensor in weights["bf16 parameters"].items():
        torch.testing.assert_close(tensor, weights["autocast"][name], rtol=0, atol=2e-2)
    # updated in fp32: the norms' weights start at 1.0, which bf16 holds, and end at values it cannot
    norms = [tensor for name, tensor in weights["bf16 parameters"].items() if "norm" in name]
    assert norms and all(not torch.equal(tensor, tensor.bfloat16().float()) for tensor in norms)
