"""Train a causal language model or an image classifier with DDP, FSDP2 or DeepSpeed ZeRO, chosen by config file only.

    accelerate launch train.py                                               # one process, defaults
    accelerate launch --config_file accelerate_configs/fsdp.yaml train.py    # any strategy, same code
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --config recipe.yaml --max_steps 100
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --task image-classification

The strategy never appears below: `training/distributed.py` builds the Accelerator and
checks that what runs is what the config file asked for. The task never does either:
`training/tasks.py` builds the model and data and turns logits into a loss.
"""

from __future__ import annotations

if __name__ == "__main__":  # first of all, before the libraries load: see training/preemption.py
    import sys

    from training.preemption import install_stop_handlers

    install_stop_handlers()
    if {"-h", "--help"} & set(sys.argv[1:]):  # answered before torch loads: under 2 s
        from training.flags import build_parser

        build_parser().print_help()
        sys.exit(0)

import math
import os
import sys
import time
from pathlib import Path

import psutil
import torch
from accelerate.logging import get_logger
from accelerate.utils import (
    DataLoaderConfiguration,
    GradientAccumulationPlugin,
    ProjectConfiguration,
    TorchDynamoPlugin,
    set_seed,
)
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from data import DataError
from models.language import ModelError
from training.arguments import ArgumentError, parse_args
from training.batchnorm import convert_sync_batchnorm
from training.checkpoint import (
    ResumeError,
    TrainerState,
    clear_previous_run,
    export_final,
    load_checkpoint,
    resolve_resume_path,
    save_checkpoint,
)
from training.collectives import (
    CollectiveTimeoutError,
    collective_timeouts_reported,
    end_collectives,
    gather_scalars,
    preflight,
)
from training.console import one_voice, only_the_training_bar, quiet_third_party_output
from training.cuda_settings import loader_workers, tune_convolutions, use_tf32
from training.distributed import (
    align_with_strategy,
    apply_tensor_parallel,
    build_accelerator,
    clip_gradients,
    data_parallel_size,
    describe,
    gradient_reduction_dtypes,
    held_gradients,
    idle_gpu_warning,
    master_weight_dtypes,
    model_construction,
    optimizer_offload_device,
    release_model_construction_hooks,
    tensor_parallel_size,
    verify_prepared,
    verify_strategy,
    write_effective_deepspeed_config,
)
from training.dry_run import dry_run
from training.errors import StrategyError
from training.evaluation import evaluate
from training.layer_split import split_layers
from training.loss import NonFiniteGuard, NonFiniteLossError, accumulation_windows
from training.metrics import MetricsLogger, tracker_config, write_summary
from training.optim import build_optimizer, build_scheduler, global_batch_size, run_length
from training.performance import (
    SpeedMeter,
    compute_dtype,
    model_state_probe,
    parameter_count,
    peak_flops,
)
from training.preemption import Preempted, install_stop_handlers
from training.process_exit import exit_process
from training.report import write_report
from training.tasks import TASKS, Task

logger = get_logger(__name__)
EXIT_BAD_INPUT = 2  # a flag, file, config or checkpoint that cannot work; the message says which
EXIT_NONFINITE_LOSS = 3  # the loss became NaN/inf; nothing was saved from that point on
EXIT_COLLECTIVE_TIMEOUT = 4  # a collective waited longer than --ddp_timeout (a rank stalled or died)
EXIT_PREEMPTED = 75  # SIGTERM/SIGUSR1: saved a checkpoint; rerun with --resume_from_checkpoint latest (EX_TEMPFAIL)


