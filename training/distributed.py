"""Build the `Accelerator`, and prove the strategy that runs is the one the config asked for.

This is the only module that knows about strategies. Everything else calls the
Accelerator API and stays strategy-agnostic.

Why an accommodation is needed on machines without a GPU (measured with accelerate 1.15.0):
- DDP: accelerate only picks the gloo CPU backend when told `Accelerator(cpu=True)`;
  otherwise each of the N launched processes trains alone with world size 1.
- DeepSpeed: without `InitProcessGroupKwargs(backend="gloo")` accelerate counts one
  process while DeepSpeed counts N, and batch-size checks fail.
- FSDP: accelerate's device detection refuses FSDP on CPU and falls back silently
  (independent single-process runs, or plain DDP with `cpu=True`). FSDP2 itself trains
  on gloo. So we start accelerate's process group on gloo with device `cpu`, then mark
  the run as multi-device so that `AcceleratorState` activates the FSDP plugin exactly
  as it does on GPUs. `tests/test_cpu_accommodation.py` fails loudly if a new accelerate
  changes either the refusal or the behaviour this relies on.
On a GPU machine none of this applies: the same config files run unmodified over NCCL.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from enum import Enum
from pathlib import Path

import torch
from accelerate import Accelerator, PartialState
from accelerate.logging import get_logger
from accelerate.utils import DistributedDataParallelKwargs, DistributedType, InitProcessGroupKwargs

from training.batchnorm import batch_norm_layers, running_statistics
from training.errors import StrategyError


class Strategy(str, Enum):
    SINGLE = "single"
    DDP = "ddp"
    FSDP = "fsdp"
    DEEPSPEED = "deepspeed"


logger = get_logger(__name__)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() == "true"


def requested_strategy() -> Strategy:
    """The strategy the launcher was configured with (`accelerate launch` sets these variables)."""
    if _env_flag("ACCELERATE_USE_DEEPSPEED"):
        return Strategy.DEEPSPEED
    if _env_flag("ACCELERATE_USE_FSDP"):
        return Strategy.FSDP
    # torchrun starts every multi-process config, also with one process (`ddp.yaml --num_processes 1`):
    # that is DDP of one, while single.yaml runs train.py directly.
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or "TORCHELASTIC_RUN_ID" in os.environ:
        return Strategy.DDP
    return Strategy.SINGLE


def has_accelerator_device() -> bool:
    return torch.accelerator.is_available()


def build_accelerator(ddp_timeout: int, **accelerator_kwargs) -> Accelerator:
    """An `Accelerator` for the configured strategy, on GPUs or, for real, on CPU.

    `ddp_timeout` (seconds) bounds every collective of the process group, on every strategy.
    """
    strategy = requested_strategy()
    timeout = timedelta(seconds=ddp_timeout)
    on_cpu = not has_accelerator_device()
    check_launch_config(strategy, on_cpu)
    if on_cpu and strategy is Strategy.FSDP:
        state = PartialState(backend="gloo", timeout=timeout)  # a gloo process group on device cpu, type NO
        state.distributed_type = DistributedType.MULTI_GPU  # so AcceleratorState turns on the FSDP plugin
    if on_cpu and strategy is Strategy.DEEPSPEED:
        skip_deepspeed_inference_kernel()
    # InitProcessGroupKwargs passes on only what differs from its defaults: the backend only for DeepSpeed on CPU.
    backend = "gloo" if on_cpu and strategy is Strategy.DEEPSPEED else InitProcessGroupKwargs.backend
    handler = InitProcessGroupKwargs(backend=backend, timeout=timeout)
    # DDP: gradients live in its communication buckets instead of beside them (one copy, not two),
    # and buffers are not copied from rank 0 before each forward: BatchNorm statistics are
    # averaged instead, on every strategy alike (training/batchnorm.py).
    ddp = DistributedDataParallelKwargs(gradient_as_bucket_view=True, broadcast_buffers=False)
    cpu = on_cpu and strategy in (Strategy.SINGLE, Strategy.DDP)
    return Accelerator(cpu=cpu, kwargs_handlers=[handler, ddp], **accelerator_kwargs)


def skip_deepspeed_inference_kernel() -> None:
    """On CPU, DeepSpeed compiles a shared-memory all-reduce as it starts (45 to 60 s on the first
    launch in each environment, and a line per rank), which only its inference engine uses
    (`inference_all_reduce`); training collectives go through torch.distributed either way."""
    backend = importlib.import_module("deepspeed.comm.torch")  # not `deepspeed.comm.torch`: that name is torch itself
    backend.build_shm_op = lambda: None


def check_launch_config(strategy: Strategy, on_cpu: bool) -> None:
    """Reject what accelerate would fail on with a traceback, or run silently differently, before any process group.

    Each rank checks the same launcher settings, so every rank stops with the same line.
    """
    if strategy is Strategy.DEEPSPEED and (path := os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")):
        if not Path(path).is_file():
            raise StrategyError(
                f"DeepSpeed config {path} (deepspeed_config_file in the accelerate yaml) not found from {os.getcwd()}; "
                "relative paths count from where you launch: run from the repository root or use an absolute path"
            )
        try:
            ds_config = json.loads(Path(path).read_text())
        except json.JSONDecodeError as error:
            raise StrategyError(f"DeepSpeed config {path} is not valid JSON ({error}); fix it or start from ds_configs/")
        if sections := [key for key in ("optimizer", "scheduler") if key in ds_config]:
            raise StrategyError(
                f"DeepSpeed config {path} has its own {' and '.join(sections)} section: train.py builds the optimizer "
                "(--optim, --learning_rate, --adam_beta1/2, --weight_decay) and the schedule (--lr_scheduler_type, "
                "--warmup_steps) the same way on every strategy; remove the section and set those flags"
            )
    if (backend := os.environ.get("ACCELERATE_DYNAMO_BACKEND", "NO").upper()) != "NO":
        raise StrategyError(
            f"the launcher asks for torch.compile with dynamo backend {backend.lower()}, which train.py would replace: "
            "it compiles with its own --torch_compile (inductor); drop --dynamo_backend (or dynamo_config in the yaml) "
            "and pass --torch_compile to train.py"
        )
    if _env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
        check_parallelism_config(strategy)
    if on_cpu and strategy is Strategy.FSDP and os.environ.get("FSDP_VERSION", "1") != "2":
        raise StrategyError("FSDP1 cannot run on CPU; set `fsdp_version: 2` in the accelerate config")
    if on_cpu and os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp16":
        raise StrategyError(
            "fp16 mixed precision needs a GPU (loss scaling runs on the device) and this machine has none; "
            "use --mixed_precision bf16 or no"
        )


def check_parallelism_config(strategy: Strategy) -> None:
    """The launcher's `parallelism_config` (tensor parallelism here) fits the processes launched."""
    sizes = {name: int(os.environ.get(f"PARALLELISM_CONFIG_{name.upper()}_SIZE", "1"))
             for name in ("dp_replicate", "dp_shard", "tp", "cp")}
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    grid = " x ".join(f"{name} {size}" for name, size in sizes.items() if size > 1) or "1"
    if strategy is not Strategy.FSDP:
        raise StrategyError("parallelism_config in the accelerate yaml needs distributed_type: FSDP with fsdp_version: 2 "
                            "(start from accelerate_configs/fsdp_tp.yaml)")
    if sizes["cp"] > 1 or sizes["dp_replicate"] > 1:
        raise StrategyError(f"parallelism_config {grid}: train.py runs dp_shard x tp only (no context parallelism or "
                            "HSDP replication yet); set the other sizes to 1")
    if (grid_size := math.prod(sizes.values())) != world_size:
        raise StrategyError(f"parallelism_config is {grid} = {grid_size} processes but {world_size} were "
                            "launched; make the sizes multiply to num_processes")
    if sizes["dp_shard"] < 2:
        raise StrategyError(f"FSDP2 with tensor parallelism needs parallelism_config_dp_shard_size >= 2 (got {grid}): "
                            "at least 2 x tp_size processes; for one model split over all processes, use fsdp.yaml")


