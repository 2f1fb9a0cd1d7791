"""Memory per GPU under each config in `accelerate_configs/`, before anything is launched.

Model state, per rank, as each strategy really lays it out with train.py's torch AdamW
(Ψ parameters, N processes, c bytes per value in the compute dtype: 2 for bf16, 4 for fp32):

| strategy      | parameters       | gradients        | optimizer state (Adam m, v; masters) |
|---------------|------------------|------------------|--------------------------------------|
| single, DDP   | 4Ψ               | 4Ψ               | 8Ψ                                   |
| FSDP2 (x TP)  | 4Ψ/N             | 4Ψ/N             | 8Ψ/N                                 |
| ZeRO-1, -2    | cΨ               | cΨ/N + 4Ψ/N      | 4Ψ/N + 8Ψ/N                          |
| ZeRO-3        | cΨ/N             | cΨ/N + 4Ψ/N      | 4Ψ/N + 8Ψ/N                          |

With an adapter (`--use_peft`) only its T parameters train: gradients and optimizer state are
those of T, not Ψ (ZeRO-1/2 then keep the fp32 gradient partition alone, 4T/N, as measured),
while the frozen weights stay as above.

- accelerate's mixed precision autocasts, so DDP and FSDP2 keep fp32 weights and gradients
  (FSDP2 gathers compute-dtype copies one layer at a time).
- DeepSpeed keeps compute-dtype weights and fp32 master partitions. While it steps, it casts
  its gradient partition to fp32 next to the compute-dtype one (the 4Ψ/N in gradients).
- Parameters that a sharded strategy gathers whole count as working memory, not model state:
  FSDP2's current and next layer, and ZeRO-3's prefetch bucket and its persistent parameters
  (at most `stage3_param_persistence_threshold` elements each), which stay whole on every rank
  between steps.
- FSDP2 x tensor parallelism shards over all N = dp_shard x tp processes, as FSDP2 alone. Its
  activations are counted undivided (an upper bound: tp splits those inside attention and the
  MLP), so the planner recommends it only when nothing else fits, after offload.
- Offload moves the optimizer state and the fp32 gradients (`offload_optimizer`) and the
  parameter partitions (`offload_param`) to CPU memory: the same bytes, counted there.

`scripts/benchmark.py` measures the same quantities from the tensors of real runs; the
tests hold the two within 10%. Activations and working buffers are estimates (see
`activation_bytes` and `working_bytes`). `launch_memory` plans the launch `--dry_run` checks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, PretrainedConfig

from training.loss import token_loss_sums
from training.parts import Plan
from training.performance import parameter_count
from training.strategy import Strategy

MIB = 2**20
# The order to prefer configs in: the first that fits is the fastest that fits.
PREFERENCE = ("single", "ddp", "zero1", "zero2", "fsdp", "zero3", "zero3_offload", "fsdp_tp")
# Default sizes DeepSpeed uses for keys a JSON leaves out (deepspeed/runtime/zero/config.py).
DS_DEFAULT_REDUCE_BUCKET = 500_000_000
DS_DEFAULT_PREFETCH_BUCKET = 50_000_000
DS_DEFAULT_PERSISTENCE = 100_000


class PlanError(ValueError):
    """A config or model the planner cannot read; the message says which and how to fix it."""


@dataclass(frozen=True)
class Layout:
    """How one accelerate config file lays out model state."""

    config: str  # the file's stem, e.g. "deepspeed_zero2"
    strategy: str  # one of PREFERENCE
    sharded_parameters: bool = False
    deepspeed: bool = False
    offload_optimizer: bool = False
    offload_parameters: bool = False
    persistence_threshold: int = 0  # ZeRO-3: parameters this small stay whole on every rank
    reduce_bucket: int = 0  # DeepSpeed gradient reduction bucket, elements
    prefetch_bucket: int = 0  # ZeRO-3 parameter prefetch bucket, elements
    overlap_comm: bool = False
    tp_size: int = 1  # FSDP2 x TP: processes that split each layer

    def runs_on(self, processes: int) -> bool:
        """Whether the config can start on this many processes (2D needs dp_shard >= 2 groups of tp)."""
        return self.tp_size == 1 or (processes % self.tp_size == 0 and processes >= 2 * self.tp_size)


@dataclass
class ModelShape:
    """What memory depends on: every parameter's size, the layers, and an empty model to trace."""

    numels: list[int]
    layers: int  # the model's `_no_split_modules` instances: decoder layers
    layer_parameters: int  # the largest layer (the unit FSDP2 and ZeRO-3 gather)
    root_parameters: int  # outside the layers: embeddings, final norm, output layer (FSDP2's root unit)
    hidden_size: int
    meta_model: torch.nn.Module = field(repr=False)
    trainable: int = 0  # parameters the optimizer steps (all, unless an adapter freezes the rest)

    @property
    def parameters(self) -> int:
        return sum(self.numels)


