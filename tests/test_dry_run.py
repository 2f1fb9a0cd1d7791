"""`--dry_run` prints the plan of a launch from one process and trains nothing, and the mistakes
a run would stop on are its one `error:` line and exit 2 (training/dry_run.py); `--help` is
answered before torch loads."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from data import DataError
from models.configs import build_named_config
from models.language import SHIPPED_TOKENIZER, ModelError
from tests.harness import REPO, TINY_RUN, bad_input_errors, launch
from training.arguments import ArgumentError, parse_args
from training.dry_run import dry_run as plan_dry_run
from training.errors import StrategyError
from training.parts import installed
from training.task_registry import tasks

pytestmark = pytest.mark.forked  # launches fork from a process that imported them (tests/harness.py)

MIB = 2**20


def test_dry_run_of_a_two_process_offload_launch_prints_its_plan_and_trains_nothing(tmp_path, strategy_run) -> None:
    output_dir = tmp_path / "run"
    result = launch("deepspeed_zero3_offload", "train.py", *TINY_RUN, "--output_dir", str(output_dir), "--dry_run",
                    "--gradient_accumulation_steps", "3", "--max_steps", "5", "--block_size", "64", timeout=180)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout.count("===== dry run: checked, nothing trained =====") == 1  # rank 0 alone
    plan = dict(line.split(":", 1) for line in result.stdout.split("=====\n", 2)[-1].strip().splitlines())
    assert plan["launch"].strip() == "deepspeed ZeRO-3 offload=cpu, 2 process(es), 2 data-parallel, mixed precision no"
    assert plan["global batch"].strip() == "24 = 4 per device x 2 data-parallel x 3 accumulation"
    assert plan["steps"].strip().startswith("5 (")
    assert "--optim adamw_torch_fused (DeepSpeedCPUAdam)" in plan["steps"]
    assert "sequences of up to 64 tokens" in plan["data"]
    parameters = int(plan["model"].split(", ")[1].split(" parameters")[0].replace(",", ""))
    # against what a real run of the same model and config held, counted from its tensors (test_memory_plan's 10%)
    measured = json.loads((strategy_run("deepspeed_zero3_offload") / "summary.json").read_text())
    assert measured["parameters"] == parameters and measured["processes"] == 2
    if installed("memory_plan"):  # its line, planned for this launch
        planned = float(plan["memory/rank"].split("model state ")[1].split(" MiB")[0].replace(",", ""))
        assert planned == pytest.approx(sum(measured["model_state_bytes_per_rank"].values()) / MIB, rel=0.10)
        assert "activations ~" in plan["memory/rank"] and "(estimates)" in plan["memory/rank"]
    assert "training:" not in result.stderr and "step 1" not in result.stdout  # nothing trained
    assert not [p.name for p in output_dir.iterdir()]  # no checkpoints, metrics or final model


@pytest.mark.parts("sft", "lora", "memory_plan")
def test_dry_run_of_a_lora_fine_tuning_plans_state_for_the_adapter_alone(tmp_path) -> None:
    """--task sft --use_peft: the chat data, and model state with gradients and optimizer state for the adapter only."""
    printed = planned(tmp_path, "--task", "sft", "--model_name_or_path", _files(tmp_path)["{base}"], "--use_peft",
                      "--chat_template", "models/tokenizer/chat_template.jinja")
    plan = dict(line.split(":", 1) for line in printed.split("=====\n", 2)[-1].strip().splitlines())
    assert "messages examples (loss on answers only;" in plan["data"]
    parameters, trained = (int(part.split()[0].replace(",", "")) for part in plan["model"].split(", ")[1:3])
    assert trained == 39_424 < parameters  # rank 16 on every linear layer but the output layer
    total = (4 * parameters + 4 * trained + 8 * trained) / MIB  # fp32: every weight; gradients and AdamW's 2 moments
    assert plan["memory/rank"].strip().startswith(f"model state {total:,.1f} MiB"), plan["memory/rank"]  # of the adapter


def test_the_dry_run_prints_the_shape_the_overrides_give(tmp_path) -> None:
    plan = dict(line.split(":", 1) for line in planned(tmp_path, "--config_overrides", "hidden_size=32")
                .split("=====\n", 2)[-1].strip().splitlines())
    assert plan["shape"].strip() == "hidden 32, 2 layers, 4 heads of 8 (derived again), MLP 96 (derived again), vocabulary 960"
    # embeddings and output layer 2 x 960 x 32; per layer attention 4 x 32 x 32, MLP 3 x 32 x 96, norms 2 x 32; a norm
    assert plan["model"].strip().startswith(f"llama-tiny, {2 * 960 * 32 + 2 * (4 * 32 * 32 + 3 * 32 * 96 + 64) + 32:,} "
                                            "parameters (LlamaForCausalLM)")


def planned(tmp_path, *args: str) -> str:
    """The plan `train.py --dry_run` prints, from the dry run's own function in this process (as train.py prints
    it, from a 2-process launch: the first test)."""
    return plan_dry_run(*parse_args([*TINY_RUN, "--output_dir", str(tmp_path / "run"), "--dry_run", *args]))


def dry_run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """`accelerate launch --config_file accelerate_configs/ddp.yaml train.py --dry_run`, as the README runs it."""
    return launch("ddp", "train.py", *TINY_RUN, "--output_dir", str(tmp_path / "run"), "--dry_run", *args, timeout=180)


def _files(tmp_path) -> dict[str, str]:
    def lines(record: dict) -> str:
        return 40 * (json.dumps(record) + "\n")

    hello = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    files = {
        "chat.jsonl": lines({"text": [{"role": "user", "content": "hi"}]}),
        "one.txt": "a single document\n",
        "clipping.json": json.dumps(json.loads((REPO / "ds_configs" / "zero2.json").read_text()) | {"gradient_clipping": 1.0}),
        "no-content.jsonl": lines({"messages": [{"role": "user", "content": ""}, hello[1]]}),
        "question-answer.jsonl": lines({"question": "q", "answer": "a"}),
        "hello.jsonl": lines({"messages": hello}),
        "bad-role.jsonl": lines({"messages": [hello[0], {"role": "bot", "content": "hello"}]}),
        "not-jinja.jinja": "{% for message in messages %}{{ message['content'] }",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    base = tmp_path / "base"  # a model whose tokenizer has no chat template
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)
    AutoModelForCausalLM.from_config(build_named_config("llama-tiny", tokenizer)).save_pretrained(base)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    other = tmp_path / "other-vocabulary"  # a teacher whose tokenizer has one token more
    AutoModelForCausalLM.from_config(build_named_config("llama-tiny", tokenizer)).save_pretrained(other)
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(other)
    custom = tmp_path / "custom-code-model"  # a model that needs its own code, which would end the process
    shutil.copytree(base, custom)
    config = json.loads((custom / "config.json").read_text())
    config |= {"model_type": "my_lm", "auto_map": {"AutoConfig": "my_lm.MyConfig", "AutoModelForCausalLM": "my_lm.MyLM"}}
    (custom / "config.json").write_text(json.dumps(config))
    (custom / "my_lm.py").write_text("raise SystemExit('remote code ran')\n")
    return {f"{{{name}}}": str(tmp_path / name) for name in [*files, "base", "other-vocabulary", "custom-code-model"]}


# End to end, a launch with `--dry_run`: case -> (train.py flags, what the one error line says)
MISTAKES = {
    "optimizer name (argparse's choices)": (["--optim", "adamw"], "argument --optim: invalid choice: 'adamw' (choose from"),
    "a chat message with an unknown role": pytest.param(["--task", "sft", "--train_file", "{bad-role.jsonl}"],
                                                        "message 1 of 'messages' has role 'bot'", marks=pytest.mark.parts("sft")),
    "a teacher that does not load": pytest.param(["--teacher_model_name_or_path", "{one.txt}"], "cannot load teacher",
                                                 marks=pytest.mark.parts("distillation")),
    "a teacher with another vocabulary": pytest.param(
        ["--teacher_model_name_or_path", "{other-vocabulary}"],
        "has another vocabulary than the student's tokenizer (920 vs 919 tokens; e.g. '<extra>' differs)",
        marks=pytest.mark.parts("distillation")),
    "--distillation_alpha outside [0, 1]": pytest.param(
        ["--teacher_model_name_or_path", "{base}", "--distillation_alpha", "1.5"], "it must be in [0, 1], got 1.5",
        marks=pytest.mark.parts("distillation")),
}
# More of each stage, in-process through the dry run's own function (tests/test_bad_input.py launches one case of
# each stage): case -> (train.py flags, launcher environment, what the one error line says)
STAGE_MISTAKES = {
    "scheduler name": (["--lr_scheduler_type", "cosin"], {}, "--lr_scheduler_type 'cosin' is not a transformers scheduler"),
    "DeepSpeed JSON against a flag": (
        ["--max_grad_norm", "0.5"], {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": "{clipping.json}"},
        "gradient_clipping is 1.0 in the DeepSpeed JSON but --max_grad_norm is 0.5",
    ),
    "chat data in the text column": pytest.param(["--train_file", "{chat.jsonl}"], {}, "this is chat data; fine-tune on it with --task sft",
                                                 marks=pytest.mark.parts("sft")),
    "too little data to hold out a validation split": (
        ["--train_file", "{one.txt}"], {}, "1 training examples cannot give up --validation_split_percentage 5"
    ),
    "block size above the model's maximum": (["--block_size", "4096"], {}, "--block_size 4096 exceeds the model's maximum of"),
    "model with custom code, no --trust_remote_code": (  # its code would end the test: SystemExit is not caught below
        ["--model_name_or_path", "{custom-code-model}"], {}, "pass --trust_remote_code only if you trust"),
    # the parts' (deselected in a project without them: tests/conftest.py)
    "a chat message with no content": pytest.param(["--task", "sft", "--train_file", "{no-content.jsonl}"], {},
                                                   "message 0 of 'messages' (user) has no text content",
                                                   marks=pytest.mark.parts("sft")),
    "data with none of text, messages, or prompt and completion": pytest.param(
        ["--task", "sft", "--train_file", "{question-answer.jsonl}"], {},
        "none of the columns text, messages, or prompt and completion", marks=pytest.mark.parts("sft")),
    "a chat template that is not Jinja": pytest.param(["--task", "sft", "--chat_template", "{not-jinja.jinja}"], {},
                                                      "is not a valid Jinja chat template", marks=pytest.mark.parts("sft")),
    "a tokenizer without a chat template": pytest.param(
        ["--task", "sft", "--model_name_or_path", "{base}", "--train_file", "{hello.jsonl}"], {},
        "give one with --chat_template PATH", marks=pytest.mark.parts("sft")),
    "--lora_target_modules that match nothing": pytest.param(
        ["--task", "sft", "--model_name_or_path", "{base}", "--chat_template", "models/tokenizer/chat_template.jinja",
         "--use_peft", "--lora_target_modules", "qkv"], {},
        "matches no module of LlamaForCausalLM; its linear modules are: down_proj gate_proj k_proj lm_head o_proj",
        marks=pytest.mark.parts("sft", "lora")),
}
BAD_INPUT = (ArgumentError, DataError, ModelError, StrategyError)  # what train.py turns into one line and exit 2


@pytest.mark.parametrize(("args", "env", "message"), STAGE_MISTAKES.values(), ids=STAGE_MISTAKES.keys())
def test_each_stage_refuses_what_cannot_train_in_one_line(tmp_path, monkeypatch, args, env, message) -> None:
    """The flags, then the dry run's stages: launch checks, task (template), model (adapter), data."""
    files = _files(tmp_path)
    for name, value in env.items():
        monkeypatch.setenv(name, files.get(value, value))
    with pytest.raises(BAD_INPUT, match=re.escape(message)) as refused:
        plan_dry_run(*parse_args([*TINY_RUN, "--output_dir", str(tmp_path / "run"), *(files.get(a, a) for a in args)]))
    assert "\n" not in str(refused.value)


