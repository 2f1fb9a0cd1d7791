"""Which config to launch: memory per GPU under every file in accelerate_configs/, and a pick.

    python scripts/plan_memory.py --model_config llama-125m --num_gpus 8 --gpu_memory_gb 80
    python scripts/plan_memory.py --model_name_or_path Qwen/Qwen2.5-7B --num_gpus 16 --gpu_memory_gb 80 \\
        --per_device_train_batch_size 4 --block_size 2048 --gradient_checkpointing

For each config: parameters, gradients and optimizer state per GPU (exact for the layouts in
training/memory_plan.py, and checked against measured runs), activations and working buffers
(estimates), what offload keeps in CPU memory, and whether it fits with 10% of the GPU kept
free (CUDA context, allocator fragmentation, what the estimates miss). The pick is the first
that fits in the order DDP, ZeRO-1, ZeRO-2, FSDP2, ZeRO-3, ZeRO-3 with offload: the fastest
that fits. Exit 1 if none fits, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from transformers import AutoConfig  # noqa: E402

from models.configs import NAMED_CONFIGS, build_named_config  # noqa: E402
from models.language import ModelError, build_tokenizer, loading, resolve_block_size  # noqa: E402
from parts.memory_plan.planner import (  # noqa: E402
    PREFERENCE,
    PlanError,
    activation_bytes,
    model_shape,
    model_state,
    pick,
    read_layout,
    working_bytes,
)
from training.performance import compute_dtype  # noqa: E402

RESERVE = 0.10  # of each GPU's memory, kept free
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model_name_or_path", help="Hub id or local directory of a causal LM (its config is enough).")
    parser.add_argument("--model_config", default="llama-small", choices=sorted(NAMED_CONFIGS),
                        help="Named config, when --model_name_or_path is not given.")
    parser.add_argument("--trust_remote_code", action="store_true", help="Allow the model's own config code.")
    parser.add_argument("--num_gpus", type=int, default=8, help="GPUs in the job, on all nodes together.")
    parser.add_argument("--gpu_memory_gb", type=float, default=80.0, help="Memory of one GPU, GiB.")
    parser.add_argument("--per_device_train_batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, help="Tokens per sequence. Default: the model's maximum, at most 1024.")
    parser.add_argument("--mixed_precision", default="bf16", choices=["bf16", "fp16", "no"])
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--use_peft", action="store_true", help="A LoRA adapter on the frozen model (train.py's flags).")
    parser.add_argument("--lora_r", type=int, default=16)
    parser.add_argument("--lora_target_modules", nargs="+", default=["all-linear"])
    parser.add_argument("--configs_dir", type=Path, default=REPO / "accelerate_configs")
    parser.add_argument("--json", type=Path, help="Also write every figure to this JSON file.")
    args = parser.parse_args(argv)
    if args.num_gpus < 1 or args.gpu_memory_gb <= 0 or args.per_device_train_batch_size < 1:
        parser.error("--num_gpus, --gpu_memory_gb and --per_device_train_batch_size must be positive")
    return args


def load_config(args: argparse.Namespace):
    """The model's config: from the Hub or a directory, or a named config with the shipped tokenizer."""
    if args.model_name_or_path:
        with loading("model config", args.model_name_or_path):
            return AutoConfig.from_pretrained(args.model_name_or_path, trust_remote_code=args.trust_remote_code)
    return build_named_config(args.model_config, build_tokenizer(None, None))


def adapter_config(args: argparse.Namespace):
    """--use_peft: the LoRA part's `LoraConfig` for --lora_r and --lora_target_modules (train.py's other defaults)."""
    try:
        from parts.lora import LoraFlags
        from parts.lora.adapters import lora_config
    except ModuleNotFoundError:
        raise SystemExit("error: --use_peft plans a LoRA adapter, and this project has no parts/lora") from None
    return lora_config(LoraFlags(use_peft=True, lora_r=args.lora_r, lora_target_modules=args.lora_target_modules))


