"""Which checkpoints count as complete: `latest` and rotation never see a half-written one, nor another run's; a
damaged one is named in one line. And the model state's format in one process: any optimizer's state, exactly."""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from training.arguments import ArgumentError, parse_args
from training.checkpoints.files import (
    TRAINER_STATE,
    TrainerState,
    checkpoint_files,
    complete_checkpoints,
    file_sha256,
    require_complete_checkpoint,
    rotate_checkpoints,
    write_manifest,
)
from training.checkpoints.resume import load_checkpoint, resolve_resume_path, verify_checkpoint
from training.checkpoints.tensors import ModelState, load_model_state, save_model_state
from training.errors import ResumeError
from training.optim import OPTIMIZERS

pytestmark = pytest.mark.quick  # every test here: the quick tier (pytest -m quick)


def make_checkpoint(root, name: str, complete: bool, run_id: str = "run") -> None:
    directory = root / "checkpoints" / name
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"weights")
    if complete:
        step = int(name.split("_")[1].split(".")[0])
        (directory / TRAINER_STATE).write_text(json.dumps({"completed_steps": step, "run_id": run_id}))


def test_latest_is_the_newest_complete_checkpoint(tmp_path) -> None:
    make_checkpoint(tmp_path, "step_2", complete=True)
    make_checkpoint(tmp_path, "step_10", complete=True)  # newer than step_2 by number, not by name
    make_checkpoint(tmp_path, "step_12.tmp", complete=True)  # a save killed before its rename
    make_checkpoint(tmp_path, "step_14", complete=False)  # no trainer_state.json
    assert [p.name for p in complete_checkpoints(str(tmp_path))] == ["step_2", "step_10"]
    assert resolve_resume_path("latest", str(tmp_path)).name == "step_10"


def test_latest_without_checkpoints_starts_fresh(tmp_path) -> None:
    assert resolve_resume_path("latest", str(tmp_path)) is None


def test_an_incomplete_checkpoint_path_is_refused(tmp_path) -> None:
    make_checkpoint(tmp_path, "step_14", complete=False)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        resolve_resume_path(str(tmp_path / "checkpoints" / "step_14"), str(tmp_path))


def test_a_fresh_run_refuses_an_output_dir_with_checkpoints(tmp_path) -> None:
    """Nothing already saved is overwritten or rotated away by an unrelated run."""
    make_checkpoint(tmp_path, "step_200", complete=True)
    with pytest.raises(ArgumentError, match="already holds a run"):
        parse_args(["--output_dir", str(tmp_path)])
    parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])  # continuing it is fine


def test_rotation_removes_a_link_and_keeps_what_it_points_to(tmp_path) -> None:
    """A step_N link of the same run made rotation's rmtree raise on the main process alone (the others waiting)."""
    for name in ("step_2", "step_4"):
        make_checkpoint(tmp_path, name, complete=True)
    (tmp_path / "checkpoints" / "step_3").symlink_to(tmp_path / "checkpoints" / "step_4", target_is_directory=True)
    rotate_checkpoints(str(tmp_path), tmp_path / "checkpoints" / "step_4", 1)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4"]
    assert (tmp_path / "checkpoints" / "step_4" / TRAINER_STATE).is_file()


@pytest.mark.parametrize(("limit", "kept"), [(1, ["step_6"]), (2, ["step_6", "step_8"]), (3, ["step_4", "step_6", "step_8"])])
def test_rotation_never_deletes_the_checkpoint_just_written(tmp_path, limit, kept) -> None:
    """Resumed from step_4 while step_8 of the earlier run remains: the new step_6 survives any limit."""
    for name in ("step_2", "step_4", "step_6", "step_8"):
        make_checkpoint(tmp_path, name, complete=True)
    make_checkpoint(tmp_path, "step_7.tmp", complete=False)  # a save killed halfway is not rotation's business
    rotate_checkpoints(str(tmp_path), tmp_path / "checkpoints" / "step_6", limit)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == sorted([*kept, "step_7.tmp"])


