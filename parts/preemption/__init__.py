"""Stop cleanly when the cluster asks: SIGTERM or SIGUSR1 finishes the step, saves a checkpoint and exits 75, and
`--resume_from_checkpoint latest` continues exactly (signals.py). See docs/preemption.md."""

from training.parts import Part, StepEnd


class Preemption(Part):
    name = "preemption"
    description = ("SIGTERM/SIGUSR1 (a scheduler's preemption or time limit): save after the step every rank agrees "
                   "on, exit 75, resume exactly")

    def before_imports(self) -> None:
        """Handle stop signals from train.py's first line on: a rank signalled while it still imports ends with its
        one error line (torchrun sends SIGTERM to the others when the first rank exits)."""
        from parts.preemption.signals import install_stop_handlers

        install_stop_handlers()

    def loader_settings(self, args) -> dict:
        """Loader workers ignore stop signals (their rank saves first, then ends them)."""
        from parts.preemption.signals import end_loader_workers_at_exit, leave_stop_signals_to_the_rank

        end_loader_workers_at_exit()
        return {"worker_init_fn": leave_stop_signals_to_the_rank}

    def stop_requested(self, end: StepEnd) -> str | None:
        """The stop signal any rank received, agreed by every rank (a collective every few steps, and when `now`)."""
        from parts.preemption.signals import install_stop_handlers

        return install_stop_handlers().agreed(end.step, end.now, end.args.ddp_timeout)


PART = Preemption()
