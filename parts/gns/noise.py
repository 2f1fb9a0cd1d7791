"""The gradient noise scale estimator (McCandlish et al. 2018, appendix A.1). For a gradient estimate G_b over b
examples, E|G_b|² = |G|² + tr(Σ)/b. Two batch sizes a step already has give both terms without bias:

- small, b: one micro-batch on one rank, its gradient seen by a tensor hook on each parameter as the forward used it
  (before DDP averages, FSDP reduce-scatters or ZeRO partitions it: the same under every strategy), |G_small|²
  averaged over every rank's micro-batches;
- big, B: the global batch, |G_big|² the square of the norm clipping measured (before clipping).

    |G|² = (B |G_big|² - b |G_small|²) / (B - b)        tr(Σ) = (|G_small|² - |G_big|²) / (1/b - 1/B)

Both are averaged over the measured steps of a logged interval (and of the run, for summary.json) before their
ratio is taken, as the paper advises: each step's estimate is noisy, and a ratio of noisy terms is biased. The loss
is a mean over target tokens, so b and B count tokens; the figure logged is in examples (sequences), to compare with
the global batch."""

from __future__ import annotations

import weakref

import torch

from training.parts import MicroStep, Training

SUMS = ("small", "inverse_tokens", "micro_batches", "big", "inverse_window_tokens", "tokens", "examples", "steps")


class NoiseMeter:
    """Tensor hooks that add up each parameter's gradient of the micro-batch on the measured steps, and the
    `LoggedFigures` (training/performance.py) of the estimate. No host sync: the sums stay on the device."""

    steady = ("gradient_noise_scale",)

    def __init__(self, training: Training, every: int) -> None:
        self.every, self.processes = every, training.accelerator.num_processes
        args = training.args
        self.examples = args.per_device_train_batch_size * self.processes * args.gradient_accumulation_steps
        self.device = training.accelerator.device
        self.measuring = False
        self.window_targets: torch.Tensor | None = None  # the measured step's, from its micro-batches
        self.micro = torch.zeros((), device=self.device, dtype=torch.float64)  # |gradient|² of the micro-batch so far
        self.interval = self.zeros()
        self.run = self.zeros()
        self.hooked: dict[int, weakref.ref] = {}  # the parameters hooked, by id (a tensor's == compares values)
        for module in training.model.modules():  # (FSDP2 swaps in unsharded parameters for each forward)
            if any(parameter.requires_grad for parameter in module.parameters(recurse=False)):
                module.register_forward_pre_hook(self.hook_parameters)

    def zeros(self) -> dict[str, torch.Tensor]:
        return {name: torch.zeros((), device=self.device, dtype=torch.float64) for name in SUMS}

    def hook_parameters(self, module: torch.nn.Module, inputs) -> None:
        """Each trainable parameter the forward is about to use, hooked once."""
        for parameter in module.parameters(recurse=False):
            hooked = self.hooked.get(id(parameter))
            if parameter.requires_grad and (hooked is None or hooked() is not parameter):
                parameter.register_hook(self.add_gradient)
                self.hooked[id(parameter)] = weakref.ref(parameter)

    def add_gradient(self, gradient: torch.Tensor) -> None:
        if self.measuring:
            self.micro += gradient.detach().float().pow(2).sum().to(self.device)  # (--device_map: layers on other GPUs)

    def start(self, step: int) -> None:
        """Before the run's first step (`step`, counted from 1)."""
        self.measuring = step % self.every == 0

    def micro_batch_done(self, micro: MicroStep) -> None:
        """The micro-batch's squared gradient norm, as its mean over its targets: the backward ran on its loss sum over
        the window's targets times the processes (training/step.py `forward_backward`)."""
        if not self.measuring:
            return
        tokens = torch.as_tensor(micro.targets, device=self.device, dtype=torch.float64)
        scale = torch.as_tensor(micro.window_targets, device=self.device, dtype=torch.float64) / (tokens * self.processes)
        self.interval["small"] += self.micro * scale ** 2
        self.interval["inverse_tokens"] += 1 / tokens
        self.interval["micro_batches"] += 1
        self.window_targets = micro.window_targets
        self.micro.zero_()

    def step_done(self, step: int, grad_norm: torch.Tensor | float) -> None:
        if self.measuring:
            self.interval["big"] += torch.as_tensor(grad_norm, device=self.device, dtype=torch.float64) ** 2
            window = torch.as_tensor(self.window_targets, device=self.device, dtype=torch.float64)
            self.interval["inverse_window_tokens"] += 1 / window
            self.interval["tokens"] += window
            self.interval["examples"] += self.examples
            self.interval["steps"] += 1
        self.measuring = (step + 1) % self.every == 0

    def local(self, units: int, seconds: float, whole_run: bool) -> dict[str, torch.Tensor]:
        """The interval's sums (and the next interval started), or the whole launch's."""
        totals = {name: self.run[name] + value for name, value in self.interval.items()}
        if not whole_run:
            totals, self.run, self.interval = self.interval, totals, self.zeros()
        return {f"gns {name}": value for name, value in totals.items()}

    def report(self, ranks: dict[str, torch.Tensor], units_per_sec: float) -> dict[str, float]:
        """B_simple over the measured steps, in examples; nothing where no step was measured or an estimated term is
        not positive (one noisy step: measure over more steps)."""
        steps = float(ranks["gns steps"][0])
        if not steps:
            return {}
        small = float(ranks["gns small"].sum() / ranks["gns micro_batches"].sum())  # E|G_small|²
        b = float(ranks["gns micro_batches"].sum() / ranks["gns inverse_tokens"].sum())  # tokens, harmonic mean
        big = float(ranks["gns big"][0]) / steps  # E|G_big|²
        tokens = steps / float(ranks["gns inverse_window_tokens"][0])  # B, tokens, harmonic mean
        signal = (tokens * big - b * small) / (tokens - b)  # |G|²
        noise = (small - big) / (1 / b - 1 / tokens)  # tr(Σ)
        if not (signal > 0 and noise > 0):  # (and not NaN)
            return {}
        return {"gradient_noise_scale": noise / signal * float(ranks["gns examples"][0]) / float(ranks["gns tokens"][0])}