def test_a_resume_into_an_output_dir_holding_another_runs_checkpoints_is_refused(tmp_path) -> None:
    """Rotation would have deleted this run's checkpoints and kept the other run's newer one, which `latest` then
    resumed (issue 54)."""
    make_checkpoint(tmp_path / "rot", "step_6", complete=True, run_id="earlier")
    make_checkpoint(tmp_path / "other", "step_3", complete=True, run_id="this")
    with pytest.raises(ArgumentError, match=r"rot holds checkpoints of another run \(step_6\), which rotation and "
                                            "'latest' would take for this run's; resume into another --output_dir"):
        parse_args(["--output_dir", str(tmp_path / "rot"), "--resume_from_checkpoint",
                    str(tmp_path / "other" / "checkpoints" / "step_3")])


def test_latest_never_picks_between_two_runs(tmp_path) -> None:
    make_checkpoint(tmp_path, "step_5", complete=True, run_id="this")
    make_checkpoint(tmp_path, "step_6", complete=True, run_id="earlier")  # copied in by hand
    with pytest.raises(ResumeError, match="holds checkpoints of 2 runs, so 'latest' could continue the wrong one"):
        resolve_resume_path("latest", str(tmp_path))
    with pytest.raises(ResumeError, match="holds checkpoints of 2 runs"):
        parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", "latest"])