@pytest.mark.quick
@pytest.mark.parametrize("clipping", [1.0, "auto", None])
def test_the_deepspeed_clipping_is_read_from_accelerates_own_parse_of_the_json(tmp_path, monkeypatch, clipping) -> None:
    """What a run aligns is the config accelerate parsed from the launcher's environment (its DeepSpeedPlugin, as
    the Accelerator builds it): a number that disagrees with --max_grad_norm is refused there too, and "auto" or no
    entry becomes the flag's value (accelerate would write 1.0)."""
    from accelerate.utils import DeepSpeedPlugin

    from training.strategy.adapters import align_deepspeed_config

    json_config = json.loads((REPO / "ds_configs" / "zero2.json").read_text())
    json_config.pop("gradient_clipping", None)
    (tmp_path / "ds.json").write_text(json.dumps(json_config | ({} if clipping is None else {"gradient_clipping": clipping})))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(tmp_path / "ds.json"))
    parsed = DeepSpeedPlugin().deepspeed_config
    if clipping == 1.0:
        with pytest.raises(StrategyError, match=re.escape("gradient_clipping is 1.0 in the DeepSpeed JSON but "
                                                          "--max_grad_norm is 0.5; set \"gradient_clipping\": \"auto\"")):
            align_deepspeed_config(parsed, max_grad_norm=0.5, per_device_batch=4)
    else:
        align_deepspeed_config(parsed, max_grad_norm=0.5, per_device_batch=4)
        assert (parsed["gradient_clipping"], parsed["train_micro_batch_size_per_gpu"]) == (0.5, 4)


