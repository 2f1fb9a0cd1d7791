"""Where a train.py run's time goes: torch.profiler over a few optimizer steps, kernels grouped by kind.

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 1 --mixed_precision bf16 \\
      scripts/profile_run.py --skip_steps 20 --profile_steps 3 [--json out.json] <train.py's flags>

Runs train.py unchanged in this process: a global optimizer-step hook (torch's, so no train.py edit)
advances the profiler, which records `--profile_steps` optimizer steps after `--skip_steps` (warm-up,
compilation, autotuning). The main process prints its device's kernels (the CPU's operators on a
machine without a GPU): the top `--top` by time, then the share of each kind (matrix multiplies,
attention, loss, other elementwise and reductions, optimizer, communication, copies), as per-step
milliseconds; on a CPU, then, the step's time by phase (data, forward and its output layer, the loss, backward,
optimizer, the rest) and the host syncs by what asked for them (docs/performance.md). That names what a speed lever
would have to remove (docs/gpus.md), and
`--sdpa_backends` narrows which attention kernels torch may choose; `--causal_mask_skip`
gives an older torch (a GPU image's 2.11) the pinned 2.13's compiled attention. On a GPU the host runs
ahead of the device, so the window also holds kernels queued by the steps just before it: read the
shares and each kernel's time per call, not the step total.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import sys
from pathlib import Path

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, schedule

REPO = Path(__file__).resolve().parents[1]
# First match wins: attention before matmul (flash kernels name their gemms), loss before elementwise.
KINDS = [("communication", r"nccl|allreduce|all_reduce|gloo|broadcast|reduce_scatter|all_gather"),
         ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product|cudnn.*(mha|sdpa)"),
         ("matmul", r"gemm|cutlass|xmma|nvjet|cublas|sm90_|triton_tem|aten::(mm|addmm|bmm|matmul|linear)\b"),
         ("loss", r"cross_entropy|nll_loss|log_softmax|softmax"),
         ("optimizer", r"adam|multi_tensor|foreach"),
         ("copies", r"memcpy|memset|aten::(copy_|to|_to_copy|clone|contiguous)\b")]


# torch picks the first that can run a call (cuDNN's, on Hopper): these switches take the others out of its choice
SDPA_BACKENDS = {"flash": torch.backends.cuda.enable_flash_sdp, "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
                 "cudnn": torch.backends.cuda.enable_cudnn_sdp, "math": torch.backends.cuda.enable_math_sdp}


def skip_causal_mask_under_compile() -> None:
    """transformers' causal mask skipped under torch.compile as on the pinned torch 2.13: before pytorch#176499
    dynamo read `torch.compiler.is_exporting()` as True while compiling, so transformers built a (batch, 1, T, T)
    mask for every packed batch and attention ran its masked kernels instead of `is_causal`."""
    import transformers.masking_utils as masking

    masking.is_torchdynamo_exporting = lambda: False  # train.py never exports


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, name, re.IGNORECASE)),
                "elementwise and reductions")


def kernel_table(events, steps: int, on_gpu: bool, top: int) -> tuple[list[str], dict]:
    """The top kernels (GPU) or operators (CPU, self time) and the share of each kind, per step."""
    if on_gpu:  # the kernels themselves (not annotated ranges, such as the profiler's steps, which span them)
        timed = [(e.key, e.self_device_time_total, e.count) for e in events
                 if e.device_type.name == "CUDA" and not e.is_user_annotation and not e.key.startswith("ProfilerStep")]
    else:  # aten's operators, each without the operators it calls
        timed = [(e.key, e.self_cpu_time_total, e.count) for e in events if e.key.startswith("aten::")]
    timed = sorted(((name, us / 1000 / steps, count // steps, kind_of(name)) for name, us, count in timed if us > 0),
                   key=lambda t: -t[1])
    total = sum(ms for _, ms, _, _ in timed)
    kinds: dict[str, float] = {}
    for _, ms, _, kind in timed:
        kinds[kind] = kinds.get(kind, 0.0) + ms
    unit = "kernel" if on_gpu else "operator (self CPU time)"
    lines = [f"{'GPU kernels' if on_gpu else 'CPU operators'}: {total:,.1f} ms per step over {steps} step(s)", "",
             f"| {unit} | kind | calls/step | ms/step | share |", "|---|---|---:|---:|---:|"]
    lines += [f"| {name[:90]} | {kind} | {calls} | {ms:,.2f} | {ms / total:.1%} |" for name, ms, calls, kind in timed[:top]]
    lines += ["", "| kind | ms/step | share |", "|---|---:|---:|"]
    lines += [f"| {kind} | {ms:,.2f} | {ms / total:.1%} |" for kind, ms in sorted(kinds.items(), key=lambda k: -k[1])]
    return lines, {"ms_per_step": total, "kinds": kinds, "top": [{"name": n, "ms": ms, "calls": c} for n, ms, c, _ in timed[:top]]}


# Where a step's CPU time goes, by the profiler's own ranges (torch's DataLoader and Optimizer ranges, the autograd
# engine's backward functions) and the ranges `mark_forward` opens: the first match from the outside in wins.
PHASES = [("data", r"^enumerate\(DataLoader\)"), ("optimizer", r"^Optimizer\.(step|zero_grad)#"),
          ("forward", r"^## forward ##$"),
          ("loss (forward)", r"^aten::(cross_entropy_loss|log_softmax|nll_loss)"),
          ("loss (backward)", r"^autograd::engine::evaluate_function: (NllLoss|LogSoftmax)\w*Backward"),
          ("backward", r"^autograd::engine::evaluate_function: ")]


def mark_forward() -> None:
    """Ranges named for the phase table: the outermost module's forward (`## forward ##`) and, inside it, a
    transformers model's output layer (`## output layer ##`), through torch's global module hooks."""
    from torch.autograd.profiler import record_function

    open_ranges, output_layer = [], []
    marked: set[int] = set()

    def before(module, _):
        if not open_ranges:
            open_ranges.append(record_function("## forward ##").__enter__())
            inner = getattr(module, "module", module)  # (DDP's wrapper)
            layer = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
            if layer is not None and id(layer) not in marked:
                marked.add(id(layer))
                # (a stack of its own: the global hooks run around the module's own)
                layer.register_forward_pre_hook(lambda *_: output_layer.append(record_function("## output layer ##").__enter__()))
                layer.register_forward_hook(lambda *_: output_layer.pop().__exit__(None, None, None))
        else:
            open_ranges.append(None)

    def after(module, _, __):
        opened = open_ranges.pop()
        if opened is not None:
            opened.__exit__(None, None, None)

    torch.nn.modules.module.register_module_forward_pre_hook(before)
    torch.nn.modules.module.register_module_forward_hook(after)


def phase_table(events, steps: int) -> tuple[list[str], dict]:
    """Each phase's CPU time per step (an event counts for the first phase it or an enclosing event matches), the
    steps' own total, and the host syncs (`aten::_local_scalar_dense`: a tensor read by the host) per step, with the
    operator that asked for each."""
    def phase_of(event) -> str | None:
        chain = []
        while event is not None:
            chain.append(event)
            event = event.cpu_parent
        for outer in reversed(chain):
            if name := next((phase for phase, pattern in PHASES if re.search(pattern, outer.name)), None):
                return name if outer is chain[0] else ""  # "": inside another counted event
        return None

    phases = {phase: 0.0 for phase, _ in PHASES}
    step_ms, syncs = 0.0, {}
    for event in events:
        if event.name.startswith("ProfilerStep"):  # ("ProfilerStep*": consecutive, the wall time of the steps)
            step_ms += event.cpu_time_total / 1000
        if event.name == "aten::_local_scalar_dense":
            asker = event.cpu_parent
            while asker is not None and asker.name in ("aten::item", "aten::is_nonzero"):
                asker = asker.cpu_parent
            where = "the loop" if asker is None or asker.name.startswith("ProfilerStep") else asker.name
            syncs[where] = syncs.get(where, 0) + 1
        if phase := phase_of(event):
            phases[phase] += event.cpu_time_total / 1000
    phases = {phase: ms / steps for phase, ms in phases.items()}
    output_layer = sum(event.cpu_time_total for event in events if event.name == "## output layer ##") / 1000 / steps
    total = step_ms / steps
    other = total - sum(phases.values())
    asked = ", ".join(f"{count / steps:g} by {where}" for where, count in sorted(syncs.items(), key=lambda s: -s[1]))
    lines = [f"CPU time per step by phase: {total:,.1f} ms per step over {steps} step(s); host syncs per step: "
             f"{asked or 'none'}", "", "| phase | ms/step | share |", "|---|---:|---:|"]
    lines += [f"| {phase} | {ms:,.2f} | {ms / total:.1%} |" for phase, ms in phases.items()]
    lines.append(f"| other (logging, clipping, schedule, the loop) | {other:,.2f} | {other / total:.1%} |")
    lines.append(f"| of the forward: the output layer (logits) | {output_layer:,.2f} | {output_layer / total:.1%} |")
    return lines, {"ms_per_step": total, "phases": phases | {"other": other, "output_layer": output_layer},
                   "host_syncs_per_step": {where: count / steps for where, count in syncs.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--skip_steps", type=int, default=10, help="Optimizer steps before the profile (warm-up).")
    parser.add_argument("--profile_steps", type=int, default=3, help="Optimizer steps profiled.")
    parser.add_argument("--top", type=int, default=15, help="Kernels (operators on CPU) listed by time.")
    parser.add_argument("--json", type=Path, help="Also write the figures here (main process).")
    parser.add_argument("--sdpa_backends", nargs="+", choices=sorted(SDPA_BACKENDS), help="Attention may use only these "
                        "of torch's CUDA backends (default: torch's choice).")
    parser.add_argument("--causal_mask_skip", action="store_true", help="On a torch older than the pinned 2.13: let "
                        "transformers skip the causal mask under torch.compile, as there (no mask tensor, is_causal).")
    ours, train_flags = parser.parse_known_args()
    if ours.causal_mask_skip:
        skip_causal_mask_under_compile()
    if ours.sdpa_backends:
        for name, switch in SDPA_BACKENDS.items():
            switch(name in ours.sdpa_backends)
    on_gpu = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    main_process = int(os.environ.get("RANK", "0")) == 0

    if not on_gpu:
        mark_forward()

    def report(profiler: profile) -> None:
        if main_process:
            lines, figures = kernel_table(profiler.key_averages(), ours.profile_steps, on_gpu, ours.top)
            if not on_gpu:  # (on a GPU the host runs ahead: its phases are not the device's)
                phase_lines, figures["phases"] = phase_table(profiler.events(), ours.profile_steps)
                lines += ["", *phase_lines]
            print("\n".join(lines), flush=True)
            if ours.json:
                ours.json.write_text(json.dumps(figures, indent=1))

    profiler = profile(activities=activities, on_trace_ready=report,
                       schedule=schedule(wait=max(ours.skip_steps - 1, 0), warmup=1 if ours.skip_steps else 0,
                                         active=ours.profile_steps, repeat=1))
    profiler.start()
    register_optimizer_step_post_hook(lambda *_: profiler.step())
    sys.argv = [str(REPO / "train.py"), *train_flags]
    sys.path.insert(0, str(REPO))
    runpy.run_path(str(REPO / "train.py"), run_name="__main__")  # exits the process itself


if __name__ == "__main__":
    main()