def main() -> None:
    stop_requests = install_stop_handlers()  # SIGTERM/SIGUSR1 (already, as __main__): finish the step, save, exit 75
    model_args, data_args, args = parse_args()
    quiet_third_party_output()
    if args.dry_run:  # one process, no process group: see training/dry_run.py
        if plan := dry_run(model_args, data_args, args):
            print(plan)
        return
    accelerator = build_accelerator(
        args.ddp_timeout,
        # Synchronise by step count only: train.py reads a whole window ahead (see
        # accumulation_windows), so the dataloader's end is seen before the window's last step.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False
        ),
        # We step the scheduler once per optimizer step ourselves: accelerate would step it
        # once per process, making the schedule depend on the number of processes.
        step_scheduler_with_optimizer=False,
        # A seedable sampler makes the shuffled order depend only on seed and epoch, so a
        # resumed run sees the same samples as an uninterrupted one.
        dataloader_config=DataLoaderConfiguration(
            use_seedable_sampler=True, data_seed=args.seed, non_blocking=args.dataloader_pin_memory
        ),
        log_with=args.report_to or None,  # TensorBoard writes to output_dir/runs/<run_name>
        project_config=ProjectConfiguration(project_dir=args.output_dir, logging_dir=os.path.join(args.output_dir, "runs")),
        dynamo_plugin=TorchDynamoPlugin(backend="inductor" if args.torch_compile else "no"),
    )
    strategy = verify_strategy(accelerator)
    one_voice(accelerator.is_main_process)  # the other ranks report errors only
    tf32 = use_tf32(args.tf32, accelerator.device, accelerator.mixed_precision)
    run_description = f"{describe(accelerator, strategy)} tf32={'on' if tf32 else 'off'}"
    logger.info(run_description, main_process_only=True)
    logger.info(preflight(accelerator, args.ddp_timeout), main_process_only=True)
    if warning := idle_gpu_warning(accelerator, owns_every_gpu=bool(model_args.device_map)):
        logger.warning(warning, main_process_only=True)
    stop_requests.connect(accelerator, args.ddp_timeout)  # from now on ranks agree on a stop
    set_seed(args.seed)  # identical initial weights on every rank and strategy

    # ---- model and data ----
    task = TASKS[model_args.task](model_args, data_args)
    tune_convolutions(accelerator.device, task.fixed_input_shapes)
    with accelerator.main_process_first():  # the main process downloads; the others then read its cache
        raw = task.load_raw_datasets(args.seed)
    with model_construction(accelerator, bool(model_args.model_name_or_path), task.can_build_empty) as empty:
        model = task.build_model(raw, empty)
    set_seed(args.seed)  # ranks that built the model empty drew no random numbers: every rank goes on level
    model = apply_tensor_parallel(accelerator, model)  # with a parallelism_config tp_size in the accelerate config
    if model_args.device_map:  # one process owning several GPUs: each holds some of the layers
        model, note = split_layers(model, model_args.device_map)
        logger.info(note, main_process_only=True)
    if model_args.sync_batchnorm:
        model, note = convert_sync_batchnorm(model, accelerator)
        logger.info(note, main_process_only=True)
    model_name = model_args.model_name_or_path or model_args.model_config
    num_parameters = parameter_count(model)
    train_set, eval_set = task.datasets(raw, accelerator.main_process_first())
    global_batch = global_batch_size(args, data_parallel_size(accelerator))
    steps_per_epoch, max_steps = run_length(len(train_set), len(eval_set), global_batch, args)
    train_set = train_set.select(range(steps_per_epoch * global_batch))
    # Pinned host memory lets batches copy to the GPU while it computes (non_blocking above).
    workers = loader_workers(args.dataloader_num_workers, accelerator.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    loading = {"collate_fn": task.collator, "num_workers": workers,
               "pin_memory": args.dataloader_pin_memory and accelerator.device.type == "cuda"}
    train_loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True, **loading)
    eval_loader = DataLoader(eval_set, batch_size=args.per_device_eval_batch_size, **loading)

    align_with_strategy(accelerator, model, args.max_grad_norm, args.per_device_train_batch_size)
    torch_optimizer = build_optimizer(model, args, offloaded=optimizer_offload_device(accelerator) != "none")
    scheduler = build_scheduler(torch_optimizer, args, max_steps)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, torch_optimizer, train_loader, eval_loader, scheduler
    )
    model_state = model_state_probe(model, torch_optimizer, lambda: held_gradients(model))  # bytes per rank, at step 2
    verify_prepared(accelerator, model, optimizer, scheduler, args.per_device_train_batch_size, args.max_grad_norm)
    write_effective_deepspeed_config(accelerator, args.output_dir)
    logger.info(
        f"model wrapped as {type(model).__name__}; optimizer {type(torch_optimizer).__name__} (--optim {args.optim}), "
        f"master weights {', '.join(str(d) for d in master_weight_dtypes(model, optimizer))}, "
        f"gradients averaged in {', '.join(str(d) for d in gradient_reduction_dtypes(model))}",
        main_process_only=True,
    )

    state = TrainerState(global_batch=global_batch, num_processes=accelerator.num_processes)
    resume_path = resolve_resume_path(args.resume_from_checkpoint, args.output_dir, accelerator)
    if resume_path:
        state = load_checkpoint(accelerator, resume_path, global_batch, max_steps)
        state.num_processes = accelerator.num_processes
        logger.info(f"resumed from {resume_path} at step {state.completed_steps}", main_process_only=True)
    if args.overwrite_output_dir:  # only now: every check before has passed
        if accelerator.is_main_process:
            clear_previous_run(args.output_dir)
        accelerator.wait_for_everyone()
    run_settings = {"strategy": strategy.value, "num_processes": accelerator.num_processes,
                    "mixed_precision": accelerator.mixed_precision, "global_batch": global_batch,
                    "total_steps": max_steps, "parameters": num_parameters, **task.settings}
    accelerator.init_trackers(
        args.run_name,
        config=tracker_config(vars(model_args) | vars(data_args) | vars(args) | run_settings),
        # A resumed run replaces what the run it continues logged after its checkpoint.
        init_kwargs={"tensorboard": {"purge_step": state.completed_steps + 1 if resume_path else 0},
                     "wandb": {"name": args.run_name}},
    )
    logger.info(
        f"{task.describe_data(train_set)}, global batch {global_batch}, {steps_per_epoch} steps/epoch, "
        f"training to step {max_steps}, {len(eval_set)} examples for evaluation",
        main_process_only=True,
    )

    # ---- train ----
    metrics = MetricsLogger(accelerator, args.output_dir, state.completed_steps if resume_path else None)
    if state.completed_steps == 0 and args.eval_on_start and args.eval_strategy != "no":
        metrics.log(0, **evaluate(model, eval_loader, accelerator, task))
    clip_norm = args.max_grad_norm if args.max_grad_norm > 0 else math.inf  # inf: measure, never clip
    peak = peak_flops(accelerator.device, compute_dtype(accelerator.mixed_precision), tf32)
    model_devices = sorted({p.device for p in model.parameters()}, key=str) if model_args.device_map else None
    speed = SpeedMeter(accelerator.device, task.flops_per_unit, peak, task.unit, tensor_parallel_size(accelerator),
                       memory_devices=model_devices)
    interval_loss, interval_steps = torch.zeros((), device=accelerator.device), 0
    nonfinite = NonFiniteGuard(accelerator.device, loss_scaling=accelerator.mixed_precision == "fp16")
    grad_norm = math.nan  # set at every optimizer step
    # One bar, on the main process: steps, ETA, and the last logged loss, lr and tokens/s.
    only_the_training_bar()
    progress = tqdm(total=max_steps, initial=state.completed_steps, desc="training", unit="step",
                    disable=not accelerator.is_main_process)
    first_step = state.completed_steps
    eval_result: dict[str, float] = {}
    train_loss = math.nan  # the last logged
    report_title = f"{model_name}: {run_description}"
    with collective_timeouts_reported(accelerator, args.ddp_timeout, lambda: state.completed_steps + 1):
        while state.completed_steps < max_steps:
            train_loader.set_epoch(state.epoch)  # before skipping, or a resume replays another order
            # Skipping by optimizer steps, not by this process's batches, keeps the position right
            # when a checkpoint resumes on a different number of processes.
            batches = accelerator.skip_first_batches(train_loader, state.steps_in_epoch * args.gradient_accumulation_steps)
            for window in accumulation_windows(batches, args.gradient_accumulation_steps):
                speed.start_step()
                # The loss is the mean over every target (token, or image) of the global batch (all
                # micro-batches on all ranks), not a mean of per-batch means, so padded batches weigh by their tokens.
                window_targets = accelerator.reduce(sum(task.count_targets(batch) for batch in window), "sum")
                step_loss = torch.zeros((), device=accelerator.device)
                for batch in window:
                    with accelerator.accumulate(model):
                        logits = task.forward(model, batch)
                        loss = task.loss_sums(logits, batch)[0].sum() / window_targets
                        del logits  # e.g. tokens x vocabulary floats: freed now, not after the optimizer step
                        # Every strategy averages gradients over micro-steps and processes; scale back up
                        # so the update is the gradient of the global token mean. (Tensor parallelism averages
                        # over data-parallel ranks only, and its tp ranks each counted the window's targets.)
                        accelerator.backward(loss * args.gradient_accumulation_steps * accelerator.num_processes)
                        if accelerator.sync_gradients:
                            grad_norm = clip_gradients(accelerator, model, clip_norm)
                        optimizer.step()
                        optimizer.zero_grad()
                    step_loss += loss.detach()  # stays on device: no host sync in the hot loop
                lr = scheduler.get_last_lr()[0]  # the rate this step's update used
                scheduler.step()
                state.completed_steps += 1
                state.steps_in_epoch += 1
                interval_loss += step_loss
                nonfinite.update(state.completed_steps, step_loss, grad_norm)
                interval_steps += 1
                step = state.completed_steps
                log_now = step % args.logging_steps == 0 or step == max_steps or (args.logging_first_step and step == 1)
                speed.end_step(sum(task.count_units(batch) for batch in window), synchronize=log_now)
                progress.update(1)
                epoch_end = state.steps_in_epoch == steps_per_epoch
                eval_now = args.eval_strategy != "no" and (due(args.eval_strategy, args.eval_steps, step, epoch_end)
                                                           or step == max_steps)
                save_due = due(args.save_strategy, args.save_steps, step, epoch_end)
                # every rank stops after the same step: agreed every few steps, and on the steps that wait anyway
                stop_signal = stop_requests.agreed(step, now=log_now or eval_now or save_due or epoch_end)
                save_now = save_due or stop_signal is not None
                if log_now or eval_now or save_now:
                    # One collective and one wait for the device: the non-finite check, and the logged figures.
                    logged = {"loss": interval_loss, "grad_norm": grad_norm} | speed.interval() if log_now else {}
                    ranks = gather_scalars(accelerator, nonfinite.local() | logged)
                    nonfinite.check(ranks)  # before anything is logged, saved or exported

                if log_now:
                    train_loss = float(ranks["loss"].sum()) / interval_steps
                    interval_loss.zero_()
                    interval_steps = 0
                    speed_now = speed.report(ranks)
                    metrics.log(step, loss=train_loss, lr=lr, grad_norm=float(ranks["grad_norm"].max()), **speed_now,
                                **nonfinite.logged(ranks))
                    progress.set_postfix({"loss": f"{train_loss:.3f}", "lr": f"{lr:.2e}",
                                          f"{task.unit}_per_s": f"{speed_now[f'{task.unit}_per_sec']:,.0f}"})
                if eval_now:
                    eval_result = evaluate(model, eval_loader, accelerator, task)
                    metrics.log(step, **eval_result)
                    if accelerator.is_main_process:
                        progress.write(f"step {step}: eval_loss {eval_result['eval_loss']:.4f}")
                if save_now:
                    saved = save_checkpoint(accelerator, model, args.output_dir, state, args.save_total_limit)
                    if accelerator.is_main_process:
                        progress.write(f"step {step}: saved {saved}")
                if step >= max_steps:
                    break
                if stop_signal:
                    end_collectives(accelerator)  # flush the trackers
                    if accelerator.is_main_process:
                        write_report(args.output_dir, report_title)
                    raise Preempted(
                        f"{stop_signal} received: stopped after step {step} and saved {saved}; "
                        "continue with --resume_from_checkpoint latest"
                    )
            else:  # the epoch ran out before max_steps
                state.epoch, state.steps_in_epoch = state.epoch + 1, 0
    progress.close()

    # ---- export and summary ----
    final_dir = export_final(accelerator, model, task.processor, args.output_dir)
    steps_run = state.completed_steps - first_step
    summary = {  # gathered from every rank: before end_training closes the process group
        "strategy": strategy.value,
        "processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "parameters": num_parameters,
        "task": task.name,
        "model": model_name,
        "steps": steps_run,
        "total_steps": state.completed_steps,
        "wall_time_s": time.time() - psutil.Process().create_time(),
        **speed.report(gather_scalars(accelerator, speed.whole_run(steps_run))),
        "model_state_bytes_per_rank": max_over_ranks(model_state, accelerator),
        "train_loss": train_loss,
        **eval_result,
    }
    end_collectives(accelerator)
    release_model_construction_hooks()
    if accelerator.is_main_process:
        write_summary(args.output_dir, summary)
        write_report(args.output_dir, report_title)
        print_summary(summary, final_dir, task)