@pytest.mark.parametrize(("args", "message"), MISTAKES.values(), ids=MISTAKES.keys())
def test_a_mistake_is_one_error_line_and_exit_2(tmp_path, args, message) -> None:
    files = _files(tmp_path)
    errors = bad_input_errors(dry_run(tmp_path, *(files.get(arg, arg) for arg in args)))
    assert len(errors) == 1 and message in errors[0], errors
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())  # nothing written


def test_a_gpu_plan_made_on_a_machine_without_gpus_is_a_plan_with_a_note(tmp_path, monkeypatch) -> None:
    """fp16 needs a GPU: planned on a login node, the dry run plans it and notes what a CPU machine would refuse."""
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    printed = planned(tmp_path)
    assert "mixed precision fp16" in printed
    assert "no GPU here; on CPU machines the run would stop: fp16 mixed precision needs a GPU" in printed


@pytest.mark.quick
def test_help_lists_every_flag_before_torch_loads() -> None:
    probe = ("import atexit, runpy, sys; sys.argv = ['train.py', '--max_steps', '3', '--help']; "
             "atexit.register(lambda: print('torch loaded:', 'torch' in sys.modules)); "
             "runpy.run_path('train.py', run_name='__main__')")
    result = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("torch loaded: False")
    configs = sorted({name for entry in tasks().values() for name in entry.configs})  # every task's, the parts' too
    assert {"llama-125m", "llama-small", "llama-tiny"} <= set(configs)
    for flag in ("--optim {adamw_torch_fused,adamw_torch,sgd,adafactor}", "--lr_scheduler_type", "--dry_run",
                 "--config CONFIG", f"--model_config {{{','.join(configs)}}}"):
        assert flag in result.stdout
