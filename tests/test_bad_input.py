"""Bad input: one `error:` line naming the problem and the fix, a non-zero exit, no traceback
from train.py, no rank left hanging, and the run already in `output_dir` (checkpoints, final
model, metrics) left byte for byte as it was.

LAUNCH_CASES are real 2-process launches, one for each stage that can refuse: flags and files
(checked by every rank before any process group exists), the launcher config, and what is
found after the process group (the model, the data, the strategy's setup). More of each stage
run in-process through the code that refuses them: ARGUMENT_CASES through `parse_args`,
LAUNCHER_CASES through `check_launch_config` with the environment `accelerate launch` sets,
and the model and data stages in tests/test_dry_run.py (in-process, and `train.py --dry_run`
for exit 2), which also holds DeepSpeed's JSON against a flag; pipeline stages under FSDP:
tests/test_pipeline.py. (A missing text column: tests/test_data.py.)
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

import psutil
import pytest
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from models.configs import build_named_config
from models.language import SHIPPED_TOKENIZER
from tests.harness import (
    CONFIGS,
    REPO,
    TINY_RUN,
    bad_input_errors,
    end_launch,
    launch,
    launch_command,
    rank_processes,
    split_args,
    wait_for,
)
from training.arguments import ArgumentError, parse_args
from training.errors import StrategyError
from training.strategy import check_launch_config, requested_strategy
from training.task_registry import flag_owners

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

RESUME = ("--resume_from_checkpoint", "latest")  # so the previous run in output_dir is a legitimate target
# case -> (accelerate config, train.py arguments, what the error line says). {name} is a file made by `inputs`.
LAUNCH_CASES = {
    "unknown command-line key": ("ddp", ["--learnin_rate", "0.1", *RESUME], "did you mean 'learning_rate'"),
    "a strategy that would degrade silently (FSDP1 on CPU)": ("{fsdp1.yaml}", [*RESUME], "FSDP1 cannot run on CPU"),
    "tokenizer and model vocabulary mismatch": (
        "ddp", ["--model_name_or_path", "{model}", "--tokenizer_name", "{big-tokenizer}", *RESUME],
        "the tokenizer has 1019 tokens but the model's embedding has 960 rows",
    ),
    "dataset too small for one batch per process": (
        "ddp", ["--train_file", "{few.txt}", "--validation_file", "{few.txt}", *RESUME], "need at least one global batch"
    ),
    "a JSON Lines file with one malformed line": (
        "ddp", ["--train_file", "{malformed.jsonl}", *RESUME], "malformed.jsonl: line 11 is not a valid JSON record"
    ),
}
ARGUMENT_CASES = {
    "missing train file": (["--train_file", "/nonexistent/train.txt", *RESUME], "data file not found"),
    "resume path older than checkpoints after it": (
        ["--resume_from_checkpoint", "{previous}/checkpoints/step_4"], "is older than ['step_8']"
    ),
    "output directory that already holds a run": ([], "already holds a run"),
    "empty train file": (["--train_file", "{empty.txt}", *RESUME], "data file is empty"),
    "unsupported file type": (["--train_file", "{train.xml}", *RESUME], "unsupported data file type '.xml'"),
    "malformed recipe YAML": (["--config", "{broken.yaml}", *RESUME], "is not valid YAML"),
    "unknown recipe key": (["--config", "{typo.yaml}", *RESUME], "did you mean 'learning_rate'"),
    "zero batch size": (["--per_device_train_batch_size", "0", *RESUME], "must be at least 1, got 0"),
    "no steps and no epochs": (["--max_steps", "-1", "--num_train_epochs", "0", *RESUME], "nothing to train"),
    "negative steps other than -1": (["--max_steps", "-3", *RESUME], "--max_steps must be -1 (train for --num_train_epochs)"),
    "resume path that does not exist": (
        ["--resume_from_checkpoint", "/nonexistent/step_3"], "no complete checkpoint at /nonexistent/step_3"
    ),
    "resume path holding an incomplete checkpoint": (
        ["--resume_from_checkpoint", "{previous}/checkpoints/step_9.tmp"], "no complete checkpoint at"
    ),
    "output directory that cannot be written": (["--output_dir", "{empty.txt}/run"], "cannot write to --output_dir"),
    "tracker name misspelled": (["--report_to", "tensorbord", *RESUME], "unknown --report_to ['tensorbord']"),
    # what the parts refuse (deselected in a project without them: tests/conftest.py)
    "an image flag for the language task": pytest.param(
        ["--train_dir", "{empty.txt}", *RESUME], "--train_dir is for --task image-classification",
        marks=pytest.mark.parts("images")),
    "--merge_adapter without --use_peft": pytest.param(
        ["--merge_adapter", *RESUME], "--merge_adapter is for adapters: add --use_peft", marks=pytest.mark.parts("lora")),
    "--use_peft for the image task": pytest.param(
        ["--task", "image-classification", "--model_config", "resnet-tiny", "--use_peft", *RESUME],
        f"--use_peft is for --task {' or '.join(flag_owners('use_peft'))}, not image-classification; drop it or set --task causal-lm",
        marks=pytest.mark.parts("lora", "images")),
    "--use_peft without a pretrained model": pytest.param(
        ["--use_peft", *RESUME], "give --model_name_or_path", marks=pytest.mark.parts("lora")),
    "--use_peft with --device_map": pytest.param(
        ["--model_name_or_path", "{model}", "--use_peft", "--device_map", "auto", *RESUME],
        "--use_peft with --device_map is not supported", marks=pytest.mark.parts("lora", "layer_split")),
    "a language model config for images": pytest.param(
        ["--task", "image-classification", *RESUME], "unknown model_config 'llama-tiny' for --task image-classification",
        marks=pytest.mark.parts("images")),
}
FSDP_TP = {  # what accelerate launch sets for accelerate_configs/fsdp_tp.yaml
    "ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
           "PARALLELISM_CONFIG_DP_SHARD_SIZE": "2", "PARALLELISM_CONFIG_TP_SIZE": "2", "WORLD_SIZE": "4"}
LAUNCHER_CASES = {  # case -> (environment from accelerate launch, what the error line says)
    "malformed DeepSpeed JSON": (
        {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "{broken-json.json}"}, "is not valid JSON"
    ),
    "accelerate yaml pointing at a missing DeepSpeed JSON": (
        {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "ds_configs/missing.json"},
        "not found from",
    ),
    "fp16 on a CPU-only machine": ({"ACCELERATE_MIXED_PRECISION": "fp16"}, "fp16 mixed precision needs a GPU"),
    "DeepSpeed JSON with its own optimizer section": (
        {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "{own-optimizer.json}"},
        "has its own optimizer section: train.py builds the optimizer",
    ),
}


def snapshot(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """Every broken or mismatched file the cases point at."""
    d = tmp_path_factory.mktemp("inputs")
    (d / "empty.txt").write_text("")
    (d / "train.xml").write_text("<doc>text</doc>")
    (d / "few.txt").write_text("one short line\nand another\n")
    records = [json.dumps({"text": f"document {i} " * 20}) for i in range(30)]
    records[10] = '{"text": "an unterminated quote}'  # line 11: datasets said "row 10", and blamed the encoding
    (d / "malformed.jsonl").write_text("\n".join(records) + "\n")
    (d / "broken.yaml").write_text("max_steps: [1\n")
    (d / "typo.yaml").write_text("learnin_rate: 0.1\n")
    zero2 = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    (d / "broken-json.json").write_text('{"zero_optimization": {')  # a user's own DeepSpeed JSON
    (d / "own-optimizer.json").write_text(json.dumps(zero2 | {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}))
    fsdp1 = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())
    fsdp1["fsdp_config"]["fsdp_version"] = 1
    (d / "fsdp1.yaml").write_text(yaml.safe_dump(fsdp1))

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)
    AutoModelForCausalLM.from_config(build_named_config("llama-tiny", tokenizer)).save_pretrained(d / "model")
    tokenizer.save_pretrained(d / "model")
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(100)])  # 1019 > the 960 rows (919 padded to 64)
    tokenizer.save_pretrained(d / "big-tokenizer")
    return {p.name: p for p in d.iterdir()}


@pytest.fixture
def previous(cached_run, uneven_data, tmp_path) -> Path:
    """A finished run to point the bad input at: checkpoints, final/, metrics.jsonl, and a killed save."""
    run = tmp_path / "previous"
    shutil.copytree(cached_run("ddp", *split_args(uneven_data, per_device=4, accumulation=1)), run)
    (run / "checkpoints" / "step_9.tmp").mkdir()
    return run


def filler(inputs: dict[str, Path], previous: Path):
    """Replace each {name} placeholder in a case with the file it names."""
    files = {f"{{{name}}}": str(path) for name, path in inputs.items()} | {"{previous}": str(previous)}

    def fill(text: str) -> str:
        for placeholder, path in files.items():
            text = text.replace(placeholder, path)
        return text

    return fill


@pytest.mark.parametrize(("config", "args", "message"), LAUNCH_CASES.values(), ids=LAUNCH_CASES.keys())
def test_bad_input_is_one_clear_line_and_nothing_saved_is_touched(config, args, message, inputs, previous) -> None:
    before, fill = snapshot(previous), filler(inputs, previous)
    config, *launcher_args = fill(config).split()
    result = launch(Path(config) if config.endswith(".yaml") else config, "train.py", *TINY_RUN,
                    "--output_dir", str(previous), *map(fill, args), launcher_args=tuple(launcher_args), timeout=180)
    errors = bad_input_errors(result)
    assert errors and message in errors[0], result.stderr[-4000:]
    assert len(errors) == 1  # one line per run: the ranks of a machine found the same problem
    assert snapshot(previous) == before


def catches(process: psutil.Process, sig: int) -> bool:
    """Whether `process` has a handler for `sig` (/proc's caught-signals mask)."""
    status = Path(f"/proc/{process.pid}/status").read_text()
    return bool(int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
                & (1 << (sig - 1)))


@pytest.mark.parts("preemption")  # its handlers hold the signal
def test_a_fresh_launch_signalled_while_its_ranks_import_still_refuses_in_one_line(previous) -> None:
    """New interpreters, as a user's launch: the ranks import the libraries themselves (seconds), and a SIGTERM
    that reaches them meanwhile is held by the preemption part's handler (installed first), not fatal: the bad flag is then
    reported in one line, exit 2 on each rank."""
    before = snapshot(previous)
    command, env = launch_command("ddp", "train.py", *TINY_RUN, "--output_dir", str(previous), "--learnin_rate", "0.1",
                                  *RESUME, fresh=True)
    launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    ranks = {}
    try:
        wait_for(lambda: len(rank_processes(launcher)) == 2, 60, "the ranks to start", poll=0.005)
        ranks = rank_processes(launcher)
        for rank in ranks.values():  # frozen as soon as its handler is in: then signalled, while still importing
            wait_for(lambda: catches(rank, signal.SIGTERM), 30, "the stop handler", poll=0.001)
            rank.suspend()
        # still importing: datasets' pyarrow loads seconds into the import (libtorch within 0.1 s of the handler, too
        # soon for a test on a loaded machine to freeze both ranks before it)
        assert not any("libarrow" in m.path for rank in ranks.values() for m in rank.memory_maps())
        for rank in ranks.values():
            rank.send_signal(signal.SIGTERM)
            rank.resume()
        _, stderr = launcher.communicate(timeout=180)
    finally:
        end_launch(launcher, ranks.values())
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "did you mean 'learning_rate'" in errors[0], stderr[-4000:]
    # exit 2 (the first rank to fail is reported; torchrun then ends the other), no traceback before the line
    assert "Traceback" not in stderr.split("error: ")[0] and re.search(r"exitcode\s*:\s*2\b", stderr), stderr[-4000:]
    assert snapshot(previous) == before


@pytest.mark.quick
@pytest.mark.parametrize(("args", "message"), ARGUMENT_CASES.values(), ids=ARGUMENT_CASES.keys())
def test_bad_flags_and_files_are_refused_before_anything_starts(args, message, inputs, previous) -> None:
    before, fill = snapshot(previous), filler(inputs, previous)
    with pytest.raises(ArgumentError) as refused:
        parse_args([*TINY_RUN, "--output_dir", str(previous), *map(fill, args)])
    assert message in str(refused.value) and "\n" not in str(refused.value)  # one line
    assert snapshot(previous) == before


@pytest.mark.quick
@pytest.mark.parametrize(("environment", "message"), LAUNCHER_CASES.values(), ids=LAUNCHER_CASES.keys())
def test_launcher_settings_that_cannot_work_are_refused_before_any_process_group(
    environment, message, monkeypatch, inputs
) -> None:
    fill = filler(inputs, previous=Path("unused"))
    for name, value in environment.items():
        monkeypatch.setenv(name, fill(value))
    with pytest.raises(StrategyError, match=message):
        check_launch_config(requested_strategy(), on_cpu=True)


@pytest.mark.quick
@pytest.mark.parts("lora", "tensor_parallel")
def test_an_adapter_with_tensor_parallelism_is_refused_before_anything_starts(inputs, previous, monkeypatch) -> None:
    for name, value in FSDP_TP.items():  # what accelerate launch sets for fsdp_tp.yaml
        monkeypatch.setenv(name, value)
    with pytest.raises(ArgumentError, match=r"--use_peft with tensor parallelism \(fsdp_tp.yaml\) is not supported"):
        parse_args([*TINY_RUN, "--output_dir", str(previous), "--model_name_or_path", str(inputs["model"]), "--use_peft",
                    *RESUME])