def wrapped_strategy(model: torch.nn.Module) -> Strategy:
    """The strategy implied by the wrapper `accelerator.prepare` put around the model."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    model = getattr(model, "_orig_mod", model)  # --torch_compile wraps the strategy's wrapper
    if type(model).__name__ == "DeepSpeedEngine":
        return Strategy.DEEPSPEED
    if isinstance(model, (FSDPModule, FullyShardedDataParallel)):
        return Strategy.FSDP
    if isinstance(model, DistributedDataParallel):
        return Strategy.DDP
    return Strategy.SINGLE


EXPECTED_TYPES = {
    Strategy.SINGLE: {DistributedType.NO},
    Strategy.DDP: {DistributedType.MULTI_CPU, DistributedType.MULTI_GPU},
    Strategy.FSDP: {DistributedType.FSDP},
    Strategy.DEEPSPEED: {DistributedType.DEEPSPEED},
}


def verify_strategy(accelerator: Accelerator, prepared_model: torch.nn.Module | None = None) -> Strategy:
    """Refuse to train unless the strategy in use is the configured one.

    Call once after building the Accelerator and again with the prepared model.
    """
    requested = requested_strategy()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != world_size:
        raise StrategyError(
            f"{world_size} processes were launched but accelerate sees {accelerator.num_processes}: "
            "each would train alone. Launch with `accelerate launch --config_file accelerate_configs/<strategy>.yaml`"
        )
    if accelerator.num_processes > 1 and accelerator.distributed_type is DistributedType.NO:
        raise StrategyError(
            f"{accelerator.num_processes} processes but no distributed strategy: gradients would never be synchronised"
        )
    if accelerator.distributed_type not in EXPECTED_TYPES[requested]:
        raise StrategyError(
            f"the config asked for {requested.value} but accelerate set up {accelerator.distributed_type.value}"
        )
    if prepared_model is not None:
        wrapped = wrapped_strategy(prepared_model)
        # accelerate wraps one GPU process in no DDP (`use_distributed` needs 2), while on CPU it does:
        # DDP of one is then the plain model.
        ddp_of_one = requested is Strategy.DDP and wrapped is Strategy.SINGLE and accelerator.num_processes == 1
        if wrapped is not requested and not ddp_of_one:
            raise StrategyError(f"the config asked for {requested.value} but the model is wrapped for {wrapped.value}")
        if requested is Strategy.FSDP and accelerator.is_fsdp2 is not (os.environ.get("FSDP_VERSION") == "2"):
            raise StrategyError("the FSDP version in use differs from the config's fsdp_version")
    return requested


def idle_gpu_warning(accelerator: Accelerator, owns_every_gpu: bool) -> str | None:
    """A warning when this machine has more GPUs than processes on it (every config says
    `num_processes: 2`, which leaves 6 of an 8-GPU node idle unless the launch says otherwise).
    `owns_every_gpu`: one process spreads the model over all of them (`--device_map`)."""
    if accelerator.device.type == "cpu" or owns_every_gpu:
        return None
    local_processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return idle_gpus(local_processes, torch.accelerator.device_count(), accelerator.num_processes // local_processes)


def idle_gpus(local_processes: int, local_gpus: int, machines: int) -> str | None:
    """`idle_gpu_warning`'s decision, from the counts."""
    if local_processes >= local_gpus:
        return None
    return (f"this machine has {local_gpus} GPUs but {local_processes} process(es) run on it: {local_gpus - local_processes} "
            f"sit idle. Launch with `accelerate launch --num_processes {local_gpus * machines} ...` (the total over "
            "all machines)")


