"""Every checkpoint resumes under every config file, process count, precision, model shape and --optim.

A case saves a checkpoint under one key (config, processes, precision) and resumes it under another, with the
same --optim and model shape, and compares the step it takes with the step the saving run took itself: its loss and
then its whole state, value by value and with the optimizer's, through the checkpoint reader (1e-5 in fp32; bf16
against the bf16 tolerance; frozen weights and step counts exactly). The model shapes are what users bring: a plain
`nn.Module` of odd and prime sizes (tests/odd_shapes.py: a 5-element bias, a 7 x 13 weight, one element, a 0-dim
parameter, a float64 parameter, an int64 counter past 2**24 and a float64 buffer, tied weights, a frozen layer,
BatchNorm statistics) and the template's Llama at odd sizes (which fsdp_tp can slice).

The suite runs a generated pairwise matrix: every pair of values of any two of the eight dimensions appears in some
case. The full product is marked `nightly` (`python -m pytest -m nightly tests/test_resume_matrix.py`). Each key is
one launch of tests/probes/resume_probe.py, which trains the key's own run (train.py's functions) and resumes, in the
same process group, every case's checkpoint that resumes under it.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections import defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import CONFIGS, REPO, SUITE_FLAGS, launch, made_once
from training.checkpoints.tensors import ModelState
from training.optim import OPTIMIZERS

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

PROBE = REPO / "tests" / "probes" / "resume_probe.py"
STEPS = 3  # each key's own run: a checkpoint at every step; a case resumes step 2 and takes step 3
GLOBAL_BATCH = 12  # divides among 1, 2, 3 and 4 processes
FP32_TOLERANCE = 1e-5
BF16_TOLERANCE = 1e-3  # the strategies compute bf16 differently by design (docs/parity.md)
SHAPES = {
    "odd": ("--task", "tests.odd_shapes:OddShapesTask"),
    # the template's Llama at odd sizes: a hidden size of 28 = 4 x 7, 2 heads of 14, an MLP of 37 (prime)
    "llama_odd": ("--model_config", "llama-tiny", "--config_overrides",
                  "hidden_size=28,num_attention_heads=2,num_key_value_heads=2,intermediate_size=37"),
}
BATCH_NORM = ("odd",)  # shapes with BatchNorm
CONFIG_FILES = tuple(sorted(path.stem for path in CONFIGS.glob("*.yaml")))
PROCESSES = (1, 2, 3, 4)
PRECISIONS = ("no", "bf16")
TENSOR_PARALLEL = {"fsdp_tp": 2}  # configs that slice layers: their size of each layer's group


@dataclass(frozen=True, order=True)
class Key:
    """One launch's settings: what saves a checkpoint, or resumes one."""

    config: str
    processes: int
    precision: str
    optim: str
    shape: str

    def valid(self) -> bool:
        processes = {"single": (1,), "fsdp_tp": (4,)}.get(self.config, PROCESSES)
        whole_tensors = not OPTIMIZERS[self.optim].needs_whole_tensors or self.config in ("single", "ddp")
        sliceable = self.config not in TENSOR_PARALLEL or self.shape == "llama_odd"
        return self.processes in processes and whole_tensors and sliceable

    @property
    def name(self) -> str:
        return f"{self.config}x{self.processes}-{self.precision}-{self.optim}-{self.shape}"

    def flags(self) -> list[str]:
        """train.py's flags: a global batch of 12 sequences, one per micro-batch where BatchNorm computes statistics
        over the micro-batch (whose split must not depend on the process count), else one micro-batch per rank."""
        per_rank = GLOBAL_BATCH // (self.processes // TENSOR_PARALLEL.get(self.config, 1))
        micro = 1 if self.shape in BATCH_NORM else per_rank
        return ["--optim", self.optim, "--learning_rate", "3e-3", "--warmup_steps", "1", "--max_steps", str(STEPS),
                "--save_steps", "1", "--logging_steps", "1", "--eval_strategy", "no", "--max_eval_samples", "16",
                "--per_device_train_batch_size", str(micro), "--gradient_accumulation_steps", str(per_rank // micro),
                *SUITE_FLAGS, *SHAPES[self.shape]]


@dataclass(frozen=True, order=True)
class Case:
    saved: Key
    resumed: Key

    @property
    def name(self) -> str:
        return f"{self.saved.name}--{self.resumed.config}x{self.resumed.processes}-{self.resumed.precision}"

    def values(self) -> tuple[tuple[str, object], ...]:
        """The case's value of each dimension of the matrix."""
        s, r = self.saved, self.resumed
        return (("save_config", s.config), ("save_processes", s.processes), ("save_precision", s.precision),
                ("resume_config", r.config), ("resume_processes", r.processes), ("resume_precision", r.precision),
                ("optim", s.optim), ("shape", s.shape))

    def pairs(self) -> set[tuple]:
        return set(itertools.combinations(self.values(), 2))


def every_key() -> list[Key]:
    return [key for key in itertools.starmap(Key, itertools.product(
        CONFIG_FILES, PROCESSES, PRECISIONS, OPTIMIZERS, SHAPES)) if key.valid()]


def full_matrix() -> list[Case]:
    """Every case: every pair of keys with the same --optim and model shape."""
    groups = defaultdict(list)
    for key in every_key():
        groups[key.optim, key.shape].append(key)
    return [Case(saved, resumed) for keys in groups.values() for saved in keys for resumed in keys]


# The pairwise matrix's keys, by group of one --optim and model shape (a case resumes within its group), each group in
# launch order (a key trains its own run, then resumes the cases of keys before it). A covering design, as a Latin
# square is one: every config file holds every process count (1-4, over its groups), both precisions, both shapes and
# every --optim it can run; the two largest groups run the configs in opposite orders, so that between them a
# checkpoint of each config resumes under each other one. The cases are then chosen from these keys
# (`pairwise_matrix`), and a quick test checks that they hold every pair the full matrix holds.
KEY_DESIGN: dict[tuple[str, str], list[tuple[str, int, str]]] = {
    ("adamw_torch_fused", "llama_odd"): [
        ("fsdp_tp", 4, "no"), ("single", 1, "no"), ("ddp", 3, "bf16"), ("fsdp", 2, "no"), ("deepspeed_zero1", 4, "bf16"),
        ("deepspeed_zero2", 1, "no"), ("deepspeed_zero3", 3, "no"), ("deepspeed_zero3_offload", 2, "bf16")],
    ("sgd", "llama_odd"): [
        ("deepspeed_zero3_offload", 1, "no"), ("deepspeed_zero3", 4, "bf16"), ("deepspeed_zero2", 3, "bf16"),
        ("deepspeed_zero1", 2, "no"), ("fsdp", 4, "bf16"), ("ddp", 1, "no"), ("single", 1, "bf16"), ("fsdp_tp", 4, "bf16")],
    ("adamw_torch", "odd"): [
        ("deepspeed_zero2", 2, "bf16"), ("ddp", 2, "no"), ("deepspeed_zero3", 2, "no"), ("single", 1, "bf16"),
        ("fsdp", 3, "bf16"), ("deepspeed_zero1", 1, "no"), ("deepspeed_zero3_offload", 3, "no")],
    ("adamw_torch", "llama_odd"): [("fsdp_tp", 4, "no")],
    ("adamw_torch_fused", "odd"): [("fsdp", 1, "bf16"), ("deepspeed_zero1", 3, "no"), ("deepspeed_zero2", 4, "no")],
    ("sgd", "odd"): [("deepspeed_zero3", 1, "bf16"), ("deepspeed_zero3_offload", 4, "no")],
    ("adafactor", "odd"): [("ddp", 2, "no"), ("single", 1, "no"), ("ddp", 3, "bf16")],
    ("adafactor", "llama_odd"): [("ddp", 4, "no")],
}


def held(keys: list[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """A group's keys of the configs this project holds (a project without tensor parallelism has no fsdp_tp.yaml:
    its group's one key becomes DDP's on as many processes)."""
    kept = [key for key in keys if key[0] in CONFIG_FILES]
    return kept or [("ddp", keys[0][1], keys[0][2])]


def pairwise_matrix(required: list[Case]) -> list[Case]:
    """`required`, and cases between KEY_DESIGN's keys that hold every other pair of values the full matrix holds:
    chosen greedily for the pairs each adds, among the cases a group's launch order allows."""
    allowed = [Case(Key(*saved, optim, shape), Key(*resumed, optim, shape))
               for (optim, shape), keys in KEY_DESIGN.items() for keys in [held(keys)]
               for index, saved in enumerate(keys) for resumed in keys[index:]]
    uncovered = set().union(*(case.pairs() for case in full_matrix()))
    chosen = list(required)
    for case in chosen:
        uncovered -= case.pairs()
    while uncovered:
        best = max(allowed, key=lambda case: (len(case.pairs() & uncovered), repr(case)))
        if not best.pairs() & uncovered:
            raise ValueError(f"KEY_DESIGN's keys hold no case for {sorted(uncovered)[:3]}...")
        chosen.append(best)
        uncovered -= best.pairs()
    return sorted(set(chosen))


def launches(cases: list[Case]) -> list[tuple[Key, bool, list[Case]]]:
    """(key, whether it trains its own run, the cases it resumes), in an order where every case's checkpoint is
    saved before it is resumed: the keys in an order the cases agree with as far as they can (all of them in the
    pairwise matrix), then a second launch of each key that resumes a later key's checkpoint (the full matrix)."""
    keys = sorted({key for case in cases for key in (case.saved, case.resumed)})
    waiting = {key: {case.saved for case in cases if case.resumed == key} - {key} for key in keys}
    order = []
    while len(order) < len(keys):
        ready = [key for key in keys if key not in order and not waiting[key] - set(order)]
        order.append(ready[0] if ready else next(key for key in keys if key not in order))
    position = {key: index for index, key in enumerate(order)}
    first, second = defaultdict(list), defaultdict(list)
    for case in sorted(cases):
        (first if position[case.saved] <= position[case.resumed] else second)[case.resumed].append(case)
    trains = {case.saved for case in cases}
    return [(key, key in trains, first[key]) for key in order] + [(key, False, second[key]) for key in order if second[key]]


def run_matrix(cases: list[Case], directory: Path, after_launch: Callable[[list[Case]], None] = lambda cases: None) -> None:
    """Every launch of `cases`, in order, each a launch of the probe under its key's config; `after_launch` is handed
    the cases each one resumed."""
    for index, (key, trains, resumed) in enumerate(launches(cases)):
        spec = {"flags": key.flags(), "origin": str(directory / "runs" / key.name) if trains else None,
                "resume": {case.name: str(checkpoint(directory, case.saved, STEPS - 1)) for case in resumed},
                "cases": str(directory / "cases"), "scratch": str(directory / "scratch" / f"{index}-{key.name}")}
        path = directory / "launches" / f"{index}-{key.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(spec, indent=1))
        result = launch(key.config, PROBE, str(path), timeout=600,
                        launcher_args=("--num_processes", str(key.processes), "--mixed_precision", key.precision))
        assert result.returncode == 0, f"{key.name}:\n{result.stdout[-2000:]}\n{result.stderr[-6000:]}"
        after_launch(resumed)


def checkpoint(directory: Path, key: Key, step: int) -> Path:
    """The checkpoint `key`'s own run saved at `step`."""
    return directory / "runs" / key.name / "checkpoints" / f"step_{step}"


def resumed_checkpoint(directory: Path, case: Case, step: int) -> Path:
    """What `case` saved at `step`: as it resumed (STEPS - 1), and after its step (STEPS)."""
    return directory / "cases" / case.name / "checkpoints" / f"step_{step}"


FROZEN = {"odd": ("frozen.weight", "frozen.bias"), "llama_odd": ()}  # never trained: their values exactly, always
RUNNING_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")  # updated per process's micro-batches


def tolerance(case: Case) -> float:
    return FP32_TOLERANCE if case.saved.precision == case.resumed.precision == "no" else BF16_TOLERANCE


def half_precision_buffers(key: Key) -> bool:
    """DeepSpeed's half-precision engines hold BatchNorm's statistics in bf16 (training/strategy/adapters.py)."""
    return key.config.startswith("deepspeed") and key.precision == "bf16"


def assert_same_state(expected: Path, actual: Path, atol: float, names: set[str] | None = None,
                      buffers_in_bf16: bool = False) -> None:
    """The two checkpoints hold the same tensors (or `names` of them), values and optimizer state, each in its own
    dtype, to within `atol` (0: exactly), read by train.py's own reader; step counts exactly. A float64 parameter
    that one strategy holds in float32 (`held_alike`) is compared at float32."""
    with ExitStack() as files:
        want, got = ModelState(expected, files), ModelState(actual, files)
        assert got.shapes == want.shapes
        for name in sorted(names if names is not None else want.shapes):
            w, g = want.whole(name), got.whole(name)
            statistics = name.endswith(RUNNING_STATISTICS)  # averaged over the ranks at every save: to the last bit
            floating = buffers_in_bf16 and statistics and w.value.is_floating_point()  # (not the step counter)
            value = w.value.bfloat16().float() if floating else w.value
            torch.testing.assert_close(*held_alike(g.value, value), atol=atol, rtol=1e-6 if statistics else 0,
                                       msg=named(name))
            assert g.elementwise.keys() == w.elementwise.keys() and g.other.keys() == w.other.keys(), name
            for key in w.elementwise:
                torch.testing.assert_close(*held_alike(g.elementwise[key], w.elementwise[key]), atol=atol, rtol=0,
                                           msg=named(f"{name} {key}"))
            for key in w.other:
                wanted, found = (torch.as_tensor(state[key], dtype=torch.float64) for state in (w.other, g.other))
                torch.testing.assert_close(found, wanted, atol=0 if key == "step" else atol, rtol=0,
                                           msg=named(f"{name} {key}"))


def held_alike(got: torch.Tensor, want: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two floating-point values at the narrower of their dtypes: DeepSpeed's masters, and FSDP2's parameters under
    bf16, are float32 where the model declared float64 (training/strategy/whole.py). Any other pair as it is: an
    integer is never compared as a float."""
    if got.dtype != want.dtype and got.is_floating_point() and want.is_floating_point():
        narrower = min(got.dtype, want.dtype, key=lambda dtype: dtype.itemsize)
        return got.to(narrower), want.to(narrower)
    return got, want


def named(name: str):
    return lambda message: f"{name}: {message}"


def logged_loss(directory: Path, key: Key, step: int) -> float:
    return next(json.loads(line)["loss"] for line in (directory / "runs" / key.name / "metrics.jsonl").open()
                if json.loads(line).get("step") == step and "loss" in json.loads(line))


def assert_case_continues(directory: Path, case: Case) -> None:
    """`case` restored exactly what was saved, and its step is the step the saving run took."""
    assert_same_state(checkpoint(directory, case.saved, STEPS - 1), resumed_checkpoint(directory, case, STEPS - 1), 0,
                      buffers_in_bf16=half_precision_buffers(case.resumed))
    atol = tolerance(case)
    loss = json.loads((directory / "cases" / case.name / "loss.json").read_text())
    expected = logged_loss(directory, case.saved, STEPS)
    assert abs(loss - expected) <= atol, (case.name, loss, expected)
    went_on, resumed = checkpoint(directory, case.saved, STEPS), resumed_checkpoint(directory, case, STEPS)
    with ExitStack() as files:
        trained = {name for name in ModelState(went_on, files).shapes if not name.endswith(RUNNING_STATISTICS)}
    assert_same_state(went_on, resumed, atol, names=trained - set(FROZEN[case.saved.shape]))
    assert_same_state(went_on, resumed, 0, names=set(FROZEN[case.saved.shape]))


def case(saved: str, resumed: str, optim: str = "adamw_torch_fused", shape: str = "odd") -> Case:
    """A case from its keys' names: `config x processes [bf16]`."""
    def key(name: str) -> Key:
        config, processes, *precision = name.replace(" x ", " ").split()
        return Key(config, int(processes), precision[0] if precision else "no", optim, shape)

    return Case(key(saved), key(resumed))


REPORTED = {  # what an outside probe broke (issue 54), each a case of the matrix
    "zero3 on 3 processes, the template's Llama": case("single x 1", "deepspeed_zero3 x 3", shape="llama_odd"),
    "a 5-element bias, ddp to zero3": case("ddp x 2", "deepspeed_zero3 x 2", optim="adamw_torch"),
    "a 5-element bias, zero3's own checkpoint": case("deepspeed_zero3 x 2", "deepspeed_zero3 x 2", optim="adamw_torch"),
    "adafactor, ddp's own checkpoint": case("ddp x 2", "ddp x 2", optim="adafactor"),
    "adafactor, one process's own": case("single x 1", "single x 1", optim="adafactor"),
    "frozen weights, zero2 in bf16 to ddp in fp32": case("deepspeed_zero2 x 2 bf16", "ddp x 2", optim="adamw_torch"),
}
PAIRWISE = pairwise_matrix(list(REPORTED.values()))


@pytest.fixture(scope="module")
def pairwise_run(shared_dir) -> Path:
    return made_once(shared_dir / "resume_matrix", lambda directory: run_matrix(PAIRWISE, directory))


@pytest.mark.quick
def test_the_pairwise_matrix_holds_every_pair_of_values_the_full_one_holds() -> None:
    """Every pair of values of any two dimensions (every switch of config both ways, every --optim under every
    config, every process count after every other...), each key launched once."""
    every_pair = set().union(*(case.pairs() for case in full_matrix()))
    assert set().union(*(case.pairs() for case in PAIRWISE)) == every_pair
    assert {(case.saved.config, case.resumed.config) for case in PAIRWISE} == set(itertools.product(CONFIG_FILES, repeat=2))
    keys = {key for case in PAIRWISE for key in (case.saved, case.resumed)}
    assert sorted(key for key, _, _ in launches(PAIRWISE)) == sorted(keys)


@pytest.mark.parametrize("case", PAIRWISE, ids=lambda case: case.name)
def test_a_checkpoint_resumes_under_another_key_as_the_run_went_on(case, pairwise_run) -> None:
    assert_case_continues(pairwise_run, case)


@pytest.mark.parametrize("case", REPORTED.values(), ids=REPORTED.keys())
def test_what_an_outside_probe_broke_resumes_as_the_run_went_on(case, pairwise_run) -> None:
    """Each failed before: ZeRO-3 could not load a tensor the process count does not divide (an unpadded value
    handed to its padded partition); Adafactor's factored state was taken for damage; frozen weights were saved
    bf16-rounded by DeepSpeed's bf16 engine (now exact: its fp32 values as built)."""
    assert case in PAIRWISE
    assert_case_continues(pairwise_run, case)


def test_every_config_exports_the_same_tensors_of_a_tied_model(pairwise_run) -> None:
    """final/ of the plain module with an output layer tied to its embedding, under every config, process count and
    precision: one set of names and shapes (FSDP2 and ZeRO-1/2 exported a copy of the tied weight that ZeRO-3 left
    out; ZeRO-1/2 gave a 0-dim parameter back 1-dim; ZeRO-3 could not export it), integers and float64 buffers in
    their own dtype, to the last bit."""
    keys = sorted({case.saved for case in PAIRWISE if case.saved.shape == "odd"})
    assert {key.config for key in keys} == set(CONFIG_FILES) - set(TENSOR_PARALLEL)  # every config that runs it
    exports = {key: load_file(pairwise_run / "runs" / key.name / "final" / "model.safetensors") for key in keys}
    first = exports[keys[0]]
    assert "head.weight" not in first and first["temperature"].shape == () and first["scale64"].shape == (5,)
    for key, tensors in exports.items():
        assert {name: tensor.shape for name, tensor in tensors.items()} == {
            name: tensor.shape for name, tensor in first.items()}, key.name
        assert tensors["tokens_seen"].dtype == torch.int64 and tensors["tokens_seen"].item() == 2**24 + 1, key.name
        assert tensors["offset64"].dtype == torch.float64 and (tensors["offset64"] == 1 + 1e-12).all(), key.name


@pytest.mark.nightly
@pytest.mark.timeout(6 * 3600)  # (the suite's 15 minutes are for its own tests)
def test_every_case_of_the_full_matrix_resumes_as_the_run_went_on(tmp_path) -> None:
    """The full product; every failing case named, not only the first. Each case's checkpoints are deleted once
    checked (about 1 MB each)."""
    full, failures = full_matrix(), []

    def check(cases: list[Case]) -> None:
        for case in cases:
            try:
                assert_case_continues(tmp_path, case)
            except AssertionError as error:
                failures.append(f"{case.name}: {str(error).splitlines()[0]}")
            shutil.rmtree(tmp_path / "cases" / case.name)

    run_matrix(full, tmp_path, check)
    assert not failures, f"{len(failures)} of {len(full)} cases:\n" + "\n".join(failures)
