"""Layer-wise learning rates (parts/layer_lr), proven by measurement: one AdamW update whose size gives each
parameter's rate and weight decay, compared with what its name implies, under ddp, fsdp and ZeRO-3, in warmup (the
schedule scales every group), and after a resume under another strategy; the layers numbered for the template's
causal LM, a plain module's blocks, a module that says how, and refused in one line where no rule applies."""

from __future__ import annotations

import contextlib
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.harness import TINY_RUN, assert_public_api_only, bad_input_errors, flag_refusal, launch, read_metrics, train
from training.checkpoints.tensors import ModelState
from training.errors import ArgumentError
from training.flags import TrainArguments
from training.optim import build_optimizer

pytestmark = [pytest.mark.parts("layer_lr"), pytest.mark.forked]

RATE, DECAY, WEIGHT_DECAY, TOP = 3e-3, 0.8, 0.5, 3  # llama-tiny: embeddings 0, its 2 blocks 1 and 2, norm and head 3
SCHEDULE = [0.0, 0.5, 1.0, 0.5]  # the rate of steps 1-4 over --learning_rate: a warmup of 2, then linear decay
# With Adam's betas 0 an update is -rate * (weight_decay * weight + g / (|g| + eps)): one unit of the rate per
# element, apart from the decay, whatever the gradient's size (`measured`).
MEASURED = ("--learning_rate", str(RATE), "--layer_lr_decay", str(DECAY), "--weight_decay", str(WEIGHT_DECAY),
            "--adam_beta1", "0", "--adam_beta2", "0", "--max_steps", "4", "--warmup_steps", "2",
            "--lr_scheduler_type", "linear", "--save_steps", "1", "--logging_steps", "1", "--eval_strategy", "no")
# config -> what --no_decay_names adds to bias,norm; under offload DeepSpeed's CPU Adam steps the groups
RUNS = {"ddp": (), "fsdp": ("embed",), "deepspeed_zero3": (), "deepspeed_zero3_offload": ()}


def implied(name: str, no_decay_names: tuple[str, ...] = ()) -> tuple[float, float]:
    """The rate of the warmup's second update (half of --learning_rate) and the weight decay a parameter's name
    implies: its depth (the embeddings lowest, block i at i + 1, the final norm and the head the top), and no decay
    for norms (and the names given)."""
    block = re.search(r"\.layers\.(\d+)\.", name)
    depth = 0 if "embed" in name else int(block.group(1)) + 1 if block else TOP
    decays = not any(fragment in name for fragment in ("norm", *no_decay_names))
    return SCHEDULE[1] * RATE * DECAY ** (TOP - depth), WEIGHT_DECAY if decays else 0.0


def measured(before: torch.Tensor, after: torch.Tensor) -> tuple[float, float]:
    """The rate and weight decay of one update: |Δ| = rate + rate · decay · (w · sign(-Δ)) for the elements whose
    gradient is well above Adam's epsilon (the larger half of |Δ|), fitted by least squares, twice, the second time
    without the elements the first fit left more than 0.1% of the rate apart (a gradient near epsilon)."""
    delta, weight = (after - before).double().flatten(), before.double().flatten()
    kept = delta.abs() > 0.5 * delta.abs().max()
    size, signed = delta.abs()[kept], (-delta.sign() * weight)[kept]
    for _ in range(2):
        rate, slope = torch.linalg.lstsq(torch.stack([torch.ones_like(signed), signed], 1), size[:, None]).solution.flatten()
        close = (size - rate - slope * signed).abs() < 1e-3 * rate
        size, signed = size[close], signed[close]
    return float(rate), float(slope / rate)


def weights(run: Path, step: int) -> dict[str, torch.Tensor]:
    with contextlib.ExitStack() as files:
        state = ModelState(run / "checkpoints" / f"step_{step}", files)
        return {name: state.whole(name).value for name in state.shapes}


def assert_rates_as_named(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                          no_decay_names: tuple[str, ...] = ()) -> None:
    for name in before:
        rate, weight_decay = measured(before[name], after[name])
        expected_rate, expected_decay = implied(name, no_decay_names)
        assert rate == pytest.approx(expected_rate, rel=5e-3), name
        assert weight_decay == pytest.approx(expected_decay, abs=0.05), name


@pytest.fixture(scope="module")
def runs(cached_run):
    return {config: cached_run(config, *MEASURED, *(["--no_decay_names", ",".join(("bias", "norm", *added))] if added
                                                    else [])) for config, added in RUNS.items()}


