"""Train a causal language model with DDP, FSDP2 or DeepSpeed ZeRO, chosen by config file only.

    accelerate launch train.py                                               # one process, defaults
    accelerate launch --config_file accelerate_configs/fsdp.yaml train.py    # any strategy, same code
    accelerate launch --config_file accelerate_configs/ddp.yaml train.py --config recipe.yaml --max_steps 100

The strategy never appears below: `training/distributed.py` builds the Accelerator and
checks that what runs is what the config file asked for.
"""

from __future__ import annotations

import math
import os
import sys
import time

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
from transformers import AutoModelForCausalLM, AutoTokenizer

from data import DataError, build_lm_datasets, load_raw_datasets, make_collator
from models import ModelError, build_model, build_tokenizer, resolve_block_size
from training.arguments import ArgumentError, parse_args
from training.checkpoint import (
    ResumeError,
    TrainerState,
    export_final,
    load_checkpoint,
    resolve_resume_path,
    save_checkpoint,
)
from training.collectives import CollectiveTimeoutError, collective_timeouts_reported, preflight
from training.console import one_voice, only_the_training_bar, quiet_third_party_output
from training.distributed import (
    StrategyError,
    align_deepspeed_config,
    build_accelerator,
    describe,
    held_gradients,
    master_weight_dtypes,
    model_construction,
    release_model_construction_hooks,
    verify_prepared,
    verify_strategy,
    write_effective_deepspeed_config,
)
from training.evaluation import evaluate
from training.loss import (
    NonFiniteGuard,
    NonFiniteLossError,
    accumulation_windows,
    count_target_tokens,
    token_loss_sums,
)
from training.metrics import MetricsLogger, to_float, tracker_config, write_summary
from training.optim import build_optimizer, build_scheduler
from training.performance import (
    SpeedMeter,
    compute_dtype,
    flops_per_token,
    model_state_probe,
    parameter_count,
    peak_flops,
)
from training.preemption import Preempted, install_stop_handlers
from training.report import write_report

logger = get_logger(__name__)
SAMPLE_PROMPT = "Once upon a time"
EXIT_BAD_INPUT = 2  # a flag, file, config or checkpoint that cannot work; the message says which
EXIT_NONFINITE_LOSS = 3  # the loss became NaN/inf; nothing was saved from that point on
EXIT_COLLECTIVE_TIMEOUT = 4  # a collective waited longer than --ddp_timeout (a rank stalled or died)
EXIT_PREEMPTED = 75  # SIGTERM/SIGUSR1: saved a checkpoint; rerun with --resume_from_checkpoint latest (EX_TEMPFAIL)