def read_layout(path: Path) -> Layout:
    """The layout an accelerate config (and the DeepSpeed JSON it names) asks for."""
    try:
        config = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise PlanError(f"accelerate config {path} not found") from None
    except yaml.YAMLError as error:
        raise PlanError(f"accelerate config {path} is not valid YAML: {error}".replace("\n", " ")) from None
    kind = str(config.get("distributed_type", "NO"))
    if kind == "NO":
        return Layout(path.stem, "single")
    if kind in ("MULTI_GPU", "MULTI_CPU"):
        return Layout(path.stem, "ddp")
    if kind == "FSDP":
        offload = bool(config.get("fsdp_config", {}).get("fsdp_offload_params", False))
        tp_size = int((config.get("parallelism_config") or {}).get("parallelism_config_tp_size", 1))
        return fsdp_layout(path.stem, offload, tp_size)
    if kind == "DEEPSPEED":
        return _deepspeed_layout(path, config.get("deepspeed_config", {}))
    raise PlanError(f"{path}: distributed_type {kind} is not one the planner knows (NO, MULTI_GPU, FSDP, DEEPSPEED)")


def fsdp_layout(name: str, offload: bool, tp_size: int) -> Layout:
    """FSDP2's layout: everything sharded; `fsdp_offload_params` moves all of it to CPU memory."""
    return Layout(name, "fsdp_tp" if tp_size > 1 else "fsdp", sharded_parameters=True,
                  offload_optimizer=offload, offload_parameters=offload, tp_size=tp_size)


def _deepspeed_layout(path: Path, accelerate_ds: dict) -> Layout:
    json_path = accelerate_ds.get("deepspeed_config_file")
    if not json_path:  # the settings written inline in the accelerate yaml
        return deepspeed_layout(path.stem, {"zero_optimization": {
            "stage": accelerate_ds.get("zero_stage", 2),
            "offload_optimizer": {"device": accelerate_ds.get("offload_optimizer_device", "none")},
            "offload_param": {"device": accelerate_ds.get("offload_param_device", "none")},
        }})
    # Relative to where you launch, as for accelerate; else to the repository the yaml sits in.
    json_file = next((f for f in (Path(json_path), path.parents[1] / json_path) if f.is_file()), Path(json_path))
    try:
        return deepspeed_layout(path.stem, json.loads(json_file.read_text()))
    except FileNotFoundError:
        raise PlanError(f"{path} names DeepSpeed config {json_path}, which does not exist") from None
    except json.JSONDecodeError as error:
        raise PlanError(f"DeepSpeed config {json_file} is not valid JSON ({error})") from None


def deepspeed_layout(name: str, config: dict) -> Layout:
    """The layout a DeepSpeed config asks for: a JSON's contents, or accelerate's resolved plugin config."""
    zero = config.get("zero_optimization", {})
    offload_optimizer = zero.get("offload_optimizer", {}).get("device", "none") != "none"
    offload_parameters = zero.get("offload_param", {}).get("device", "none") != "none"
    stage = int(zero.get("stage", 0))
    strategy = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3_offload" if offload_optimizer else "zero3"}[stage]
    return Layout(
        name,
        strategy,
        sharded_parameters=stage == 3,
        deepspeed=True,
        offload_optimizer=offload_optimizer,
        offload_parameters=offload_parameters,
        persistence_threshold=_size(zero.get("stage3_param_persistence_threshold"), DS_DEFAULT_PERSISTENCE) if stage == 3 else 0,
        reduce_bucket=_size(zero.get("reduce_bucket_size"), DS_DEFAULT_REDUCE_BUCKET),
        prefetch_bucket=_size(zero.get("stage3_prefetch_bucket_size"), DS_DEFAULT_PREFETCH_BUCKET) if stage == 3 else 0,
        overlap_comm=bool(zero.get("overlap_comm", False)),
    )