def test_rotation_deletes_only_its_own_runs_checkpoints(tmp_path) -> None:
    for name in ("step_2", "step_4", "step_6"):
        make_checkpoint(tmp_path, name, complete=True, run_id="this")
    make_checkpoint(tmp_path, "step_8", complete=True, run_id="earlier")
    rotate_checkpoints(str(tmp_path), tmp_path / "checkpoints" / "step_6", 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_4", "step_6", "step_8"]


def test_a_missing_or_truncated_file_is_named_in_one_line(tmp_path) -> None:
    """Every file of a checkpoint is listed with its size (manifest.json): one missing or cut short is found before
    anything loads, by every rank alike (issue 54: a missing rank0.safetensors was a KeyError, a truncated
    rank1.safetensors safetensors' traceback)."""
    checkpoint = tmp_path / "checkpoints" / "step_4"
    (checkpoint / "model_state").mkdir(parents=True)
    for rank in (0, 1):
        (checkpoint / "model_state" / f"rank{rank}.safetensors").write_bytes(b"x" * 100)
    (checkpoint / "scheduler.bin").write_bytes(b"y" * 10)
    (checkpoint / TRAINER_STATE).write_text(json.dumps({"completed_steps": 4, "run_id": "run"}))
    write_manifest(checkpoint, "run", 4, {name: file_sha256(checkpoint / name) for name in checkpoint_files(checkpoint)},
                   {})
    assert require_complete_checkpoint(checkpoint) == checkpoint
    (checkpoint / "model_state" / "rank1.safetensors").write_bytes(b"x" * 60)
    with pytest.raises(ResumeError, match=r"step_4/model_state/rank1.safetensors is damaged \(60 bytes, saved as "
                                          r"100\); resume an earlier checkpoint"):
        require_complete_checkpoint(checkpoint)
    (checkpoint / "model_state" / "rank1.safetensors").write_bytes(b"x" * 100)
    (checkpoint / "model_state" / "rank0.safetensors").unlink()
    with pytest.raises(ResumeError, match=r"step_4/model_state/rank0.safetensors is missing; resume an earlier"):
        parse_args(["--output_dir", str(tmp_path), "--resume_from_checkpoint", str(checkpoint)])


class WhatUsersKeep(torch.nn.Module):
    """Odd sizes and every dtype a user's model holds: a float64, a bf16 and a 0-dim parameter, an int64 counter
    past 2**24, a float64 buffer below float32's step, a bool mask and complex values (float32 rounds or drops
    each)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Linear(7, 5), torch.nn.Linear(5, 1, bias=False))
        self.scale64 = torch.nn.Parameter(1 + torch.rand(5, dtype=torch.float64) * 1e-9)
        self.bias16 = torch.nn.Parameter(torch.randn(5).bfloat16())
        self.temperature = torch.nn.Parameter(torch.tensor(0.75))
        self.register_buffer("tokens_seen", torch.tensor(2**24 + 1))
        self.register_buffer("offset64", torch.full((3,), 1 + 1e-12, dtype=torch.float64))
        self.register_buffer("mask", torch.tensor([True, False, True]))
        self.register_buffer("phase", torch.tensor([1 + 2j, 3 - 1e-9j], dtype=torch.complex128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.layers[1](self.layers[0](x)) * self.scale64.float() + self.bias16.float()
        return self.layers[2](hidden) * self.temperature


def small_model_and_optimizer(tmp_path, optim: str, seed: int, *flags: str) -> tuple[torch.nn.Module,
                                                                                     torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = WhatUsersKeep()
    args = parse_args(["--output_dir", str(tmp_path / "out"), "--optim", optim, *flags])[2]
    groups = [{"params": [p for p in model.parameters() if p.dtype == dtype]} for dtype in
              (torch.float32, torch.float64, torch.bfloat16)]  # (one dtype a group, as training/optim.py groups them)
    return model, OPTIMIZERS[optim].build(groups, args)


def saved_model_state(tmp_path, optim: str, processes_recorded: int = 1):
    """A small model's state after two steps of `optim`, saved as train.py saves it (one process), and the model."""
    from accelerate import Accelerator

    model, optimizer = small_model_and_optimizer(tmp_path, optim, seed=0)
    for _ in range(2):
        model(torch.randn(3, 13)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    checkpoint = tmp_path / "step_2"
    save_model_state(Accelerator(cpu=True), model, optimizer, checkpoint / "model_state")
    (checkpoint / TRAINER_STATE).write_text(json.dumps({"completed_steps": 2, "num_processes": processes_recorded}))
    return checkpoint, model, optimizer


@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
def test_any_optimizers_state_round_trips_exactly(optim, tmp_path) -> None:
    """Shaped like its parameter or not (Adafactor's factored moments and RMS, a step count kept as a number),
    every entry comes back as the optimizer held it, and the next step is the same."""
    from accelerate import Accelerator

    checkpoint, model, optimizer = saved_model_state(tmp_path, optim)
    fresh, restored = small_model_and_optimizer(tmp_path, optim, seed=1)
    fresh.tokens_seen.zero_()
    load_model_state(Accelerator(cpu=True), fresh, restored, checkpoint)
    for (name, before), after in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert before.dtype == after.dtype and before.shape == after.shape and torch.equal(before, after), name
    assert fresh.tokens_seen.item() == 2**24 + 1 and fresh.offset64[0].item() == 1 + 1e-12
    for (name, before), after in zip(model.named_parameters(), fresh.parameters()):
        saved, loaded = optimizer.state[before], restored.state[after]
        assert saved.keys() == loaded.keys(), name
        for key in saved:
            assert type(loaded[key]) is type(saved[key]) and torch.equal(torch.as_tensor(loaded[key]),
                                                                           torch.as_tensor(saved[key])), (name, key)
    batch = torch.randn(3, 13)
    for net, opt in ((model, optimizer), (fresh, restored)):
        net(batch).square().sum().backward()
        opt.step()
    for before, after in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(before, after)


@pytest.mark.parametrize("optim", sorted(OPTIMIZERS))
def test_the_optimizers_settings_are_this_runs_after_a_resume(optim, tmp_path) -> None:
    """What the resume table (docs/train-py.md) says is honoured is: the state comes back, the groups' settings (rate,
    weight decay, betas, epsilon) stay as this run's flags set them."""
    from accelerate import Accelerator

    checkpoint, _, optimizer = saved_model_state(tmp_path, optim)
    changed = ("--learning_rate", "5e-4", "--adam_beta1", "0.8", "--adam_beta2", "0.99", "--adam_epsilon", "1e-6")
    model, restored = small_model_and_optimizer(tmp_path / "resumed", optim, 1, *changed)
    expected = [{key: value for key, value in group.items() if key != "params"} for group in restored.param_groups]
    load_model_state(Accelerator(cpu=True), model, restored, checkpoint)
    assert [{key: value for key, value in group.items() if key != "params"} for group in restored.param_groups] == expected
    assert expected[0]["lr"] == 5e-4 and expected != [{key: value for key, value in group.items() if key != "params"}
                                                       for group in optimizer.param_groups]
    assert sum(len(state) for state in restored.state.values()) == sum(len(state) for state in optimizer.state.values())


def test_a_rank_file_missing_from_a_checkpoint_without_a_manifest_is_one_line(tmp_path) -> None:
    checkpoint, _, _ = saved_model_state(tmp_path, "adamw_torch", processes_recorded=2)  # as if 2 ranks saved it
    with contextlib.ExitStack() as files, pytest.raises(ResumeError, match=r"model_state/rank1.safetensors is missing "
                                                                           r"\(the checkpoint was saved by 2 processes\)"):
        ModelState(checkpoint, files)
    (checkpoint / "model_state" / "rank1.safetensors").write_bytes(
        (checkpoint / "model_state" / "rank0.safetensors").read_bytes()[:50])  # cut short: no manifest to find it
    with contextlib.ExitStack() as files, pytest.raises(ResumeError, match=r"model_state/rank1.safetensors is damaged"):
        ModelState(checkpoint, files)


@pytest.mark.parametrize(("this_run", "message"), [
    ({"global_batch": 12, "optim": "sgd"}, "was trained with a global batch of 8, this run has 12; keep "
                                           "per_device_train_batch_size x processes x gradient_accumulation_steps"),
    # SGD's state (none) would leave AdamW's moments at zero; the two AdamW choices hold the same state
    ({"global_batch": 8, "optim": "adamw_torch"}, "holds the state of --optim sgd, and this run's is --optim "
                                                  "adamw_torch; resume with --optim sgd, or start a new run"),
], ids=["another global batch", "another optimizer"])
def test_a_checkpoint_this_run_cannot_continue_is_refused_in_one_line(this_run, message, tmp_path) -> None:
    (tmp_path / TRAINER_STATE).write_text(json.dumps({"completed_steps": 2, "global_batch": 8, "optim": "sgd"}))
    with pytest.raises(ResumeError, match=message):
        load_checkpoint(None, tmp_path, TrainerState(**this_run), max_steps=4)


def stamped_checkpoint(root, run_id: str, step: int, seed: int, parent: Path | None = None):
    """A checkpoint as train.py writes one (its model state stamped with its run and step, an accelerate file, the
    manifest), of `WhatUsersKeep` trained from `seed`, in `parent` (default: root/run_id)."""
    from accelerate import Accelerator

    model, optimizer = small_model_and_optimizer(root, "adamw_torch", seed)
    model(torch.randn(3, 13)).square().sum().backward()
    optimizer.step()
    checkpoint = (parent or root / run_id) / f"step_{step}"
    save_model_state(Accelerator(cpu=True), model, optimizer, checkpoint / "model_state",
                     {"run_id": run_id, "step": str(step)})
    torch.save({"seed": seed, "python": list(range(seed, seed + 50))}, checkpoint / "random_states_0.pkl")
    (checkpoint / TRAINER_STATE).write_text(json.dumps({"completed_steps": step, "run_id": run_id, "num_processes": 1}))
    write_manifest(checkpoint, run_id, step, {name: file_sha256(checkpoint / name) for name in checkpoint_files(checkpoint)},
                   {})
    return checkpoint


def zeroed_in_place(file, twins) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2:len(data) // 2 + 64] = bytes(64)
    file.write_bytes(bytes(data))


# each damage of one file, and what the refusal says of it (model_state's files say which run and step they are)
TAMPERING = {
    "missing": (lambda file, twins: file.unlink(), {"*": r"is missing"}, True),
    "cut short": (lambda file, twins: file.write_bytes(file.read_bytes()[:-7]), {"*": r"is damaged \([\d,]+ bytes, saved as [\d,]+\)"}, True),
    "zeroed in place": (zeroed_in_place, {"*": r"is damaged \(its bytes differ from the SHA-256 saved with it\)"}, False),
    "another run's": (lambda file, twins: file.write_bytes(twins["other run"]),
                      {"model_state/rank0.safetensors": r"belongs to run run-b, this checkpoint to run run-a",
                       "*": r"is damaged \(its bytes differ from the SHA-256 saved with it\)"}, False),
    "another step's": (lambda file, twins: file.write_bytes(twins["other step"]),
                       {"model_state/rank0.safetensors": r"was saved at step 6, this checkpoint at step 2",
                        "*": r"is damaged \(its bytes differ from the SHA-256 saved with it\)"}, False),
}


@pytest.mark.parametrize("name", ["model_state/rank0.safetensors", "random_states_0.pkl"])
@pytest.mark.parametrize("damage", TAMPERING)
def test_a_file_missing_damaged_or_of_another_run_or_step_is_refused_naming_it(tmp_path, damage, name) -> None:
    """Every damage of every kind of file: one line naming the file and what differs, before anything loads (the
    manifest held sizes only: another run's rank file of the same size, or bytes zeroed in place, resumed with
    exit 0 on the wrong weights). A damage the size shows is refused before the process group starts too."""
    checkpoint = stamped_checkpoint(tmp_path, "run-a", 2, seed=0)
    twins = {"other run": (stamped_checkpoint(tmp_path, "run-b", 2, seed=1) / name).read_bytes(),
             "other step": (stamped_checkpoint(tmp_path, "run-a", 6, seed=2) / name).read_bytes()}
    verify_checkpoint(None, checkpoint)  # whole
    mutate, messages, shown_by_size = TAMPERING[damage]
    mutate(checkpoint / name, twins)
    expected = rf"^{checkpoint / name} {messages.get(name, messages['*'])}; resume an earlier checkpoint"
    with pytest.raises(ResumeError, match=expected):
        verify_checkpoint(None, checkpoint)
    if shown_by_size or name in messages:  # the size, or what the file says of itself, tells before the process group
        with pytest.raises(ResumeError, match=expected):
            require_complete_checkpoint(checkpoint)
    else:
        require_complete_checkpoint(checkpoint)  # (same size: the bytes tell)


def test_a_trainer_state_of_another_checkpoint_is_refused(tmp_path) -> None:
    checkpoint = stamped_checkpoint(tmp_path, "run-a", 2, seed=0)
    (checkpoint / TRAINER_STATE).write_bytes((stamped_checkpoint(tmp_path, "run-a", 6, seed=1) / TRAINER_STATE).read_bytes())
    with pytest.raises(ResumeError, match=r"trainer_state.json belongs to run run-a at step 6, its manifest.json to run "
                                          r"run-a at step 2: the checkpoint mixes two; resume an earlier checkpoint"):
        verify_checkpoint(None, checkpoint)


def described(overrides: str | None = None, **model_kwargs) -> dict:
    """What a checkpoint records of llama-tiny (with `overrides`, as --config_overrides gives them), or of a plain
    module built with `model_kwargs`."""
    from types import SimpleNamespace

    from models.configs import build_named_config
    from models.language import build_tokenizer
    from training.checkpoints.resume import model_description

    if model_kwargs:
        return model_description(SimpleNamespace(model_kwargs=model_kwargs, settings={"block_size": 32}), torch.nn.Linear(1, 1))
    config = build_named_config("llama-tiny", build_tokenizer(None, None), overrides)
    return model_description(SimpleNamespace(model_kwargs=None, settings={"block_size": 64}), SimpleNamespace(config=config))


@pytest.mark.parametrize(("resumed_with", "allowed", "refused"), [
    ("hidden_act=gelu,rms_norm_eps=0.1", None, "hidden_act ('silu' -> 'gelu'), rms_norm_eps (1e-06 -> 0.1); resume with "
     "the flags it was trained with, or name the fields you change on purpose (shapes must still match): "
     "--allow_config_changes hidden_act,rms_norm_eps"),
    ("hidden_act=gelu,rms_norm_eps=0.1", "rms_norm_eps", "hidden_act ('silu' -> 'gelu'); resume with"),
    ("hidden_act=gelu,rms_norm_eps=0.1", "hidden_act, rms_norm_eps", None),
    ("max_position_embeddings=4096", "max_position_embeddings", None),  # extending the context on purpose
    (None, None, None),
], ids=["two fields", "one named", "both named", "context extended", "the same model"])
def test_a_resume_into_a_model_configured_otherwise_is_refused_unless_named(resumed_with, allowed, refused, caplog) -> None:
    """Same shapes, other model: another activation or norm epsilon resumed with exit 0 (loss 0.46-0.73 off). A
    difference the user names in --allow_config_changes is logged instead."""
    from accelerate import PartialState

    from training.checkpoints.resume import check_same_model

    PartialState(cpu=True)  # accelerate's logger: the main process of one
    saved, this_run = described(), described(resumed_with)
    with caplog.at_level("WARNING"):
        if refused:
            with pytest.raises(ResumeError, match=f"^step_4 holds a model configured otherwise: {re.escape(refused)}"):
                check_same_model(Path("step_4"), saved, this_run, allowed)
        else:
            check_same_model(Path("step_4"), saved, this_run, allowed)
    changed = [record.getMessage() for record in caplog.records if "--allow_config_changes" in record.getMessage()]
    assert len(changed) == (1 if allowed and not refused else 0), changed


def test_a_plain_modules_constructor_arguments_are_part_of_its_model() -> None:
    from training.checkpoints.resume import check_same_model

    with pytest.raises(ResumeError, match=r"configured otherwise: width \(13 -> 17\)"):
        check_same_model(Path("step_4"), described(width=13, vocab_size=919), described(width=17, vocab_size=919), None)
    check_same_model(Path("step_4"), {}, described(width=17), None)  # (checkpoints before 2026-12-04 record none)


@pytest.mark.parts("lora")
def test_an_adapters_settings_are_part_of_its_model() -> None:
    """A LoRA run resumed with another alpha or dropout trained another model silently; its targets (a set) compare
    alike in every process."""
    from types import SimpleNamespace

    from peft import LoraConfig

    from training.checkpoints.resume import check_same_model, model_description

    def adapted(alpha: int) -> dict:
        adapter = LoraConfig(r=8, lora_alpha=alpha, target_modules={"q_proj", "v_proj", "o_proj"}, base_model_name_or_path="/a")
        return model_description(SimpleNamespace(model_kwargs=None, settings={}), SimpleNamespace(peft_config={"default": adapter}))

    check_same_model(Path("step_4"), adapted(16), adapted(16), None)
    assert adapted(16)["adapter"]["target_modules"] == ["o_proj", "q_proj", "v_proj"]
    with pytest.raises(ResumeError, match=r"configured otherwise: lora_alpha \(16 -> 32\)"):
        check_same_model(Path("step_4"), adapted(16), adapted(32), None)


def manifest_of(checkpoint: Path) -> dict:
    return json.loads((checkpoint / "manifest.json").read_text())


def deleted(checkpoint: Path, foreign: Path) -> None:
    (checkpoint / "manifest.json").unlink()


def emptied(checkpoint: Path, foreign: Path) -> None:
    (checkpoint / "manifest.json").write_text("{}")


def sizes_only(checkpoint: Path, foreign: Path) -> None:
    """As checkpoints before 2026-12-04 wrote it: each file's size, no checksum."""
    (checkpoint / "manifest.json").write_text(json.dumps({name: entry["bytes"] for name, entry in
                                                          manifest_of(checkpoint)["files"].items()}))


def checksum_dropped(checkpoint: Path, foreign: Path) -> None:
    manifest = manifest_of(checkpoint)
    del manifest["files"]["random_states_0.pkl"]["sha256"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def edited_for_a_foreign_file(checkpoint: Path, foreign: Path) -> None:
    """Another run's rank file copied in, and the manifest's size and SHA-256 edited to match it: only what the file
    says of itself tells."""
    name = "model_state/rank0.safetensors"
    shutil.copy(foreign / name, checkpoint / name)
    manifest = manifest_of(checkpoint)
    manifest["files"][name] |= {"bytes": (checkpoint / name).stat().st_size, "sha256": file_sha256(checkpoint / name)}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


# a manifest deleted, emptied, of the older formats, or edited to pass a foreign file: (the refusal, whether
# --resume_unchecked resumes it)
MANIFEST_TWINS = {
    "deleted": (deleted, r"has no manifest.json, so nothing proves its files whole and of one run; resume a checkpoint "
                         r"saved with its manifest, or this one unchecked on purpose with --resume_unchecked", True),
    "emptied": (emptied, r"manifest.json does not list trainer_state.json, which every save lists: it is damaged or "
                         r"edited; resume an earlier checkpoint, or this one unchecked on purpose with "
                         r"--resume_unchecked", True),
    "sizes only": (sizes_only, r"manifest.json lists \S+ without a SHA-256 \(a checkpoint saved before 2026-12-04, or an "
                               r"edited manifest\), so its bytes cannot be checked; resume it unchecked on purpose with "
                               r"--resume_unchecked", True),
    "a checksum dropped": (checksum_dropped, r"manifest.json lists random_states_0.pkl without a SHA-256", True),
    "edited for a foreign file": (edited_for_a_foreign_file, r"model_state/rank0.safetensors belongs to run run-b, this "
                                                             r"checkpoint to run run-a", False),
}


@pytest.mark.parametrize("twin", MANIFEST_TWINS)
def test_a_checkpoint_cannot_vouch_for_itself_with_a_manifest_missing_emptied_or_edited(twin, tmp_path) -> None:
    """A checkpoint copied without its manifest, with one byte of a rank file flipped, resumed with exit 0 on damaged
    weights; a manifest edited to match another run's file passed it (issue 69). --resume_unchecked resumes what
    cannot be proven on purpose; a file that says it is another run's, never."""
    checkpoint = stamped_checkpoint(tmp_path, "run-a", 2, seed=0)
    foreign = stamped_checkpoint(tmp_path, "run-b", 2, seed=1)
    damage, message, unchecked_resumes = MANIFEST_TWINS[twin]
    damage(checkpoint, foreign)
    if twin == "deleted":  # and a byte flipped, which nothing can tell now
        zeroed_in_place(checkpoint / "model_state" / "rank0.safetensors", {})
    with pytest.raises(ResumeError, match=message):
        verify_checkpoint(None, checkpoint)
    if unchecked_resumes:
        assert verify_checkpoint(None, checkpoint, unchecked=True) == []
        shutil.copy(foreign / "model_state" / "rank0.safetensors", checkpoint / "model_state" / "rank0.safetensors")
        with pytest.raises(ResumeError, match="rank0.safetensors belongs to run run-b, this checkpoint to run run-a"):
            verify_checkpoint(None, checkpoint, unchecked=True)  # unchecked: what a file says of itself still counts
    else:
        with pytest.raises(ResumeError, match=message):
            verify_checkpoint(None, checkpoint, unchecked=True)
        with pytest.raises(ResumeError, match=message):  # before the process group too: the file's stamp is its header
            require_complete_checkpoint(checkpoint)


def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path) -> None:
    checkpoint = stamped_checkpoint(tmp_path, "run-a", 2, seed=0)
    manifest = manifest_of(checkpoint)
    manifest["files"]["../../elsewhere"] = manifest["files"]["random_states_0.pkl"]
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ResumeError, match=r"manifest.json lists ../../elsewhere, outside the checkpoint: it is damaged "
                                          "or edited"):
        verify_checkpoint(None, checkpoint)


def test_only_what_the_manifest_lists_is_read(tmp_path) -> None:
    """Another run's ema/ copied into a checkpoint saved without one was loaded by --ema_decay (issue 69): a file the
    manifest does not list is named in a warning and hidden from every reader; the listed ones read as they are."""
    from accelerate import PartialState

    from training.checkpoints.resume import listed_only

    PartialState()
    checkpoint = stamped_checkpoint(tmp_path, "run-a", 2, seed=0)
    foreign = stamped_checkpoint(tmp_path, "run-b", 2, seed=1)
    shutil.copytree(foreign / "model_state", checkpoint / "ema")
    unlisted = verify_checkpoint(None, checkpoint)
    assert unlisted == ["ema/rank0.safetensors"]
    with listed_only(checkpoint, unlisted) as readable:
        assert readable.name == "step_2" and not (readable / "ema").exists()
        assert sorted(str(path.relative_to(readable)) for path in readable.rglob("*") if path.is_file()) == \
            sorted([*manifest_of(checkpoint)["files"], "manifest.json"])
        assert (readable / "model_state" / "rank0.safetensors").read_bytes() == \
            (checkpoint / "model_state" / "rank0.safetensors").read_bytes()
    assert not readable.exists()
    with listed_only(checkpoint, []) as readable:
        assert readable == checkpoint
    with pytest.raises(ResumeError, match=f"^{checkpoint}/model_state is bad$"):  # named as the user knows it
        with listed_only(checkpoint, unlisted) as readable:
            raise ResumeError(f"{readable}/model_state is bad")


def test_a_symlinked_or_misnamed_step_and_a_damaged_state_are_refused_before_training(tmp_path) -> None:
    """`ln -s step_4 step_6` resumed 'from step_6 at step 4' and died at the step-6 save (rmtree on a link), after the
    work; a truncated trainer_state.json under `latest` read as 'checkpoints of 2 runs' (issue 69)."""
    output = tmp_path / "out"
    checkpoint = stamped_checkpoint(tmp_path, "run", 4, seed=0, parent=output / "checkpoints")
    (output / "checkpoints" / "step_6").symlink_to(checkpoint, target_is_directory=True)
    with pytest.raises(ResumeError, match=r"step_6 is a symbolic link \(to .*step_4\); resume the checkpoint by its own "
                                          "path, and delete the link"):
        parse_args(["--output_dir", str(output), "--resume_from_checkpoint", "latest"])
    (output / "checkpoints" / "step_6").unlink()
    shutil.copytree(checkpoint, output / "checkpoints" / "step_6")
    with pytest.raises(ResumeError, match=r"step_6 is named for step 6 and holds step 4 \(renamed or copied by hand\); "
                                          "rename it step_4, or resume the checkpoint of step 6"):
        parse_args(["--output_dir", str(output), "--resume_from_checkpoint", "latest"])
    shutil.rmtree(output / "checkpoints" / "step_6")
    state = checkpoint / TRAINER_STATE
    state.write_text(state.read_text()[:20])
    with pytest.raises(ResumeError, match=rf"{state} is damaged \(.*\), so 'latest' cannot tell which run it belongs to; "
                                          f"move {checkpoint} elsewhere"):
        parse_args(["--output_dir", str(output), "--resume_from_checkpoint", "latest"])
    with pytest.raises(ResumeError, match=rf"{state} is damaged \(.*\); resume an earlier checkpoint"):
        parse_args(["--output_dir", str(tmp_path / "other"), "--resume_from_checkpoint", str(checkpoint)])


def test_a_save_over_a_link_replaces_the_link_and_keeps_what_it_points_to(tmp_path) -> None:
    """A link put where a save goes (step_6 -> step_4) made the save's rmtree fail after the run's work (issue 69)."""
    from accelerate import Accelerator

    from training.checkpoints.save import save_checkpoint
    from training.runner import ModelRunner

    output = tmp_path / "out"
    checkpoint = stamped_checkpoint(tmp_path, "run", 4, seed=0, parent=output / "checkpoints")
    (output / "checkpoints" / "step_6").symlink_to(checkpoint, target_is_directory=True)
    accelerator = Accelerator(cpu=True)
    model, optimizer = small_model_and_optimizer(tmp_path / "flags", "adamw_torch", 0)
    saved = save_checkpoint(accelerator, ModelRunner(accelerator), model, optimizer, str(output),
                            TrainerState(completed_steps=6, run_id="run", num_processes=1), None)
    assert not saved.is_symlink() and json.loads((saved / TRAINER_STATE).read_text())["completed_steps"] == 6
    assert json.loads((checkpoint / TRAINER_STATE).read_text())["completed_steps"] == 4
    verify_checkpoint(None, saved)