@pytest.mark.parametrize("config", RUNS)
def test_each_parameter_trains_at_the_rate_and_decay_its_name_implies(config, runs) -> None:
    run = runs[config]
    assert_rates_as_named(weights(run, 1), weights(run, 2), RUNS[config])
    logged = [record for record in read_metrics(run) if "loss" in record]
    assert [record["lr"] for record in logged] == pytest.approx([factor * RATE for factor in SCHEDULE])
    for record in logged[1:]:  # warmup and decay scale every group alike: `lr` is the top's
        assert {key: record[key] for key in record if key.startswith("lr/")} == pytest.approx(
            {f"lr/layer_{depth}": record["lr"] * DECAY ** (TOP - depth) for depth in range(TOP + 1)})
    assert "lr/layer_0" not in logged[0]  # step 1 of the warmup: every group at 0, one rate


def test_the_strategies_train_alike(runs) -> None:
    losses = {config: [record["loss"] for record in read_metrics(run) if "loss" in record] for config, run in runs.items()}
    for config in ("deepspeed_zero3", "deepspeed_zero3_offload"):
        assert losses[config] == pytest.approx(losses["ddp"], rel=1e-5), config
    assert all(math.isfinite(loss) for loss in losses["ddp"])


def test_a_resume_under_another_strategy_trains_at_the_same_rates(runs, tmp_path) -> None:
    """ddp's checkpoint of step 1 resumed under ZeRO-3 on 2 processes: its next update has every rate and decay ddp's
    had, and it logs ddp's rates and losses."""
    shutil.copytree(runs["ddp"] / "checkpoints" / "step_1", tmp_path / "checkpoints" / "step_1")
    train("deepspeed_zero3", tmp_path, *MEASURED, "--resume_from_checkpoint", "latest")
    assert_rates_as_named(weights(tmp_path, 1), weights(tmp_path, 2))
    expected = [record for record in read_metrics(runs["ddp"]) if record["step"] > 1 and "loss" in record]
    resumed = [record for record in read_metrics(tmp_path) if "loss" in record]
    for record, original in zip(resumed, expected, strict=True):
        assert {key: value for key, value in record.items() if key.startswith("lr")} == pytest.approx(
            {key: value for key, value in original.items() if key.startswith("lr")}, rel=1e-12)
        assert record["loss"] == pytest.approx(original["loss"], rel=1e-5)


def test_a_resume_honours_another_decay_and_refuses_the_part_turned_off(runs, tmp_path) -> None:
    """Another --layer_lr_decay: this run's rates from the resumed step on, logged once; the part off: another number
    of optimizer groups, refused in one line."""
    def resumed_with(decay: str, directory: Path) -> list[str]:
        shutil.copytree(runs["ddp"] / "checkpoints" / "step_1", directory / "checkpoints" / "step_1")
        flags = [decay if previous == "--layer_lr_decay" else flag for previous, flag in zip(("",) + MEASURED, MEASURED)]
        return [*TINY_RUN, "--output_dir", str(directory), *flags, "--resume_from_checkpoint", "latest"]

    changed = launch("ddp", "train.py", *resumed_with("0.7", tmp_path / "changed"))
    assert changed.returncode == 0, changed.stderr[-3000:]
    assert changed.stderr.count("layer_lr_decay 0.8 -> 0.7 from step 1 (changed on resume)") == 1
    second = next(record for record in read_metrics(tmp_path / "changed") if record["step"] == 2)
    assert second["lr/layer_0"] == pytest.approx(second["lr"] * 0.7 ** TOP)
    refused = bad_input_errors(launch("ddp", "train.py", *resumed_with("1", tmp_path / "off")))
    assert len(refused) == 1 and "holds an optimizer of 7 parameter groups and this run's has 2" in refused[0]


# ---------------------------------------------------------------- the layers numbered, the flags checked