def plan(args: argparse.Namespace) -> dict:
    """Every config's figures (bytes) and the recommended config."""
    config = load_config(args)
    dtype = compute_dtype(args.mixed_precision)
    adapter = adapter_config(args) if args.use_peft else None
    shape = model_shape(config, dtype, args.trust_remote_code, adapter)
    block_size = resolve_block_size(args.block_size, config)  # as train.py chooses it
    compute_bytes = dtype.itemsize
    activations = activation_bytes(shape, args.per_device_train_batch_size, block_size, args.gradient_checkpointing)
    usable = args.gpu_memory_gb * GIB * (1 - RESERVE)
    paths = sorted(args.configs_dir.glob("*.yaml"))
    if not paths:
        raise PlanError(f"no accelerate configs (*.yaml) in {args.configs_dir}")
    layouts = sorted((read_layout(path) for path in paths), key=lambda layout: PREFERENCE.index(layout.strategy))
    rows = {}
    for layout in layouts:
        processes = 1 if layout.strategy == "single" else args.num_gpus
        state = model_state(layout, shape.parameters, processes, compute_bytes, shape.trainable)
        working = working_bytes(layout, shape, compute_bytes)
        runs = layout.runs_on(processes)
        gpu = state["parameters"] + state["gradients"] + state["optimizer"] - state["offloaded"] + activations + working
        rows[layout.config] = state | {
            "strategy": layout.strategy, "processes": processes, "activations": activations,
            "working": working, "gpu_total": gpu, "fits": gpu <= usable and runs,
            "runs": runs, "tp_size": layout.tp_size,
        }
    recommended = pick(rows, args.num_gpus, usable)
    return {"model": args.model_name_or_path or args.model_config, "parameters": shape.parameters,
            "trainable_parameters": shape.trainable,
            "num_gpus": args.num_gpus, "gpu_memory_gb": args.gpu_memory_gb, "usable_gb": usable / GIB,
            "per_device_train_batch_size": args.per_device_train_batch_size, "block_size": block_size,
            "mixed_precision": args.mixed_precision, "gradient_checkpointing": args.gradient_checkpointing,
            "configs": rows, "recommended": recommended}


def report(result: dict, args: argparse.Namespace) -> str:
    gib = lambda value: f"{value / GIB:,.2f}"  # noqa: E731
    lines = [
        f"{result['model']}: {result['parameters'] / 1e6:,.1f}M parameters"
        + (f" ({result['trainable_parameters'] / 1e6:,.2f}M of them trained: LoRA)"
           if result["trainable_parameters"] < result["parameters"] else "")
        + f", {result['mixed_precision']}, "
        f"{result['per_device_train_batch_size']} x {result['block_size']} tokens per GPU per micro-step"
        f"{', gradient checkpointing' if result['gradient_checkpointing'] else ''}; "
        f"{result['num_gpus']} GPUs of {result['gpu_memory_gb']:g} GiB ({result['usable_gb']:.1f} usable)",
        "",
        "| config | processes | parameters | gradients | optimizer | activations (est.) | working (est.) "
        "| GPU total | in CPU memory | fits |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for name, row in result["configs"].items():
        lines.append(
            f"| {name} | {row['processes']} | {gib(row['parameters'])} | {gib(row['gradients'])} | "
            f"{gib(row['optimizer'])} | {gib(row['activations'])} | {gib(row['working'])} | "
            f"**{gib(row['gpu_total'])}** | {gib(row['offloaded'])} | "
            f"{'yes' if row['fits'] else 'no' if row['runs'] else 'no: needs 2 x tp_size GPUs or more'} |"
        )
    lines.append("(GiB per GPU; the model state columns count each value wherever it lives, GPU or CPU)")
    chosen = result["recommended"]
    if chosen is None:
        hint = "" if args.gradient_checkpointing else "add --gradient_checkpointing, "
        lines += ["", f"nothing fits: {hint}lower --per_device_train_batch_size (raise --gradient_accumulation_steps "
                      "to keep the global batch), or use more GPUs"]
        return "\n".join(lines)
    flags = (["--model_name_or_path", args.model_name_or_path] if args.model_name_or_path
             else ["--model_config", args.model_config])
    flags += ["--per_device_train_batch_size", str(result["per_device_train_batch_size"]),
              "--block_size", str(result["block_size"])]
    flags += ["--gradient_checkpointing", "true"] if args.gradient_checkpointing else []
    launcher = [] if result["configs"][chosen]["strategy"] == "single" else ["--num_processes", str(result["num_gpus"])]
    if result["configs"][chosen]["strategy"] == "fsdp_tp":  # the yaml's grid is for 4 processes
        launcher += ["--parallelism_config_dp_shard_size", str(result["num_gpus"] // result["configs"][chosen]["tp_size"])]
    precision = [] if args.mixed_precision == "no" else ["--mixed_precision", args.mixed_precision]
    lines += ["", f"recommended: accelerate_configs/{chosen}.yaml ({gib(result['configs'][chosen]['gpu_total'])} of "
                  f"{result['usable_gb']:.1f} usable GiB per GPU)",
              "  " + " ".join(["accelerate launch --config_file", f"accelerate_configs/{chosen}.yaml", *launcher,
                               *precision, "train.py", *flags]),
              "  (on several nodes, add --num_machines and the machine flags: docs/multi-node.md)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        result = plan(args)
    except (PlanError, ModelError) as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
    print(report(result, args))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if result["recommended"] is None:
        sys.exit(1)


if __name__ == "__main__":
    main()