def _size(value, default: int) -> int:
    # "auto" sizes are set from the hidden size at prepare time; the defaults are of the same order.
    return default if value in (None, "auto") else int(float(value))


def model_shape(
    config: PretrainedConfig, compute_dtype: torch.dtype, trust_remote_code: bool = False, adapter=None
) -> ModelShape:
    """Build `config`'s model on the meta device (no memory, any architecture) and measure it;
    `adapter`: a peft config (parts/lora/adapters.py) whose adapter is added, the rest frozen."""
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=compute_dtype, trust_remote_code=trust_remote_code)
            if adapter is not None:
                from peft import get_peft_model

                model = get_peft_model(model, adapter)
    except ValueError as error:  # not a causal LM, or its code needs --trust_remote_code
        raise PlanError(f"cannot build a causal LM from this config: {str(error).strip().splitlines()[0]}") from None
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in _layers(model)]
    numels = [p.numel() for p in model.parameters()]  # tied weights once
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return ModelShape(
        numels, len(per_layer), max(per_layer, default=0), sum(numels) - sum(per_layer), config.hidden_size, model,
        trainable,
    )


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The units a sharded strategy wraps: the classes the model names in `_no_split_modules`."""
    names = set(model._no_split_modules or ())
    return [module for module in model.modules() if type(module).__name__ in names]


def model_state(
    layout: Layout, parameters: int, processes: int, compute_bytes: int, trainable: int | None = None
) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state per rank (the table above), for a
    model of `parameters` values of which `trainable` (default: all) are trained, and how many
    of them live in CPU memory under offload. Frozen parameters (a LoRA base model) have
    weights only: no gradients, no optimizer state and, under DeepSpeed, no fp32 masters."""
    psi, n, c = parameters, processes, compute_bytes
    t = psi if trainable is None else trainable
    if not layout.deepspeed:
        shards = n if layout.sharded_parameters else 1
        state = {"parameters": 4 * psi / shards, "gradients": 4 * t / shards, "optimizer": 8 * t / shards}
        offloaded = sum(state.values()) if layout.offload_optimizer else 0.0
        return state | {"offloaded": offloaded}
    parameters = c * psi / n if layout.sharded_parameters else c * psi
    # Measured (DeepSpeed 0.19.8, fp32 and bf16): with frozen parameters, ZeRO-1/2 keep the fp32
    # gradient partition of the trained ones alone, no compute-dtype partition beside it.
    gradients = (c + 4) * t / n if layout.sharded_parameters or t == psi else 4 * t / n
    state = {"parameters": parameters, "gradients": gradients, "optimizer": 12 * t / n}
    offloaded = (state["optimizer"] + 4 * t / n if layout.offload_optimizer else 0.0) + (
        c * psi / n if layout.offload_parameters else 0.0
    )
    return state | {"offloaded": offloaded}


def working_bytes(layout: Layout, shape: ModelShape, compute_bytes: int) -> float:
    """Buffers on the GPU besides model state and activations (an estimate): parameters a
    sharded strategy holds gathered, and DeepSpeed's communication buckets. DDP's gradients are
    its buckets (gradient_as_bucket_view)."""
    psi, c = shape.parameters, compute_bytes
    if layout.strategy.startswith("fsdp"):  # this layer and the prefetched next, its unsharded fp32 grads, the root unit
        return (2 * c + 4) * shape.layer_parameters / layout.tp_size + c * shape.root_parameters
    if not layout.deepspeed:
        return 0.0
    reduce = min(layout.reduce_bucket, psi) * c * (2 if layout.overlap_comm else 1)
    persistent = sum(numel for numel in shape.numels if numel <= layout.persistence_threshold)
    return reduce + min(layout.prefetch_bucket, psi) * c + persistent * c