def due(strategy: str, every: int, step: int, epoch_end: bool) -> bool:
    """Whether an --eval_strategy/--save_strategy interval ("steps", "epoch" or "no") falls on this step."""
    return {"steps": step % every == 0, "epoch": epoch_end, "no": False}[strategy]


def max_over_ranks(values: dict[str, int], accelerator) -> dict[str, int]:
    """Each value's largest over the ranks (a collective, unless nothing was measured: the same on every rank)."""
    return {key: int(column.max()) for key, column in gather_scalars(accelerator, values).items()} if values else {}


def print_summary(summary: dict, final_dir: Path, task: Task) -> None:
    """Load the export with plain `transformers` (proving it loads) and show what it does."""
    sample = task.sample(final_dir)
    model_state = summary["model_state_bytes_per_rank"]
    state = f"{sum(model_state.values()) / 2**20:,.1f} MiB" if model_state else "not measured (needs 2 optimizer steps)"
    mfu = f"{summary['mfu']:.1%}" if "mfu" in summary else "n/a (unknown device peak)"
    per_device = "".join(f", {key.removeprefix('peak_memory_gb_')} {gb:.2f}" for key, gb in summary.items()
                         if key.startswith("peak_memory_gb_"))
    evaluation = ", ".join(f"{key} {value:.4f}" for key, value in summary.items() if key.startswith("eval_") or key == "perplexity")
    print(
        "\n===== training summary =====\n"
        f"steps:           {summary['steps']}\n"
        f"{task.unit + '/s:':<17}{summary[f'{task.unit}_per_sec']:,.0f} ({summary['step_time'] * 1000:,.0f} ms/step, MFU {mfu})\n"
        f"memory/rank:     peak {summary['peak_memory_gb']:.2f} GiB{per_device}, model state {state}\n"
        f"final eval:      {evaluation or 'none (--eval_strategy no)'}\n"
        f"model:           {final_dir}\n"
        f"sample:          {sample}"
    )


def run() -> int:
    """`main()`, with each documented failure turned into one error line and its exit code."""
    try:
        main()
    except (ArgumentError, DataError, ModelError, StrategyError, ResumeError, FileNotFoundError) as error:
        report(f"error: {error}")
        return EXIT_BAD_INPUT
    except NonFiniteLossError as error:
        report(f"error: {error}")
        return EXIT_NONFINITE_LOSS
    except CollectiveTimeoutError as error:
        report(f"error: {error}", every_rank=True)  # each waiting rank names itself
        return EXIT_COLLECTIVE_TIMEOUT
    except Preempted as stop:
        report(f"stopped: {stop}")
        return EXIT_PREEMPTED
    return 0


def report(line: str, every_rank: bool = False) -> None:
    """Print `line` once per machine: the ranks of one machine read the same flags, files and data,
    so they fail alike (another machine may not: a file missing there, a failed download)."""
    if every_rank or os.environ.get("LOCAL_RANK", "0") == "0":
        print(f"\n{line}", file=sys.stderr)  # on its own line, even after a progress bar


if __name__ == "__main__":
    exit_process(run())  # not sys.exit: see training/process_exit.py (gloo can abort a finished rank at teardown)