def main() -> None:
    model_args, data_args, args = parse_args()
    quiet_third_party_output()
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
    run_description = describe(accelerator, strategy)
    logger.info(run_description, main_process_only=True)
    logger.info(preflight(accelerator, args.ddp_timeout), main_process_only=True)
    stop_requests = install_stop_handlers(accelerator, args.ddp_timeout)  # SIGTERM/SIGUSR1: save, then exit 75
    set_seed(args.seed)  # identical initial weights on every rank and strategy

    # ---- model and data ----
    tokenizer = build_tokenizer(model_args.model_name_or_path, model_args.tokenizer_name, model_args.trust_remote_code)
    with model_construction(accelerator):
        model = build_model(
            model_args.model_name_or_path,
            model_args.model_config,
            tokenizer,
            model_args.trust_remote_code,
            model_args.gradient_checkpointing,
        )
    model_name = model_args.model_name_or_path or model_args.model_config
    block_size = resolve_block_size(data_args.block_size, model.config)
    model_flops_per_token, num_parameters = flops_per_token(model, block_size), parameter_count(model)
    with accelerator.main_process_first():  # the main process downloads; the others then read its cache
        raw = load_raw_datasets(
            data_args.dataset_name,
            data_args.dataset_config_name,
            data_args.train_file,
            data_args.validation_file,
            data_args.validation_split_percentage,
            args.seed,
        )
    train_set, eval_set = build_lm_datasets(
        raw, tokenizer, data_args.text_column, block_size, accelerator.main_process_first(), data_args.packing
    )
    collator = make_collator(tokenizer, data_args.packing)
    # Every optimizer step sees one full global batch: a partial last one would weigh less
    # under accumulation, so the last len % global_batch sequences are left out every epoch.
    global_batch = args.per_device_train_batch_size * accelerator.num_processes * args.gradient_accumulation_steps
    steps_per_epoch = len(train_set) // global_batch
    if steps_per_epoch == 0 or len(eval_set) == 0:
        raise ArgumentError(
            f"{len(train_set)} training and {len(eval_set)} validation sequences of up to {block_size} tokens: need at "
            f"least one global batch of {global_batch} and one validation sequence; use more data or smaller batches"
        )
    train_set = train_set.select(range(steps_per_epoch * global_batch))
    # Pinned host memory lets batches copy to the GPU while it computes (non_blocking above).
    loading = {"collate_fn": collator, "num_workers": args.dataloader_num_workers,
               "pin_memory": args.dataloader_pin_memory and accelerator.device.type == "cuda"}
    train_loader = DataLoader(train_set, batch_size=args.per_device_train_batch_size, shuffle=True, **loading)
    eval_loader = DataLoader(eval_set, batch_size=args.per_device_eval_batch_size, **loading)
    max_steps = args.max_steps if args.max_steps > 0 else math.ceil(args.num_train_epochs * steps_per_epoch)

    torch_optimizer = build_optimizer(model, args.learning_rate, args.weight_decay)
    scheduler = build_scheduler(torch_optimizer, args.lr_scheduler_type, args.warmup_steps, max_steps)
    align_deepspeed_config(accelerator, args.max_grad_norm)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, torch_optimizer, train_loader, eval_loader, scheduler
    )
    model_state = model_state_probe(model, torch_optimizer, lambda: held_gradients(model))  # bytes per rank, at step 2
    verify_prepared(accelerator, model, optimizer, scheduler, args.per_device_train_batch_size, args.max_grad_norm)
    write_effective_deepspeed_config(accelerator, args.output_dir)
    logger.info(
        f"model wrapped as {type(model).__name__}; optimizer master weights "
        f"{', '.join(str(d) for d in master_weight_dtypes(model, optimizer))}",
        main_process_only=True,
    )

    state = TrainerState(global_batch=global_batch, num_processes=accelerator.num_processes)
    resume_path = resolve_resume_path(args.resume_from_checkpoint, args.output_dir, accelerator)
    if resume_path:
        state = load_checkpoint(accelerator, resume_path, global_batch, max_steps)
        state.num_processes = accelerator.num_processes
        logger.info(f"resumed from {resume_path} at step {state.completed_steps}", main_process_only=True)
    run_settings = {"strategy": strategy.value, "num_processes": accelerator.num_processes,
                    "mixed_precision": accelerator.mixed_precision, "global_batch": global_batch,
                    "block_size": block_size, "total_steps": max_steps, "parameters": num_parameters}
    accelerator.init_trackers(
        args.run_name,
        config=tracker_config(vars(model_args) | vars(data_args) | vars(args) | run_settings),
        # A resumed run replaces what the run it continues logged after its checkpoint.
        init_kwargs={"tensorboard": {"purge_step": state.completed_steps + 1 if resume_path else 0},
                     "wandb": {"name": args.run_name}},
    )
    logger.info(
        f"{len(train_set)} sequences of up to {block_size} tokens, global batch {global_batch}, "
        f"{steps_per_epoch} steps/epoch, training to step {max_steps}",
        main_process_only=True,
    )

    # ---- train ----
    metrics = MetricsLogger(accelerator, args.output_dir, state.completed_steps if resume_path else None)
    if state.completed_steps == 0 and args.eval_on_start:
        metrics.log(0, **evaluate(model, eval_loader, accelerator))
    clip_norm = args.max_grad_norm if args.max_grad_norm > 0 else math.inf  # inf: measure, never clip
    speed = SpeedMeter(accelerator.device, model_flops_per_token, peak_flops(accelerator.device, compute_dtype(accelerator.mixed_precision)))
    interval_loss, interval_steps = torch.zeros((), device=accelerator.device), 0
    nonfinite = NonFiniteGuard(accelerator.device)
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
                # The loss is the mean over every target token of the global batch (all micro-batches
                # on all ranks), not a mean of per-batch means, so padded batches weigh by their tokens.
                window_tokens = accelerator.reduce(sum(count_target_tokens(batch) for batch in window), "sum")
                step_loss = torch.zeros((), device=accelerator.device)
                for batch in window:
                    with accelerator.accumulate(model):
                        logits = model(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask")).logits
                        loss = token_loss_sums(logits, batch["labels"])[0].sum() / window_tokens
                        del logits  # tokens x vocabulary floats: freed now, not after the optimizer step
                        # Every strategy averages gradients over micro-steps and processes; scale back up
                        # so the update is the gradient of the global token mean.
                        accelerator.backward(loss * args.gradient_accumulation_steps * accelerator.num_processes)
                        if accelerator.sync_gradients:
                            grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip_norm)
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
                speed.end_step(sum(batch["input_ids"].numel() for batch in window))
                progress.update(1)
                step = state.completed_steps
                stop_signal = stop_requests.agreed()  # every rank stops after the same step
                log_now = step % args.logging_steps == 0 or step == max_steps
                eval_now = step % args.eval_steps == 0 or step == max_steps
                save_now = step % args.save_steps == 0 or stop_signal is not None
                if log_now or eval_now or save_now:
                    nonfinite.check(accelerator)  # before anything is logged, saved or exported

                if log_now:
                    train_loss = accelerator.reduce(interval_loss, "sum").item() / interval_steps
                    interval_loss.zero_()
                    interval_steps = 0
                    speed_now = speed.report(accelerator.gather)
                    metrics.log(step, loss=train_loss, lr=lr, grad_norm=to_float(grad_norm), **speed_now)
                    progress.set_postfix(loss=f"{train_loss:.3f}", lr=f"{lr:.2e}", tokens_per_s=f"{speed_now['tokens_per_sec']:,.0f}")
                if eval_now:
                    eval_result = evaluate(model, eval_loader, accelerator)
                    metrics.log(step, **eval_result)
                    if accelerator.is_main_process:
                        progress.write(f"step {step}: eval_loss {eval_result['eval_loss']:.4f}")
                if save_now:
                    saved = save_checkpoint(accelerator, args.output_dir, state, args.save_total_limit)
                    if accelerator.is_main_process:
                        progress.write(f"step {step}: saved {saved}")
                if step >= max_steps:
                    break
                if stop_signal:
                    accelerator.end_training()  # flush the trackers
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
    final_dir = export_final(accelerator, model, tokenizer, args.output_dir)
    steps_run = state.completed_steps - first_step
    summary = {  # gathered from every rank: before end_training closes the process group
        "strategy": strategy.value,
        "processes": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision,
        "parameters": num_parameters,
        "model": model_name,
        "steps": steps_run,
        "total_steps": state.completed_steps,
        "wall_time_s": time.time() - psutil.Process().create_time(),
        **speed.run_report(accelerator.gather, steps_run),
        "model_state_bytes_per_rank": max_over_ranks(model_state, accelerator),
        "train_loss": train_loss,
        **eval_result,
    }
    accelerator.end_training()
    release_model_construction_hooks()
    if accelerator.is_main_process:
        write_summary(args.output_dir, summary)
        write_report(args.output_dir, report_title)
        print_summary(summary, final_dir)


