"""Owns pipeline parallelism: the model's stages on processes, run by torch's schedules over micro-batches.

`--pipeline_parallel_size P` cuts the model into P consecutive stages (parts/pipeline/stages.py), one
per process (Interleaved1F1B: two per process, 2P in all, stage s on process s mod P), and the
N launched processes into N/P replicas of that pipeline: processes r*P .. r*P+P-1 form replica
r, so one replica's stages sit on neighbouring ranks (one node, where they fit). accelerate has
no pipeline parallelism for training; `torch.distributed.pipelining` runs the schedule
(`--pipeline_schedule`, over `--pipeline_microbatches` equal slices of each batch), and the
replicas average their gradients after each window of micro-steps, as DDP does.

What changes for the rest of train.py, all through `StageModules`, the model it trains here:
- one micro-step is `StageModules.forward_backward` (the schedule runs forward and backward
  of every micro-batch) instead of a forward and `accelerator.backward`;
- the loss is the same token mean over the global batch: each micro-batch's loss sum is divided
  by the window's target count, on the last stage, and reported from there;
- clipping takes the norm over every stage's gradients; evaluation runs the schedule forward only
  and sums on the last stage; checkpoints hold each stage's weights and optimizer state under the
  model's own parameter names; `final/` is the whole model, merged from the stages on rank 0.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader
from accelerate.logging import get_logger
from accelerate.optimizer import AcceleratedOptimizer
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.data import DataLoader

from parts.pipeline.layout import SCHEDULES, stage_count
from parts.pipeline.stages import split_into_stages
from training.checkpoints.tensors import set_next_rate
from training.loss import IGNORE_INDEX
from training.runner import ModelRunner

logger = get_logger(__name__)

STAGE_WEIGHTS = "pipeline_stage{index}.safetensors"
STAGE_OPTIMIZER = "pipeline_optimizer_rank{rank}.pt"


class StageModules(nn.ModuleList, ModelRunner):
    """This process's pipeline stages: what train.py trains in place of the model (see the module docstring)."""

    def __init__(self, accelerator: Accelerator, model: nn.Module, args) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        size = args.parts.pipeline.pipeline_parallel_size
        replicas = accelerator.num_processes // size
        mesh = init_device_mesh(accelerator.device.type, (replicas, size), mesh_dim_names=("dp", "pp"))
        every_stage = split_into_stages(model, stage_count(args))
        rank = mesh.get_local_rank("pp")
        indices = list(range(rank, len(every_stage), size))
        super().__init__([every_stage[i] for i in indices])
        for index, stage in enumerate(every_stage):  # free the other stages' weights (the model keeps their names)
            if index not in indices:
                stage.to("meta")
        self.to(accelerator.device)
        self.accelerator = accelerator
        self.__dict__["whole_model"] = model  # not a submodule: this process's stages in place, the others on "meta"
        self.indices, self.num_stages, self.stage_rank = indices, len(every_stage), rank
        self.replica, self.replicas = mesh.get_local_rank("dp"), replicas
        self.stage_group, self.replica_group = mesh.get_group("pp"), mesh.get_group("dp")
        self.args, self.task, self.schedule, self.optimizer, self.loss_scale, self.metrics = args, None, None, None, None, None
        self.timeline, self.steps_run = [], 0  # --pipeline_timeline: what each stage computed when
        # trainable tensors per stage, every stage's (each process builds the whole model first): for clipping
        self.tensors_per_stage = [sum(p.requires_grad for p in stage.parameters()) for stage in every_stage]
        layers = [len(getattr(stage, "layers", getattr(stage, "blocks", ()))) for stage in every_stage]
        logger.info(f"pipeline: {self.num_stages} stages ({', '.join(map(str, layers))} layers) over {size} processes "
                    f"x {replicas} replica(s), {args.parts.pipeline.pipeline_schedule} with {args.parts.pipeline.pipeline_microbatches} micro-batches; "
                    f"rank 0 holds stages {indices} ({sum(p.numel() for p in self.parameters()):,} parameters)",
                    main_process_only=True)

    @property
    def has_first(self) -> bool:
        return 0 in self.indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    def full_state_dict(self, stages: list[nn.Module] | None = None) -> dict[str, torch.Tensor]:
        """`stages`' weights (default: this process's) under the whole model's names, on the CPU."""
        return {stage.full_name(name): tensor.detach().cpu().contiguous()
                for stage in (self if stages is None else stages) for name, tensor in stage.state_dict().items()}

    # ------------------------------------------------------------ prepare

    def prepare(self, model: nn.Module, task, seed: int, optimizer, train_loader: DataLoader,
                eval_loader: DataLoader, scheduler):
        """What `accelerator.prepare` does for the other strategies: the schedule over this process's stages;
        the loaders sharded over replicas (every stage of a replica reads the same batches); the optimizer
        stepping only when gradients are synchronised; the schedule built."""
        accelerator, self.task = self.accelerator, task
        example = train_loader.collate_fn([train_loader.dataset[0]] * self.args.per_device_train_batch_size)
        self.schedule = self.build_schedule(accelerator, self.activation_shapes(accelerator, example))
        shard = {"device": accelerator.device, "num_processes": self.replicas, "process_index": self.replica,
                 "put_on_device": True}
        train_loader = prepare_data_loader(train_loader, use_seedable_sampler=True, data_seed=seed, **shard)
        # Evaluation in batches of the training batch's shape (the stages' buffers have it), each replica its own
        # examples with none repeated; `evaluate` pads the last batch with ignored rows.
        eval_loader = prepare_data_loader(
            DataLoader(eval_loader.dataset, batch_size=self.args.per_device_train_batch_size,
                       collate_fn=eval_loader.collate_fn), even_batches=False, **shard)
        self.optimizer = optimizer
        return self, AcceleratedOptimizer(optimizer, device_placement=False), train_loader, eval_loader, \
            accelerator.prepare(scheduler)

    def build_schedule(self, accelerator: Accelerator, shapes: list[tuple] | None = None):
        """torch's schedule over this process's stages; `shapes`: each stage's (inputs, outputs), else inferred."""
        from torch.distributed import pipelining

        stages = [pipelining.PipelineStage(stage, index, self.num_stages, accelerator.device, group=self.stage_group,
                                           **({"input_args": shapes[i][0], "output_args": shapes[i][1]} if shapes else {}))
                  for i, (stage, index) in enumerate(zip(self, self.indices))]
        if shapes and self.args.parts.pipeline.pipeline_timeline:
            for stage in stages:
                self.record_timeline(stage)
        schedule_class = getattr(pipelining, SCHEDULES[self.args.parts.pipeline.pipeline_schedule])
        multi = issubclass(schedule_class, pipelining.schedules.PipelineScheduleMulti)
        return schedule_class(stages if multi else stages[0], n_microbatches=self.args.parts.pipeline.pipeline_microbatches,
                              loss_fn=self.loss, scale_grads=False)

    def record_timeline(self, stage) -> None:
        """Wrap the stage's per-micro-batch forward and backward to log (step, stage, micro-batch, kind, start, end)."""
        for kind in ("forward", "backward"):
            method = getattr(stage, f"{kind}_one_chunk")

            def timed(chunk: int, *args, _method=method, _kind=kind, **kwargs):
                start = time.time()
                result = _method(chunk, *args, **kwargs)
                self.timeline.append((self.steps_run, stage.stage_index, chunk, _kind, start, time.time()))
                return result

            setattr(stage, f"{kind}_one_chunk", timed)

    def activation_shapes(self, accelerator: Accelerator, example: dict) -> list[tuple]:
        """Each of this process's stages' input and output (empty tensors of the right shape and dtype), found by
        one step of a throwaway schedule on an example batch. Given to the stages up front, they keep torch from
        inferring them inside the first step by running each stage on uninitialised tensors: in training mode that
        would feed BatchNorm's running statistics garbage (NaN, measured). Here the stages are in eval mode, the
        example's gradients are scaled to zero and dropped, and no random number is drawn outside a fork."""
        probe = self.schedule = self.build_schedule(accelerator)
        self.eval()
        self.loss_scale = 0.0
        with torch.random.fork_rng(devices=[]):
            self.run_schedule(accelerator, {key: value.to(accelerator.device) for key, value in example.items()},
                              train=True, losses=[])
        self.zero_grad(set_to_none=True)
        self.train()
        stages = probe._stages if hasattr(probe, "_stages") else [probe._stage]
        return [tuple(tuple(meta.to_tensor(accelerator.device) for meta in metas)
                      for metas in (stage._stage_meta.inputs, stage._stage_meta.outputs)) for stage in stages]

    # ------------------------------------------------------------ train and evaluate

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss on the last stage: its share of the window's token mean (training), or
        nothing but the task's named sums it adds to the evaluation's totals (`Task.eval_sums`)."""
        batch = {"labels": labels}
        if self.metrics is not None:
            for name, sums in self.task.eval_sums(logits, batch).items():
                self.metrics[name] = self.metrics.get(name, 0.0) + sums.double().sum()
            return torch.zeros((), device=logits.device)
        return self.task.objective_sums(logits, batch).sum() * self.loss_scale

    def run_schedule(self, accelerator: Accelerator, batch: dict, train: bool, losses: list | None = None) -> None:
        inputs = (batch[self.task.model_input],) if self.has_first else ()
        with accelerator.autocast():
            (self.schedule.step if train else self.schedule.eval)(*inputs, target=batch["labels"], losses=losses)

    def forward_backward(self, model: nn.Module, objective, batch: dict, window_targets: torch.Tensor) -> torch.Tensor:
        """One micro-step: the schedule's forward and backward of every micro-batch; returns this process's share
        of the step's loss (the last stage's; zero elsewhere). `window_targets` is counted on every process, so
        each replica's batch once per stage. The last stage computes the task's loss itself (`loss`)."""
        accelerator = self.accelerator
        self.loss_scale = self.args.parts.pipeline.pipeline_parallel_size / window_targets
        losses = []
        self.steps_run += 1
        self.run_schedule(accelerator, batch, train=True, losses=losses)
        if accelerator.sync_gradients and self.replicas > 1:  # the replicas' gradients summed, as DDP averages
            for param in self.parameters():
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=self.replica_group)
        return torch.stack(losses).sum().detach() if losses else torch.zeros((), device=accelerator.device)

    def clip_gradients(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the norm of every stage's gradients, each process holding some stages. Computed as
        `torch.nn.utils.clip_grad_norm_` computes it for the whole model (the norm of the per-tensor norms, in
        the model's parameter order), to the last bit: a model with BatchNorm over small batches amplifies
        a last-bit difference in the clipping factor into a different run within a few steps (measured)."""
        params = [[param for param in stage.parameters() if param.grad is not None] for stage in self]
        norms = [torch.linalg.vector_norm(param.grad) for stage in params for param in stage]
        counts = [len(stage) for stage in params]
        width = self.num_stages * max(self.tensors_per_stage)
        local = torch.zeros(width, device=norms[0].device)  # this process's stages' norms, at their stages' places
        for stage_index, stage_norms in zip(self.indices, torch.stack(norms).split(counts)):
            start = stage_index * max(self.tensors_per_stage)
            local[start:start + len(stage_norms)] = stage_norms
        dist.all_reduce(local, group=self.stage_group)  # every place is filled by exactly one process
        slots = local.view(self.num_stages, -1)
        total = torch.linalg.vector_norm(torch.cat([slots[i, :n] for i, n in enumerate(self.tensors_per_stage)]))
        if math.isfinite(max_norm):
            torch.nn.utils.clip_grads_with_norm_([param for stage in params for param in stage], max_norm, total)
        return total

    @torch.no_grad()
    def evaluate(self, model: nn.Module, dataloader: DataLoader, task, ranks_per_batch: int) -> dict[str, float]:
        """The task's metrics over every example: the schedule forward only, its sums added on the last stage."""
        accelerator = self.accelerator
        self.eval()
        self.metrics = {}
        for batch in dataloader:
            self.run_schedule(accelerator, padded(batch, self.args.per_device_train_batch_size), train=False)
        local, self.metrics = {name: float(total) for name, total in self.metrics.items()}, None
        every = [None] * accelerator.num_processes
        dist.all_gather_object(every, local)  # the last stages' sums, one per replica (other stages: none)
        self.train()
        return task.eval_metrics({name: sum(sums[name] for sums in every if sums) for name in next(filter(None, every))})

    # ------------------------------------------------------------ checkpoints and export

    def save(self, model: nn.Module, optimizer, directory: Path, stamp: dict[str, str]) -> None:
        """One replica saves each stage's weights (saying which run and step they belong to: `stamp`) and this
        process's optimizer state; the core hashes them after."""
        if self.replica != 0:
            return
        for stage, index in zip(self, self.indices):
            save_file(self.full_state_dict([stage]), directory / STAGE_WEIGHTS.format(index=index), metadata=stamp)
        torch.save(self.optimizer.state_dict(), directory / STAGE_OPTIMIZER.format(rank=self.stage_rank))

    def load(self, model: nn.Module, optimizer, scheduler, directory: Path) -> None:
        """Every replica restores its stages' weights and (`optimizer` None: an evaluation, not) their optimizer
        state, under this run's settings (its groups' rates, decay, betas), at the rate of the step to come."""
        for stage, index in zip(self, self.indices):
            saved = load_file(directory / STAGE_WEIGHTS.format(index=index))
            stage.load_state_dict({name: saved[stage.full_name(name)] for name in stage.state_dict()})
        if optimizer is None:
            return
        saved = torch.load(directory / STAGE_OPTIMIZER.format(rank=self.stage_rank), weights_only=True)
        self.optimizer.load_state_dict(saved | {"param_groups": self.optimizer.state_dict()["param_groups"]})
        set_next_rate(self.optimizer, getattr(scheduler, "scheduler", scheduler))

    def export(self, model: nn.Module, task, final_dir: Path) -> Path:
        """The whole model in `final_dir` as `transformers` saves it: every stage's weights gathered to rank 0."""
        accelerator, processor = self.accelerator, task.processor
        gathered = [None] * accelerator.num_processes if accelerator.is_main_process else None
        dist.gather_object(self.full_state_dict() if self.replica == 0 else None, gathered, dst=0)
        if self.args.parts.pipeline.pipeline_timeline:
            timelines = [None] * accelerator.num_processes if accelerator.is_main_process else None
            dist.gather_object(self.timeline if self.replica == 0 else [], timelines, dst=0)
            if accelerator.is_main_process:
                events = [dict(zip(("step", "stage", "micro_batch", "kind", "start", "end"), event))
                          for timeline in timelines for event in timeline]
                (final_dir.parent / "pipeline_timeline.json").write_text(json.dumps(events))
        if accelerator.is_main_process:
            merged = {name: tensor for part in gathered if part for name, tensor in part.items()}
            self.whole_model.load_state_dict(merged, assign=True)
            self.whole_model.save_pretrained(final_dir)
            processor.save_pretrained(final_dir)
        accelerator.wait_for_everyone()
        return final_dir


def padded(batch: dict, rows: int) -> dict:
    """`batch` with rows appended up to `rows`: copies of its first row whose labels are all ignored."""
    missing = rows - len(batch["labels"])
    if missing == 0:
        return batch
    ignored = {key: torch.cat([value, value[:1].expand(missing, *value.shape[1:])]) for key, value in batch.items()}
    ignored["labels"][-missing:] = IGNORE_INDEX
    return ignored
