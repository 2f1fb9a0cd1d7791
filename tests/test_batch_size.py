"""`--auto_find_batch_size` (parts/batch_size/): a real out-of-memory, under an address-space limit
(on one rank, or on all), halves the micro-batch and doubles the accumulation on every rank; the run then
trains what a launch with the found size trains, records the size in its checkpoints and resumes with it."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from models.language import SHIPPED_TOKENIZER
from parts.batch_size.search import find_micro_batch
from scripts.compare_metrics import compare, worst_difference
from tests import forked_launcher
from tests.harness import (
    LAUNCHER,
    REPO,
    SUITE_FLAGS,
    assert_continues_exactly,
    flag_refusal,
    launch_command,
    rank_processes,
    wait_for,
)
from training.errors import StrategyError

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

# Each process may map 3.7 GB. A rank maps about 2.5 GB before its first step (libraries, threads), and its
# logits are tokens x 32,000 floats: a micro-batch of 32 x 128 tokens (0.5 GB of logits, about three such
# tensors in the loss and its backward) cannot fit, 16 can (measured under ddp and fsdp: both find 16 with
# 3.3 GB, and 32 fits in 4.1 GB; forked ZeRO-3 finds 8 with 3.3 GB, and with 4.1 fits 32 in the search but runs out
# of memory after it: the limit sits in the middle).
ADDRESS_SPACE_LIMIT = 3700 * 2**20
REQUESTED, FOUND = 32, 16
LOSS_TOLERANCE = 1e-5  # test_parity.py's, between strategies (SGD here: Adam would amplify their rounding on the
# embedding rows that no token of these steps reaches)


@pytest.fixture(scope="module")
def wide_vocabulary_model(tmp_path_factory) -> Path:
    """A one-layer Llama, 8 wide, with a 32,000-word output layer: big logits, little compute."""
    directory = tmp_path_factory.mktemp("wide-vocabulary")
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)
    config = LlamaConfig(vocab_size=32000, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=128,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def run_args(model: Path, per_device: int, accumulation: int = 1) -> tuple[str, ...]:
    """Two steps of `model` on 128-token blocks of the default corpus, a checkpoint after each."""
    return ("--model_name_or_path", str(model), "--block_size", "128", "--per_device_train_batch_size", str(per_device),
            "--gradient_accumulation_steps", str(accumulation), "--max_steps", "2", "--logging_steps", "1",
            "--save_steps", "1", "--eval_strategy", "no", "--optim", "sgd", "--learning_rate", "0.5", "--warmup_steps", "0",
            *SUITE_FLAGS)


def launch_run(config: str, output_dir: Path, *args: str, limited: str = "every rank") -> subprocess.CompletedProcess:
    """train.py under `config` and the address-space limit: on `every rank` (set on the launcher, which every
    rank inherits, as `prlimit --as` around a launch), on `rank 1` alone (set on that process as it starts: the
    other has all the memory it wants), or on `no rank`. Forked (tests/forked_launcher.py) but for `rank 1`,
    whose process is found by its command line: new interpreters."""
    command, env = launch_command(config, "train.py", *args, "--output_dir", str(output_dir))
    if limited != "rank 1":
        result = forked_launcher.run(command[len(LAUNCHER):], env, REPO, timeout=300,
                                     address_space=ADDRESS_SPACE_LIMIT if limited == "every rank" else None)
        (output_dir / "launch.log").write_text(result.stdout + result.stderr)
        return result
    launcher = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    # long before its first step: a rank takes seconds to import its libraries
    wait_for(lambda: 1 in rank_processes(launcher), 120, "rank 1 to start", poll=0.02)
    subprocess.run(["prlimit", f"--pid={rank_processes(launcher)[1].pid}", f"--as={ADDRESS_SPACE_LIMIT}"], check=True)
    stdout, stderr = launcher.communicate(timeout=300)
    (output_dir / "launch.log").write_text(stdout + stderr)
    return subprocess.CompletedProcess(launcher.args, launcher.returncode, stdout, stderr)


@pytest.fixture(scope="module")
def found_size_run(wide_vocabulary_model, tmp_path_factory) -> Path:
    """The reference: DDP launched with the size the others find, without a limit or the flag."""
    output_dir = tmp_path_factory.mktemp("found-size")
    result = launch_run("ddp", output_dir, *run_args(wide_vocabulary_model, FOUND, REQUESTED // FOUND), limited="no rank")
    assert result.returncode == 0, result.stderr[-4000:]
    return output_dir


# config -> the ranks limited: under DDP rank 1 alone runs out of memory, and rank 0, which would not, agrees to the
# smaller size (no collective inside DDP's probe to leave it waiting); FSDP2's and ZeRO's ranks gather weights or
# reduce gradients in the probe, so they run out alike (as on equal machines).
LIMITED = {"ddp": "rank 1", "fsdp": "every rank", "deepspeed_zero2": "every rank", "deepspeed_zero3": "every rank"}


@pytest.fixture(scope="module")
def auto_run(wide_vocabulary_model, tmp_path_factory):
    """`auto_run(config)`: the requested micro-batch under the limit, with --auto_find_batch_size, once per module."""

    @functools.cache
    def run(config: str) -> Path:
        output_dir = tmp_path_factory.mktemp(f"auto-{config}")
        result = launch_run(config, output_dir, *run_args(wide_vocabulary_model, REQUESTED), "--auto_find_batch_size",
                            limited=LIMITED[config])
        assert result.returncode == 0, result.stderr[-4000:]
        return output_dir

    return run


@pytest.mark.parametrize("config", sorted(LIMITED))
def test_a_micro_batch_that_runs_out_of_memory_is_halved_and_trains_what_the_found_size_trains(
    config, auto_run, found_size_run
) -> None:
    run = auto_run(config)
    log = (run / "launch.log").read_text()
    assert log.count(f"--auto_find_batch_size: a micro-batch of {FOUND} per process fits, 2 accumulated per step "
                     f"({REQUESTED} ran out of memory)") == 1  # the main process says it, for every rank
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["per_device_train_batch_size"], summary["gradient_accumulation_steps"]) == (FOUND, 2)
    if config.startswith("deepspeed"):  # the engine was built again for the size found, and ran it (the losses below)
        effective = json.loads((run / "deepspeed_config.json").read_text())
        assert (effective["train_micro_batch_size_per_gpu"], effective["gradient_accumulation_steps"],
                effective["train_batch_size"]) == (FOUND, 2, 2 * 2 * FOUND)
    saved = json.loads((run / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert (saved["per_device_train_batch_size"], saved["gradient_accumulation_steps"], saved["global_batch"]) == (
        FOUND, 2, 2 * REQUESTED)
    differences = compare(found_size_run, run, keys=("loss", "lr"))
    assert len(differences) == 4  # loss and lr at both steps
    worst = worst_difference(differences)
    assert worst.absolute <= (0 if config == "ddp" else LOSS_TOLERANCE), worst  # DDP: the very same computation


def test_a_resumed_run_takes_the_size_its_checkpoint_recorded(auto_run, wide_vocabulary_model, tmp_path) -> None:
    """The same flags again, resumed under the same limit: no second search, and it continues exactly."""
    full = auto_run("fsdp")
    shutil.copytree(full / "checkpoints" / "step_1", tmp_path / "checkpoints" / "step_1")
    result = launch_run("fsdp", tmp_path, *run_args(wide_vocabulary_model, REQUESTED), "--auto_find_batch_size",
                        "--resume_from_checkpoint", "latest")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "at step 1" in result.stderr and "--auto_find_batch_size: a micro-batch" not in result.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["per_device_train_batch_size"] == FOUND
    assert_continues_exactly(full, tmp_path, 1, last_step=2)


@pytest.mark.quick
def test_the_search_keeps_the_global_batch_and_says_when_nothing_fits() -> None:
    """Real allocation failures (a tensor of 2**44 floats per example, beyond any machine's memory) on one
    process: 12 -> 6 -> 3 fits; odd sizes step to their largest divisor; a micro-batch of 1 that fails is one line.
    What the probes did is undone: gradients, BatchNorm statistics, the RNG."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2), torch.nn.Dropout(0.5))
    linear = torch.nn.Linear(2, 2)  # for micro-batches of 1, which BatchNorm cannot train on
    optimizer = torch.optim.SGD([*model.parameters(), *linear.parameters()], lr=0.1)
    buffers, rng = [b.clone() for b in model.buffers()], torch.get_rng_state()
    tried = []

    def micro_step_up_to(fitting: int, module: torch.nn.Module = linear):
        def micro_step(batch: dict) -> None:
            size = len(batch["x"])
            tried.append(size)
            if size > fitting:
                torch.empty(size * 2**44)  # DefaultCPUAllocator: can't allocate memory
            module(batch["x"]).sum().backward()

        return micro_step

    def examples(n: int) -> dict:
        return {"x": torch.arange(2.0 * n).view(n, 2)}

    try:
        assert find_micro_batch(accelerator, lambda: (model, optimizer, micro_step_up_to(3, model)), examples, 12, 2) == (3, 8)
        assert tried == [12, 6, 3] and all(p.grad is None for p in model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(model.buffers(), buffers)) and torch.equal(torch.get_rng_state(), rng)
        tried.clear()
        assert find_micro_batch(accelerator, lambda: (linear, optimizer, micro_step_up_to(2)), examples, 9, 1) == (1, 9)
        assert tried == [9, 3, 1]
        with pytest.raises(StrategyError, match="a micro-batch of 1 runs out of memory on this machine") as refused:
            find_micro_batch(accelerator, lambda: (linear, optimizer, micro_step_up_to(0)), examples, 2, 1)
        assert "\n" not in str(refused.value)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


REFUSED = {  # flags, launcher environment -> what the one line says
    "with pipeline stages": pytest.param(["--pipeline_parallel_size", "2"], {},
                                         "--auto_find_batch_size with --pipeline_parallel_size is not supported",
                                         marks=pytest.mark.parts("pipeline")),
    "with --device_map": pytest.param(["--device_map", "auto"], {}, "--auto_find_batch_size with --device_map is not supported",
                                      marks=pytest.mark.parts("layer_split")),
    "with --streaming": pytest.param(["--streaming", "--max_steps", "5"], {},
                                     "--auto_find_batch_size with --streaming is not supported", marks=pytest.mark.parts("streaming")),
}


@pytest.mark.quick
@pytest.mark.parametrize(("args", "env", "message"), REFUSED.values(), ids=REFUSED.keys())
def test_what_the_search_cannot_resize_is_one_line(args, env, message, monkeypatch, tmp_path) -> None:
    assert message in flag_refusal(["--output_dir", str(tmp_path), "--auto_find_batch_size", *args], env, monkeypatch)