def max_over_ranks(values: dict[str, int], accelerator) -> dict[str, int]:
    """Each value's largest over the ranks (a collective); empty if nothing was measured."""
    keys = sorted(values)
    mine = torch.tensor([[values[key] for key in keys]], dtype=torch.float64, device=accelerator.device)
    return {key: int(value) for key, value in zip(keys, accelerator.gather(mine).max(dim=0).values.tolist())}


def print_summary(summary: dict, final_dir) -> None:
    """Load the export with plain `transformers` (proving it loads) and show a sample."""
    model = AutoModelForCausalLM.from_pretrained(final_dir)
    tokenizer = AutoTokenizer.from_pretrained(final_dir)
    inputs = tokenizer(SAMPLE_PROMPT, return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=40, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    sample = tokenizer.decode(output[0], skip_special_tokens=True)
    state = sum(summary["model_state_bytes_per_rank"].values()) / 2**20
    mfu = f"{summary['mfu']:.1%}" if "mfu" in summary else "n/a (unknown device peak)"
    print(
        "\n===== training summary =====\n"
        f"steps:           {summary['steps']}\n"
        f"tokens/s:        {summary['tokens_per_sec']:,.0f} ({summary['step_time'] * 1000:,.0f} ms/step, MFU {mfu})\n"
        f"memory/rank:     peak {summary['peak_memory_gb']:.2f} GiB, model state {state:,.1f} MiB\n"
        f"final eval loss: {summary.get('eval_loss', float('nan')):.4f} "
        f"(perplexity {summary.get('perplexity', float('nan')):.2f})\n"
        f"model:           {final_dir}\n"
        f"sample:          {sample!r}"
    )


if __name__ == "__main__":
    try:
        main()
    except (ArgumentError, DataError, ModelError, StrategyError, ResumeError, FileNotFoundError) as error:
        print(f"\nerror: {error}", file=sys.stderr)  # on its own line, even after a progress bar
        sys.exit(EXIT_BAD_INPUT)
    except NonFiniteLossError as error:
        print(f"\nerror: {error}", file=sys.stderr)
        sys.exit(EXIT_NONFINITE_LOSS)
    except CollectiveTimeoutError as error:
        print(f"\nerror: {error}", file=sys.stderr)
        sys.exit(EXIT_COLLECTIVE_TIMEOUT)
    except Preempted as stop:
        if os.environ.get("RANK", "0") == "0":  # every rank stopped at the same step: one report
            print(f"\nstopped: {stop}", file=sys.stderr)
        sys.exit(EXIT_PREEMPTED)
