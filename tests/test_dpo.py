"""DPO (parts/dpo): the formulas against a direct computation, the pairs' data and its refusals, and real runs under
every data-parallel config file, full and LoRA, agreeing with one process and resuming exactly."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from data import DataError
from parts.dpo.default_dpo import default_dpo_splits
from parts.dpo.loss import answer_log_probs, dpo_loss
from parts.dpo.reference import TABLE_FILE
from parts.dpo.task import FIGURES, PairCollator, check_pair, pair_sums, tokenize_pairs
from scripts.compare_metrics import compare, worst_difference
from tests.harness import (
    REPO,
    TINY_RUN,
    assert_continues_exactly,
    bad_input_errors,
    flag_refusal,
    launch,
    nudged_copy,
    read_metrics,
    train,
    with_processes,
)
from training.arguments import parse_args

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

TUNED_CONFIGS = ("ddp", "fsdp", "deepspeed_zero2", "deepspeed_zero3")
STEPS, RESUME_STEP = 6, 3
LOSS_TOLERANCE = 1e-5  # test_parity.py's
TOKENIZER = REPO / "models" / "tokenizer"


@pytest.mark.quick
@pytest.mark.parametrize(("loss_type", "label_smoothing", "reference_free"),
                         [("sigmoid", 0.0, False), ("sigmoid", 0.2, False), ("ipo", 0.0, False), ("hinge", 0.0, False),
                          ("sigmoid", 0.0, True)])
def test_the_loss_and_rewards_of_a_fixed_batch_are_the_papers_formulas(loss_type, label_smoothing, reference_free) -> None:
    """From logits and labels to each pair's loss and rewards, in fp32, against the formulas computed in float64
    one number at a time (the DPO paper's sigmoid loss with cDPO's smoothing, IPO on mean log-probabilities, the
    hinge), to 1e-6."""
    generator = torch.Generator().manual_seed(0)
    pairs, length, vocabulary, beta = 3, 9, 13, 0.1
    logits = {model: torch.randn(2 * pairs, length, vocabulary, generator=generator) for model in ("policy", "reference")}
    labels = torch.randint(0, vocabulary, (2 * pairs, length), generator=generator)
    labels[:, :3] = -100  # the prompt
    labels[1, 7:] = -100  # padding after a shorter answer
    average = loss_type == "ipo"

    def log_probability(model: str, row: int) -> float:  # of the answer's tokens, each predicted by the one before
        values = [F.log_softmax(logits[model][row, position - 1].double(), dim=-1)[labels[row, position]].item()
                  for position in range(1, length) if labels[row, position] != -100]
        return sum(values) / (len(values) if average else 1)

    scores = torch.stack([*answer_log_probs(logits["policy"], labels, average).chunk(2),
                          *(torch.zeros(2 * pairs) if reference_free else
                            answer_log_probs(logits["reference"], labels, average)).chunk(2)], dim=1)
    measured = pair_sums(scores, beta, loss_type, label_smoothing)
    for pair in range(pairs):
        policy = [log_probability("policy", pair), log_probability("policy", pairs + pair)]
        reference = [0.0, 0.0] if reference_free else [log_probability("reference", pair),
                                                         log_probability("reference", pairs + pair)]
        h = (policy[0] - policy[1]) - (reference[0] - reference[1])
        expected = {
            "sigmoid": -(1 - label_smoothing) * math.log(1 / (1 + math.exp(-beta * h)))
                       - label_smoothing * math.log(1 / (1 + math.exp(beta * h))),
            "ipo": (h - 1 / (2 * beta)) ** 2,
            "hinge": max(0.0, 1 - beta * h),
        }[loss_type]
        rewards = [beta * (policy[0] - reference[0]), beta * (policy[1] - reference[1])]
        assert measured["loss"][pair].item() == pytest.approx(expected, rel=1e-6, abs=1e-6)
        assert measured["rewards_chosen"][pair].item() == pytest.approx(rewards[0], rel=1e-6, abs=1e-6)
        assert measured["rewards_rejected"][pair].item() == pytest.approx(rewards[1], rel=1e-6, abs=1e-6)
        assert measured["margins"][pair].item() == pytest.approx(rewards[0] - rewards[1], rel=1e-5, abs=1e-6)
        assert measured["accuracies"][pair].item() == float(rewards[0] > rewards[1])
        assert measured["logps_chosen"][pair].item() == pytest.approx(policy[0], rel=1e-6, abs=1e-6)
    with pytest.raises(ValueError, match="unknown DPO loss_type 'kto'"):
        dpo_loss(*scores.unbind(dim=1), beta, "kto")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TOKENIZER)


@pytest.mark.quick
def test_a_pair_is_two_sequences_scored_on_their_answers_and_a_long_prompt_keeps_its_end(tokenizer) -> None:
    prompt = " ".join(["word"] * 40)
    batch = {"prompt": [prompt, "Say yes:"], "chosen": [" yes", " yes"], "rejected": [" no", " no"]}
    out = tokenize_pairs(batch, [0, 1], tokenizer, max_length=64, max_prompt_length=10, truncation_mode="keep_start",
                         offset=5)
    assert out["pair_index"] == [5, 6]
    assert out["prompt_cut"] == [True, False] and out["truncated"] == [False, False]
    for answer, text in (("chosen", " yes"), ("rejected", " no")):
        ids, labels = out[f"{answer}_input_ids"][0], out[f"{answer}_labels"][0]
        answer_tokens = [label for label in labels if label != -100]
        assert labels.index(answer_tokens[0]) == 10  # the prompt's last 10 tokens kept, then the answer
        assert tokenizer.decode(answer_tokens).startswith(text)
        assert ids[:10] == tokenizer(prompt, add_special_tokens=False)["input_ids"][-10:]
    collated = PairCollator(tokenizer.pad_token_id)([{key: values[row] for key, values in out.items()} for row in (0, 1)])
    assert collated["input_ids"].shape[0] == 4 and collated["input_ids"].shape[1] % 8 == 0  # chosen, chosen, rejected, rejected
    assert collated["input_ids"][0].tolist()[:len(out["chosen_input_ids"][0])] == out["chosen_input_ids"][0]
    assert collated["input_ids"][2].tolist()[:len(out["rejected_input_ids"][0])] == out["rejected_input_ids"][0]
    assert (collated["labels"][collated["attention_mask"] == 0] == -100).all()


SHARED_BOUNDARY = {"prompt": ["Q: 12 + 34 = ", "Q: 20 + 1 = "], "chosen": ["46.", "21."], "rejected": ["146.", "47."]}


@pytest.mark.quick
def test_pairs_that_differ_only_in_a_token_shared_with_the_prompt_are_scored_on_it_and_learned(tokenizer) -> None:
    """Plain text as users write it: the prompt's last space and the answer's digits are one token (" 46"), which
    was labelled the prompt's, so chosen and rejected had the same targets and DPO stayed at log 2. The shared token
    is now the answer's first target (counted); a policy trained on these pairs learns to prefer the chosen ones."""
    from transformers import AutoModelForCausalLM

    from models.configs import build_named_config
    from parts.dpo.loss import sequence_log_probs

    out = tokenize_pairs(SHARED_BOUNDARY, [0, 1], tokenizer, max_length=64, max_prompt_length=64,
                         truncation_mode="keep_start")
    assert out["shared"] == [True, True]
    for row, (chosen, rejected) in enumerate(zip(SHARED_BOUNDARY["chosen"], SHARED_BOUNDARY["rejected"])):
        for answer, text in (("chosen", chosen), ("rejected", rejected)):
            scored = [label for label in out[f"{answer}_labels"][row] if label != -100]
            assert tokenizer.decode(scored) == f" {text}<|endoftext|>"
    batch = PairCollator(tokenizer.pad_token_id)([{key: values[row] for key, values in out.items()} for row in (0, 1)])
    torch.manual_seed(0)
    policy = AutoModelForCausalLM.from_config(build_named_config("llama-tiny", tokenizer))
    with torch.no_grad():
        reference = sequence_log_probs(policy, batch, average=False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    for _ in range(15):
        scores = torch.stack([*sequence_log_probs(policy, batch, average=False).chunk(2), *reference.chunk(2)], dim=1)
        sums = pair_sums(scores, beta=0.1, loss_type="sigmoid", label_smoothing=0.0)
        optimizer.zero_grad()
        sums["loss"].mean().backward()
        optimizer.step()
    assert sums["accuracies"].tolist() == [1.0, 1.0] and sums["loss"].max() < 0.6 < math.log(2), sums


@pytest.mark.quick
@pytest.mark.parametrize(("example", "message"), [
    ({"prompt": "q", "chosen": None, "rejected": "b"}, "train row 7: no 'chosen' answer; every pair needs both"),
    ({"prompt": "q", "chosen": "a", "rejected": ""}, "train row 7: no 'rejected' answer; every pair needs both"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "train row 7: the chosen answer is the rejected one"),
    ({"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "bot", "content": "a"}], "rejected": "b"},
     "train row 7: message 0 of 'chosen' has role 'bot'"),
    ({"prompt": "q", "chosen": [{"role": "assistant", "content": "a"}], "rejected": "b"},
     "train row 7: a plain-text prompt needs a plain-text 'chosen'"),
])
def test_a_bad_pair_is_named_with_its_row(example, message) -> None:
    with pytest.raises(DataError, match=message):
        check_pair(example, "train row 7")


@pytest.mark.quick
def test_the_embedded_pairs_are_the_same_everywhere_and_their_requests_held_out() -> None:
    splits = default_dpo_splits()
    assert splits == default_dpo_splits() and len(splits["train"]) == 2000 and len(splits["validation"]) == 200
    assert all(pair["chosen"] != pair["rejected"] for split in splits.values() for pair in split)
    seen = {pair["prompt"][-1]["content"] for pair in splits["train"]}
    assert not seen & {pair["prompt"][-1]["content"] for pair in splits["validation"]}


@pytest.mark.quick
@pytest.mark.parametrize(("args", "env", "message"), [
    (["--beta", "0"], {}, "--beta must be > 0, got 0.0"),
    (["--loss_type", "ipo", "--label_smoothing", "0.1"], {}, "--label_smoothing smooths the sigmoid loss; drop it or --loss_type ipo"),
    (["--label_smoothing", "0.5"], {}, "--label_smoothing must be in [0, 0.5), got 0.5"),
    (["--max_prompt_length", "0"], {}, "--max_prompt_length must be at least 1, got 0"),
    (["--model_name_or_path", ""], {}, "--task dpo tunes a trained model against itself: give --model_name_or_path"),
    pytest.param(["--device_map", "auto"], {}, "--task dpo with --device_map is not supported",
                 marks=pytest.mark.parts("layer_split")),
], ids=["beta", "smoothing ipo", "smoothing 0.5", "prompt length", "no model", "layers split"])
def test_dpo_flags_that_cannot_run_are_one_line(args, env, message, monkeypatch, tmp_path) -> None:
    base = ["--task", "dpo", "--model_name_or_path", str(TOKENIZER), "--output_dir", str(tmp_path)]
    assert message in flag_refusal([*base, *args], env, monkeypatch)


@pytest.mark.quick
def test_dpo_trains_at_its_own_learning_rate_unless_one_is_given(tmp_path) -> None:
    base = ["--task", "dpo", "--reference_free", "--output_dir", str(tmp_path)]
    assert parse_args(base)[2].learning_rate == 5e-5
    assert parse_args([*base, "--learning_rate", "2e-6"])[2].learning_rate == 2e-6
    assert parse_args(["--output_dir", str(tmp_path)])[2].learning_rate == 1e-3  # the other tasks keep the core's


def test_a_damaged_preference_file_stops_in_one_line_with_its_row(tmp_path) -> None:
    """A real run: exit 2, one error line, nothing trained."""
    data = tmp_path / "pairs.jsonl"
    rows = [{"prompt": "Say yes:", "chosen": " yes", "rejected": " no"}] * 5 + [{"prompt": "Say yes:", "chosen": " yes"}]
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    result = subprocess.run([sys.executable, "train.py", *TINY_RUN, "--task", "dpo", "--reference_free",
                             "--train_file", str(data), "--output_dir", str(tmp_path / "run")],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {data} row 6: no 'rejected' answer; every pair needs both"], result.stderr[-3000:]
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.quick
@pytest.mark.parametrize("missing", ["rejected", "prompt"])
def test_a_validation_file_without_a_column_is_named_before_the_files_are_joined(tmp_path, missing) -> None:
    """It was a `datasets` cast error (the two files' columns are cast to one schema before any check)."""
    from parts.dpo.task import DirectPreference

    pair = {"prompt": "Say yes:", "chosen": " yes", "rejected": " no"}
    train_file, validation_file = tmp_path / "train.jsonl", tmp_path / "validation.jsonl"
    train_file.write_text(json.dumps(pair) + "\n")
    validation_file.write_text(json.dumps({key: value for key, value in pair.items() if key != missing}) + "\n")
    model_args, data_args, _ = parse_args(["--task", "dpo", "--reference_free", "--train_file", str(train_file),
                                           "--validation_file", str(validation_file), "--output_dir", str(tmp_path)])
    with pytest.raises(DataError) as refused:
        DirectPreference(model_args, data_args).load_raw_datasets(seed=0)
    assert str(refused.value) == (f"{validation_file} has no {missing!r} column (columns: "
                                  f"{[key for key in pair if key != missing]}); DPO reads TRL's prompt, chosen and rejected")


@pytest.mark.quick
def test_truncation_mode_keeps_the_start_or_the_end_of_a_long_pair_or_drops_it(tokenizer) -> None:
    """TRL's --truncation_mode: keep_start (TRL 1.x's default), keep_end (TRL 0.24's), and SFT's drop."""
    answer = " yes" * 20
    batch = {"prompt": ["Say it:"], "chosen": [answer], "rejected": [" no" * 20]}
    whole = tokenize_pairs(batch, [0], tokenizer, 1000, 64, "keep_start")["chosen_input_ids"][0]
    for mode, expected in (("keep_start", whole[:16]), ("keep_end", whole[-16:]), ("drop", None)):
        out = tokenize_pairs(batch, [0], tokenizer, 16, 64, mode)
        assert (out["chosen_input_ids"] or [None])[0] == expected, mode
        assert out["truncated"] == ([] if mode == "drop" else [True])


def dpo_args(config: str, base_model, *extra: str) -> tuple[str, ...]:
    """A global batch of 4 pairs (one process: 2 micro-batches of 2), 6 steps, a checkpoint at step 3."""
    return ("--task", "dpo", "--model_name_or_path", str(base_model), "--max_steps", str(STEPS), "--logging_steps", "1",
            "--eval_steps", str(STEPS), "--save_steps", str(RESUME_STEP), "--per_device_train_batch_size", "2",
            "--gradient_accumulation_steps", "2" if config == "single" else "1", "--max_eval_samples", "16",
            "--eval_generation_samples", "2", *extra)


LORA = ("--use_peft", "--learning_rate", "1e-2")


@pytest.fixture(scope="module")
def tuned(cached_run, base_model):
    """`tuned(config, lora)`: the DPO run of one config, trained once per test run."""
    return lambda config, lora=False: cached_run(config, *dpo_args(config, base_model, *(LORA if lora else ())))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("config", TUNED_CONFIGS)
def test_every_config_file_tunes_what_one_process_tunes(config, lora, tuned) -> None:
    """Per-step losses, lr, the pairs' rewards and the evaluation equal one process's; the reference is the starting
    model (the first step's loss is log 2), and with an adapter it is the policy with its adapter off."""
    reference, run = tuned("single", lora), tuned(config, lora)
    figures = ("loss", "lr", "eval_loss", "eval_exact_match", *FIGURES, *(f"eval_{name}" for name in FIGURES))
    differences = compare(reference, run, keys=figures)
    assert len(differences) == STEPS * 8 + 2 * 8  # every step's 8 figures, and the 8 of evaluation at start and end
    worst = worst_difference(differences)
    assert worst.absolute <= LOSS_TOLERANCE, worst
    logged = read_metrics(run)
    assert logged[1]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at the first step
    assert logged[0]["eval_rewards/accuracies"] == 0.0  # nothing moved yet: no reward is above another
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_rewards/margins"] == logged[-1]["eval_rewards/margins"] != 0  # the policy moved off the reference
    launch_log = (run / "launch.log").read_text()
    assert ("the policy with its adapter off" if lora else "frozen, placed as") in launch_log


def test_a_run_resumed_from_a_mid_run_checkpoint_continues_exactly(tuned, cached_run, base_model, tmp_path) -> None:
    """From the ddp run's step-3 checkpoint under ZeRO-3: the same losses, rewards and final weights."""
    uninterrupted = tuned("ddp")
    resumed = train("deepspeed_zero3", tmp_path / "resumed", *dpo_args("ddp", base_model), "--resume_from_checkpoint",
                    str(uninterrupted / "checkpoints" / f"step_{RESUME_STEP}"))
    assert resumed.returncode == 0
    assert_continues_exactly(uninterrupted, tmp_path / "resumed", RESUME_STEP, STEPS)
    expected, actual = ({m["step"]: m["rewards/accuracies"] for m in read_metrics(r) if "rewards/accuracies" in m}
                        for r in (uninterrupted, tmp_path / "resumed"))
    assert all(actual[step] == pytest.approx(expected[step], abs=1e-6) for step in range(RESUME_STEP + 1, STEPS + 1))


def test_a_resume_against_another_reference_is_refused_in_one_line(tuned, base_model, tmp_path) -> None:
    """Resumed with another --model_name_or_path of the same config, DPO continued against another reference, with no
    line (issue 69): the checkpoint records its reference (reference_model.json), and another one is refused."""
    checkpoint = tuned("ddp") / "checkpoints" / f"step_{RESUME_STEP}"
    recorded = json.loads((checkpoint / "reference_model.json").read_text())
    assert recorded["source"] == str(base_model) and len(recorded["weights"]) == 64
    other = nudged_copy(base_model, tmp_path / "other")
    result = launch("ddp", "train.py", *TINY_RUN, "--output_dir", str(tmp_path / "out"),
                    *dpo_args("ddp", other), "--resume_from_checkpoint", str(checkpoint))
    errors = bad_input_errors(result)
    assert errors == [f"error: {checkpoint} was trained against another reference model {base_model} -> {other} (its "
                      f"weights differ); resume with --model_name_or_path {base_model}, or name the change on purpose: "
                      "--allow_config_changes reference_model"], errors


def test_precomputed_reference_scores_train_what_the_live_reference_trains_and_resume_with_them(
        tuned, cached_run, base_model, tmp_path) -> None:
    """--precompute_ref_log_probs under ZeRO-3 (the reference a sharded engine for one pass, then freed) logs what
    one process with the live reference logs; its checkpoint keeps the scores, and a resume under another strategy
    continues exactly from them without loading the reference again."""
    precompute = dpo_args("deepspeed_zero3", base_model, "--precompute_ref_log_probs")
    live, precomputed = tuned("single"), cached_run("deepspeed_zero3", *precompute)
    figures = ("loss", "eval_loss", *FIGURES, *(f"eval_{name}" for name in FIGURES))
    # At step 0 the policy is the reference: its rewards are 0 up to the rounding of another batch shape (1e-8),
    # and a share of rewards above others is that rounding's; from step 1 on it is the policy's.
    differences = [d for d in compare(live, precomputed, keys=figures) if (d.key, d.step) != ("eval_rewards/accuracies", 0)]
    worst = worst_difference(differences)
    assert len(differences) == STEPS * 7 + 2 * 7 - 1 and worst.absolute <= LOSS_TOLERANCE, worst
    assert "2,200 pairs scored once, then freed" in (precomputed / "launch.log").read_text()
    checkpoint = precomputed / "checkpoints" / f"step_{RESUME_STEP}"
    assert (checkpoint / TABLE_FILE).exists()
    resumed = train("ddp", tmp_path / "resumed", *precompute, "--resume_from_checkpoint", str(checkpoint))
    assert "DPO reference:" not in resumed.stderr  # the scores came from the checkpoint
    assert_continues_exactly(precomputed, tmp_path / "resumed", RESUME_STEP, STEPS)


def test_three_processes_with_precomputed_scores_tune_what_one_process_tunes(cached_run, base_model, shared_dir) -> None:
    """fsdp.yaml on 3 processes (uneven shards of the reference and the policy; 2,200 pairs scored in three shares,
    the last padded) against one process accumulating 3 micro-batches of 2, with the live reference."""
    three = with_processes("fsdp", 3, shared_dir / "configs")
    run = cached_run(three, *dpo_args("fsdp", base_model, "--precompute_ref_log_probs"))
    # the global batch of 6 pairs in one process (the last flag given wins)
    alone = cached_run("single", *dpo_args("single", base_model, "--gradient_accumulation_steps", "3"))
    differences = compare(alone, run, keys=("loss", "lr", "eval_loss", *FIGURES))
    assert len(differences) == STEPS * 8 + 2 and worst_difference(differences).absolute <= LOSS_TOLERANCE
    assert "2,200 pairs scored once, then freed" in (run / "launch.log").read_text()