class Blocks(torch.nn.Module):
    """A plain model of a user's: an input projection, three blocks (each with experts in a list of their own), a
    head; and a float64 scale among float32 weights."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(4, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.ModuleDict({"experts": torch.nn.ModuleList(
            [torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)]), "ln": torch.nn.LayerNorm(8)}) for _ in range(3))
        self.out = torch.nn.Linear(8, 2)
        self.scale = torch.nn.Parameter(torch.ones((), dtype=torch.float64))


def groups_of(model: torch.nn.Module, *flags: str) -> dict[str, tuple[float, float]]:
    """Each parameter's (rate, weight decay) in the optimizer `train.py`'s flags build for `model`."""
    from training.arguments import parse_args

    *_, args = parse_args(["--learning_rate", "1.0", "--weight_decay", "0.1", *flags])
    optimizer = build_optimizer(model, args)
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return {names[id(p)]: (group["lr"], group["weight_decay"]) for group in optimizer.param_groups for p in group["params"]}


@pytest.mark.quick
def test_a_plain_models_blocks_are_its_outermost_list() -> None:
    got = groups_of(Blocks(), "--layer_lr_decay", "0.5")
    assert got["inp.weight"] == (0.5 ** 4, 0.1) and got["inp.bias"] == (0.5 ** 4, 0.0)  # before the blocks
    assert got["blocks.0.experts.1.weight"] == (0.5 ** 3, 0.1) and got["blocks.2.ln.weight"] == (0.5, 0.0)
    assert got["out.weight"] == (1.0, 0.1)  # after them: the top
    assert got["scale"] == (0.5 ** 4, 0.1)  # the model's own parameter comes first in named_parameters: the lowest
    optimizer = build_optimizer(Blocks(), TrainArguments(learning_rate=1.0))  # off: the core's groups alone
    assert {group.get("lr") for group in optimizer.param_groups} == {1.0} and "name" not in optimizer.param_groups[0]


@pytest.mark.quick
def test_the_template_causal_lm_and_a_lora_adapter_are_numbered_by_their_layers() -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    got = groups_of(LlamaForCausalLM(config), "--layer_lr_decay", "0.5", "--no_decay_names", "bias,norm,embed")
    assert got["model.embed_tokens.weight"] == (0.5 ** 4, 0.0)  # tied: one tensor, the embeddings' depth
    assert got["model.layers.1.mlp.up_proj.weight"] == (0.5 ** 2, 0.1) and got["model.norm.weight"] == (1.0, 0.0)
    adapted = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    got = groups_of(adapted, "--layer_lr_decay", "0.5")
    assert got["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] == (0.5 ** 3, 0.1)
    assert len(got) == 12  # the adapter's weights alone train


@pytest.mark.quick
def test_a_model_says_how_its_layers_are_numbered_or_is_refused_in_one_line() -> None:
    class EncoderDecoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
            self.decoder = torch.nn.ModuleList([torch.nn.Linear(2, 2)])

    with pytest.raises(ArgumentError, match=r"^--layer_lr_decay numbers the blocks of a model's one outermost "
                                            r"nn.ModuleList, and EncoderDecoder has 2 \(encoder, decoder\); give the "
                                            r"model a method layer_depth\(name\) -> int"):
        groups_of(EncoderDecoder(), "--layer_lr_decay", "0.5")
    with pytest.raises(ArgumentError, match="and Linear has none; give"):
        groups_of(torch.nn.Linear(2, 2), "--layer_lr_decay", "0.5")

    class Numbered(EncoderDecoder):
        def layer_depth(self, name: str) -> int:
            return 0 if name.startswith("encoder") else 1

    got = groups_of(Numbered(), "--layer_lr_decay", "0.5", "--no_decay_names", "bias")
    assert got == {"encoder.0.weight": (0.5, 0.1), "encoder.0.bias": (0.5, 0.0), "decoder.0.weight": (1.0, 0.1),
                   "decoder.0.bias": (1.0, 0.0)}
    got = groups_of(EncoderDecoder(), "--no_decay_names", "decoder")  # no layers to number: one rate
    assert got["encoder.0.weight"] == (1.0, 0.1) and got["decoder.0.bias"] == (1.0, 0.0)


@pytest.mark.quick
@pytest.mark.parametrize(("args", "refusal"), [
    (["--layer_lr_decay", "0"], "--layer_lr_decay 0.0: give a factor in (0, 1] (1: off)"),
    (["--layer_lr_decay", "1.5"], "--layer_lr_decay 1.5: give a factor in (0, 1] (1: off)"),
    (["--no_decay_names", ","], "--no_decay_names is empty: give name fragments (bias,norm), or drop it"),
])
def test_impossible_settings_are_refused_in_one_line(args, refusal, monkeypatch) -> None:
    assert flag_refusal(args, {}, monkeypatch).startswith(refusal)


@pytest.mark.quick
@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch", "sgd", "adafactor", "cpu_adam"])
def test_every_optimizer_steps_each_group_at_its_rate(optim) -> None:
    """One step of each --optim (cpu_adam: DeepSpeed's, under ZeRO optimizer offload) with a gradient of ones: each
    group's parameters move by what its rate gives, the top's by --learning_rate's."""
    model = Blocks()
    if optim == "cpu_adam":  # (it steps float32 parameters alone)
        model.scale.data = model.scale.data.float()
    flags = ["--optim", "adamw_torch" if optim == "cpu_adam" else optim, "--layer_lr_decay", "0.5", "--weight_decay", "0"]
    from training.arguments import parse_args

    *_, args = parse_args(["--learning_rate", "0.1", *flags])
    optimizer = build_optimizer(model, args, offloaded=optim == "cpu_adam")
    before = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    for parameter in model.parameters():
        parameter.grad = torch.ones_like(parameter)
    optimizer.step()
    moved = {name: float((parameter.detach() - before[name]).abs().max()) for name, parameter in model.named_parameters()}
    assert moved["out.weight"] > 0 and moved["blocks.1.experts.0.weight"] == pytest.approx(moved["out.weight"] / 4,
                                                                                           rel=1e-3)
    assert moved["inp.weight"] == pytest.approx(moved["out.weight"] / 16, rel=1e-3)


@pytest.mark.quick
def test_a_forkers_part_needs_the_public_api_alone() -> None:
    assert_public_api_only("layer_lr")