def pick(rows: dict[str, dict], num_gpus: int, usable_bytes: float) -> str | None:
    """The config to launch: the first in PREFERENCE order whose `gpu_total` fits in
    `usable_bytes`. single.yaml only on one GPU: on more it would leave the others idle."""
    fitting = [name for name, row in rows.items() if row["gpu_total"] <= usable_bytes and row["runs"]
               and (row["strategy"] != "single" or num_gpus == 1)]
    return min(fitting, key=lambda name: PREFERENCE.index(rows[name]["strategy"]), default=None)


def activation_bytes(shape: ModelShape, batch: int, seq_len: int, gradient_checkpointing: bool) -> float:
    """What autograd keeps for backward from one micro-batch's forward and loss, and the loss's
    backward on top: an estimate.

    The forward runs on the meta device in the compute dtype and the saved tensors are
    counted. Attention score matrices (... x seq_len x seq_len) are left out: the fused
    attention kernels GPUs use do not store them. Autocast keeps norms and the residual
    stream in fp32, which this counts in the compute dtype. With gradient checkpointing, each
    layer keeps only its input, and one layer at a time is recomputed.
    """
    model = shape.meta_model
    inside_layer: list[bool] = [False]
    saved = {False: {}, True: {}}  # by storage, so views count once

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if not (tensor.dim() >= 2 and tensor.shape[-1] == tensor.shape[-2] == seq_len):
            saved[inside_layer[0]][tensor.untyped_storage()._cdata] = tensor.untyped_storage().nbytes()
        return tensor

    def enter(*_):
        inside_layer[0] = True

    def leave(*_):
        inside_layer[0] = False

    hooks = [hook for layer in _layers(model)
             for hook in (layer.register_forward_pre_hook(enter), layer.register_forward_hook(leave))]
    try:
        ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            token_loss_sums(model(input_ids=ids).logits, ids)
    finally:
        for hook in hooks:
            hook.remove()
    outside, inside = sum(saved[False].values()), sum(saved[True].values())
    # The loss keeps fp32 log-probabilities (counted above: tokens x vocabulary); its backward adds
    # their fp32 gradient and the logits' beside them, the peak of a language model's step.
    loss_backward = 2 * 4 * batch * seq_len * model.config.vocab_size
    if not gradient_checkpointing:
        return outside + inside + loss_backward
    dtype_bytes = next(model.parameters()).element_size()
    return (outside + shape.layers * batch * seq_len * shape.hidden_size * dtype_bytes + inside / max(shape.layers, 1)
            + loss_backward)


def launched_layout(strategy: Strategy) -> Layout:
    """How the launched config lays out model state, read from `accelerate launch`'s environment."""
    if strategy is Strategy.DEEPSPEED:
        from accelerate.utils import DeepSpeedPlugin

        return deepspeed_layout("launched", DeepSpeedPlugin().deepspeed_config)
    if strategy is Strategy.FSDP:
        offload = os.environ.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
        return fsdp_layout("launched", offload, int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1")))
    return Layout("launched", strategy.value)


def launch_memory(plan: Plan) -> str:
    """The dry run's memory line: model state per rank for this launch, and for a causal LM activations and
    working buffers (estimates)."""
    task, model, model_args, args, compute_dtype = plan.task, plan.model, plan.model_args, plan.args, plan.compute_dtype
    layout = launched_layout(plan.strategy)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    held = plan.held_parameters or parameter_count(model)  # a part may cut the model (`Part.held_parameters`)
    state = model_state(layout, held, plan.processes, compute_dtype.itemsize, trainable * held // parameter_count(model))
    memory = (f"model state {(state['parameters'] + state['gradients'] + state['optimizer']) / MIB:,.1f} MiB "
              f"(parameters {state['parameters'] / MIB:,.1f}, gradients {state['gradients'] / MIB:,.1f}, "
              f"optimizer {state['optimizer'] / MIB:,.1f}; {state['offloaded'] / MIB:,.1f} of it in CPU memory)")
    if hasattr(task, "block_size") and hasattr(model, "config"):  # the activation estimate traces a transformers causal LM
        shape = model_shape(model.config, compute_dtype, model_args.trust_remote_code)
        activations = activation_bytes(shape, args.per_device_train_batch_size, task.block_size,
                                       model_args.gradient_checkpointing)
        memory += (f", activations ~{activations / MIB:,.1f} MiB and working buffers "
                   f"~{working_bytes(layout, shape, compute_dtype.itemsize) / MIB:,.1f} MiB (estimates)")
    return memory