def tensor_parallel_size(accelerator: Accelerator) -> int:
    """Processes that share one batch, each computing a slice of every layer (`parallelism_config_tp_size`)."""
    config = accelerator.parallelism_config
    return config.tp_size if config is not None else 1


def data_parallel_size(accelerator: Accelerator) -> int:
    """Processes that see different batches: the global batch is this x per-device batch x accumulation."""
    return accelerator.num_processes // tensor_parallel_size(accelerator)


def apply_tensor_parallel(accelerator: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """With `parallelism_config_tp_size` > 1, shard each layer over the "tp" mesh with the model's own
    `transformers` TP plan (before the optimizer is built: the parameters become DTensors).

    accelerate does not apply a plan itself; it only checks for DTensors. Its FSDP2 path
    (accelerate 1.15) also imports `ReplicateParallel`, which transformers 5 removed, for the
    parameters outside the plan (norms): `_install_replicate_parallel` supplies it.
    """
    tp_size = tensor_parallel_size(accelerator)
    if tp_size == 1:
        return model
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan, config = tensor_parallel_plan(model, tp_size)
    mesh = accelerator.torch_device_mesh["tp"]
    model = apply_tensor_parallelism(model, mesh, plan)
    # accelerate reads the TP size from the config; save_pretrained gathers the shards through the mesh.
    model.config.distributed_config = config
    model._tp_size, model._device_mesh = tp_size, mesh
    _install_replicate_parallel()
    return model


def tensor_parallel_plan(model: torch.nn.Module, tp_size: int) -> tuple[dict[str, str], object]:
    """The model's `transformers` TP plan with `layers.*` spelled out, and its DistributedConfig."""
    from transformers import DistributedConfig

    if not getattr(model, "tp_plan", None):
        raise StrategyError(
            f"{type(model).__name__} has no tensor-parallel plan in transformers; train it with a config without "
            "parallelism_config_tp_size (e.g. fsdp.yaml)"
        )
    config = DistributedConfig(tp_size=tp_size)
    plan, _, _ = model._resolve_parallel_plans(config)
    return plan, config


def _install_replicate_parallel() -> None:
    """The `ReplicateParallel` accelerate 1.15 expects: a module whose parameters accelerate made
    replicated DTensors runs its forward on the local tensors (as axolotl does for the same gap)."""
    import transformers.integrations.tensor_parallel as legacy
    from transformers.distributed.tensor_parallel import TensorParallelLayer

    if hasattr(legacy, "ReplicateParallel"):
        return

    class ReplicateParallel(TensorParallelLayer):
        def should_use_local_tensors(self, module: torch.nn.Module) -> bool:
            return True

        def prepare_module_tp(self, module: torch.nn.Module, device_mesh) -> torch.nn.Module:
            if "forward" not in vars(module):  # accelerate calls this once per parameter: wrap each module once
                self.install_forward(module, device_mesh)
            return module

    legacy.ReplicateParallel = ReplicateParallel


def optimizer_offload_device(accelerator: Accelerator) -> str:
    """Where ZeRO keeps and steps the optimizer: "cpu" or "nvme" under offload, else "none"."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None:
        return "none"
    return plugin.deepspeed_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")


def describe(accelerator: Accelerator, strategy: Strategy) -> str:
    """One line for the logs: strategy, processes, backend and device."""
    detail = ""
    if strategy is Strategy.DEEPSPEED:
        offload = optimizer_offload_device(accelerator)
        detail = f" ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}" + (f" offload={offload}" if offload != "none" else "")
    elif strategy is Strategy.FSDP:
        detail = f" v{accelerator.state.fsdp_plugin.fsdp_version}"
        if (tp_size := tensor_parallel_size(accelerator)) > 1:
            detail += f" x tp={tp_size} (data-parallel {data_parallel_size(accelerator)})"
    backend = accelerator.state.backend or "none"
    return (
        f"strategy={strategy.value}{detail} processes={accelerator.num_processes} "
        f"backend={backend} device={accelerator.device.type} mixed_precision={accelerator.mixed_precision}"
    )


def align_with_strategy(accelerator: Accelerator, model: torch.nn.Module, max_grad_norm: float, per_device_batch: int) -> None:
    """Before the optimizer and `prepare`: make the strategy run what train.py asks for (see each helper)."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(accelerator.mixed_precision)
    if accelerator.distributed_type is DistributedType.FSDP:
        _answer_none_for_missing_embeddings(model)
        if accelerator.state.fsdp_plugin.cpu_ram_efficient_loading and (buffers := persistent_buffers(model)):
            raise StrategyError(
                f"fsdp_cpu_ram_efficient_loading broadcasts only parameters from rank 0, and this model has buffers "
                f"that are saved with it ({', '.join(buffers[:3])}...); set `fsdp_cpu_ram_efficient_loading: false` "
                "in the accelerate config (every rank then builds the whole model)"
            )
        if half is not None:
            _keep_batch_norm_in_fp32(model, accelerator)
            _reduce_gradients_in_fp32(accelerator)
    if accelerator.state.deepspeed_plugin is not None:
        align_deepspeed_config(accelerator.state.deepspeed_plugin.deepspeed_config, max_grad_norm, per_device_batch)
        if half is not None:
            _batch_norm_statistics_in(model, half)


def persistent_buffers(model: torch.nn.Module) -> list[str]:
    """Names of the buffers in the model's state dict (BatchNorm statistics; not rotary tables)."""
    parameters = {name for name, _ in model.named_parameters(remove_duplicate=False)}
    return [name for name in model.state_dict() if name not in parameters]


def _answer_none_for_missing_embeddings(model: torch.nn.Module) -> None:
    """accelerate 1.15's FSDP2 asks every model for its input embeddings, to shard them as a unit,
    expecting None from models without any (image models); `transformers` raises instead."""
    try:
        model.get_input_embeddings()
    except NotImplementedError:
        model.get_input_embeddings = lambda: None


def _reduce_gradients_in_fp32(accelerator: Accelerator) -> None:
    """accelerate's FSDP2 policy for bf16/fp16 also reduces gradients in that dtype: a sum over
    many ranks in 8 bits of mantissa. Compute stays in half precision; the reduce-scatter runs in
    fp32, as torchtitan's default, and as DDP's (whose gradients are the fp32 parameters')."""
    plugin = accelerator.state.fsdp_plugin
    if plugin.fsdp_version == 2 and plugin.mixed_precision_policy is not None:
        plugin.mixed_precision_policy = dataclasses.replace(plugin.mixed_precision_policy, reduce_dtype=torch.float32)


def gradient_reduction_dtypes(model: torch.nn.Module) -> set[torch.dtype]:
    """The dtypes the ranks average gradients in: FSDP2's policy per unit, DeepSpeed's
    `communication_data_type` (bf16 under bf16, DeepSpeed's default), else the parameters'."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED:
        return {model.communication_data_type}
    states = [module._get_fsdp_state() for module in model.modules() if hasattr(module, "_get_fsdp_state")]
    if states:  # no reduce_dtype: the param_dtype, else the (fp32) parameters'
        return {state._mp_policy.reduce_dtype or state._mp_policy.param_dtype or torch.float32 for state in states}
    return {param.dtype for param in model.parameters() if param.requires_grad}


def _keep_batch_norm_in_fp32(model: torch.nn.Module, accelerator: Accelerator) -> None:
    """FSDP2's mixed precision casts BatchNorm weights to bf16 while its running statistics stay
    fp32, which BatchNorm refuses (pytorch/torchtitan#674). Each BatchNorm becomes its own FSDP2
    unit computing in fp32, as autocast runs it under DDP; accelerate wraps the rest as usual."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    fp32 = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)
    for layer in batch_norm_layers(model):
        fully_shard(layer, mp_policy=fp32, reshard_after_forward=accelerator.state.fsdp_plugin.reshard_after_forward)


def _batch_norm_statistics_in(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """DeepSpeed's bf16/fp16 engines cast the parameters but not the buffers, and BatchNorm needs
    its running statistics in its weights' dtype."""
    for buffer in running_statistics(model):
        buffer.data = buffer.to(dtype)


def align_deepspeed_config(config: dict, max_grad_norm: float, per_device_batch: int) -> None:
    """- DeepSpeed clips at `--max_grad_norm` like the other strategies: accelerate fills an
      `"auto"` (or missing) `gradient_clipping` with 1.0, so we write our value in; a number
      in the JSON that disagrees with the flag is an error rather than a silent difference.
    - Its `"auto"` micro-batch is `--per_device_train_batch_size`: accelerate would take the
      smallest batch of all dataloaders passed to `prepare`, the eval one included."""
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        config["train_micro_batch_size_per_gpu"] = per_device_batch
    clipping = config.get("gradient_clipping", "auto")
    if clipping == "auto":
        config["gradient_clipping"] = max_grad_norm
    elif float(clipping) != max_grad_norm:
        raise StrategyError(
            f"gradient_clipping is {clipping} in the DeepSpeed JSON but --max_grad_norm is {max_grad_norm}; "
            'set "gradient_clipping": "auto" in the JSON so the flag decides'
        )


def clip_gradients(accelerator: Accelerator, model: torch.nn.Module, max_norm: float) -> torch.Tensor | float:
    """Clip the global gradient norm to `max_norm`; return the norm before clipping, still on the device.

    DeepSpeed clips inside its own step (`gradient_clipping`, set from --max_grad_norm), and
    accelerate's `clip_grad_norm_` reads its norm with `.item()`, a wait for the GPU at every
    step: the engine's value is taken as it is instead."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED:
        return model.get_global_grad_norm()
    return accelerator.clip_grad_norm_(model.parameters(), max_norm)


def floating_input_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype for floating-point inputs (pixels): DeepSpeed's bf16/fp16 engines hold the whole
    model in that dtype and do not autocast, so inputs must match (as Trainer casts them); every
    other strategy autocasts from fp32."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED and (model.bfloat16_enabled() or model.fp16_enabled()):
        return torch.bfloat16 if model.bfloat16_enabled() else torch.float16
    return torch.float32


def gather_once_per_batch(per_example: torch.Tensor, accelerator: Accelerator) -> torch.Tensor:
    """`gather_for_metrics`, counting each tensor-parallel group's batch once: the ranks of a
    group see the same batch, and accelerate 1.15's `gather_for_metrics` would count them all
    and cut the last batch at the wrong place."""
    tp_size = tensor_parallel_size(accelerator)
    if tp_size == 1:
        return accelerator.gather_for_metrics(per_example)
    gathered = accelerator.gather(per_example)  # rank order: the tp ranks of one batch are neighbours
    gathered = gathered.view(accelerator.num_processes, -1, *per_example.shape[1:])[::tp_size].flatten(0, 1)
    state = accelerator.gradient_state
    return gathered[: state.remainder] if state.end_of_dataloader and state.remainder > 0 else gathered


def _auto_keys(config: dict, prefix: str = "") -> list[str]:
    """Keys still set to "auto" anywhere in a DeepSpeed config."""
    found = []
    for key, value in config.items():
        if isinstance(value, dict):
            found += _auto_keys(value, f"{prefix}{key}.")
        elif value == "auto":
            found.append(prefix + key)
    return found


def held_gradients(model: torch.nn.Module) -> list[torch.Tensor]:
    """Gradients a strategy keeps outside `param.grad`: DeepSpeed ZeRO's partitions (for measuring memory)."""
    if wrapped_strategy(model) is not Strategy.DEEPSPEED:
        return []
    zero = model.optimizer
    found = [getattr(zero, "grad_partitions_flat_buffer", None)]  # ZeRO-3: one flat buffer
    for grads in getattr(zero, "averaged_gradients", {}).values():  # ZeRO-1/2: per parameter group
        found += [getattr(grads, "flat_partition", None), *(grads or [])]
    return [tensor for tensor in found if isinstance(tensor, torch.Tensor)]


def master_weight_dtypes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[torch.dtype]:
    """The dtypes of the weights the optimizer updates (DeepSpeed keeps its own flat copies)."""
    if wrapped_strategy(model) is Strategy.DEEPSPEED:
        zero = model.optimizer  # ZeRO-3 and ZeRO-1/2 name their fp32 partitions differently
        partitions = getattr(zero, "fp32_partitioned_groups_flat", None) or zero.single_partition_of_fp32_groups
        return {partition.dtype for partition in partitions}
    return {param.dtype for group in optimizer.param_groups for param in group["params"]}


def verify_prepared(
    accelerator: Accelerator,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    per_device_batch: int,
    max_grad_norm: float,
) -> None:
    """After `prepare`: what runs is what train.py asked for, on every strategy.

    - the wrapper around the model is the configured strategy's;
    - the optimizer updates fp32 master weights, also under bf16/fp16 (training bf16
      weights directly learns worse, and differs between FSDP and DeepSpeed);
    - DeepSpeed: no "auto" is left, and its micro-batch, accumulation, clipping and
      precision equal train.py's. It also steps train.py's own optimizer (under offload,
      the DeepSpeedCPUAdam that training/optim.py builds with --adam_beta1/2 and
      --adam_epsilon): accelerate 1.15 would otherwise swap in a DeepSpeedCPUAdam of its own
      that keeps only lr and weight decay (and the schedule no longer reaches it), which
      `"zero_force_ds_cpu_optimizer": false` in zero3_offload.json prevents.
    """
    verify_strategy(accelerator, model)
    if master_weight_dtypes(model, optimizer) != {torch.float32}:
        raise StrategyError(f"optimizer master weights are {master_weight_dtypes(model, optimizer)}, not float32")
    if wrapped_strategy(model) is not Strategy.DEEPSPEED:
        return
    leftover = _auto_keys(accelerator.state.deepspeed_plugin.deepspeed_config)
    if leftover:
        raise StrategyError(f"DeepSpeed config values still 'auto' after prepare: {leftover}")
    expected = {
        "micro-batch": (model.train_micro_batch_size_per_gpu(), per_device_batch),
        "gradient accumulation": (model.gradient_accumulation_steps(), accelerator.gradient_accumulation_steps),
        "gradient clipping": (model.gradient_clipping(), max_grad_norm),
        "bf16": (model.bfloat16_enabled(), accelerator.mixed_precision == "bf16"),
        "fp16": (model.fp16_enabled(), accelerator.mixed_precision == "fp16"),
    }
    for name, (engine_value, ours) in expected.items():
        if engine_value != ours:
            raise StrategyError(
                f"DeepSpeed runs with {name} {engine_value} but train.py asked for {ours}; "
                'set that key to "auto" in the DeepSpeed JSON (clipping: to --max_grad_norm)'
            )
    stepped = model.optimizer.optimizer  # what DeepSpeed's ZeRO wrapper steps
    if stepped is not scheduler.scheduler.optimizer:
        raise StrategyError(
            f"DeepSpeed replaced train.py's optimizer with {type(stepped).__name__} (different betas/eps, and the "
            'schedule would not reach it); set "zero_force_ds_cpu_optimizer": false in the DeepSpeed JSON'
        )


def write_effective_deepspeed_config(accelerator: Accelerator, output_dir: str) -> None:
    """Save the DeepSpeed config as resolved by `prepare` (no "auto"), for the record."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and accelerator.is_main_process:
        path = Path(output_dir) / "deepspeed_config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(plugin.deepspeed_config, indent=2, default=str))


@contextmanager
def model_construction(accelerator: Accelerator, pretrained: bool, can_build_empty: bool) -> Iterator[bool]:
    """Build the model so that no rank holds the whole fp32 model in host memory when it need
    not (a 7B model is 28 GB per rank, 224 GB on an 8-GPU node); yields whether this rank
    builds it empty (allocated, never written, so not resident).

    - FSDP2 with `fsdp_cpu_ram_efficient_loading` (fsdp.yaml): rank 0 loads or initialises
      the model, every other rank builds it empty; `prepare` shards it and broadcasts rank
      0's weights (accelerate's `fsdp2_load_full_state_dict`). Every rank ends with the
      weights rank 0 built, which seeded ranks build identically anyway. A task that cannot
      build empty (`can_build_empty` false: image models) is built whole on every rank, and
      nothing is broadcast.
    - ZeRO-3: pretrained weights load partitioned (`deepspeed.zero.Init`: each rank keeps its
      partition), the same weights. A model initialised from scratch is built whole on every
      rank, as DDP and FSDP build it, unless the config's `zero3_init_flag` asks for
      zero.Init: random weights built partitioned differ from the other strategies'.
      (accelerate 1.15 registers the DeepSpeed config with `transformers` even when the flag
      is false, which would partition every model: that registration is lifted meanwhile.)
    """
    from transformers.integrations import unset_hf_deepspeed_config

    fsdp = accelerator.state.fsdp_plugin if accelerator.distributed_type is DistributedType.FSDP else None
    if fsdp is not None:
        fsdp.cpu_ram_efficient_loading = bool(fsdp.cpu_ram_efficient_loading) and can_build_empty
        if fsdp.cpu_ram_efficient_loading:
            logger.info("model built on rank 0 only; `prepare` broadcasts its weights (fsdp_cpu_ram_efficient_loading)")
        yield fsdp.cpu_ram_efficient_loading and accelerator.process_index != 0
        return
    plugin = accelerator.state.deepspeed_plugin
    if plugin is None or plugin.zero3_init_flag or (pretrained and plugin.zero_stage == 3):
        if plugin is not None and plugin.zero_stage == 3:
            logger.info("model built partitioned over the ranks (deepspeed.zero.Init)")
        yield False
        return
    unset_hf_deepspeed_config()
    try:
        yield False
    finally:
        plugin.set_deepspeed_weakref()


def release_model_construction_hooks() -> None:
    """After training: let one process alone build `transformers` models again.

    With ZeRO-3's config registered, `transformers` builds every new model partitioned,
    a collective that needs all ranks; the summary loads the export on one process.
    """
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
