"""A rank that cannot be reached, or stalls, ends the run with one line naming it instead of hanging: the preflight
before training, and a collective that waits past --ddp_timeout as exit 4 (guard.py). See docs/hangs.md."""

from training.parts import Launch, Loop, Part, Started


class Hangs(Part):
    name = "hangs"
    description = ("a rank that cannot be reached or stalls ends the run in one line (exit 4) instead of hanging: the "
                   "preflight, --ddp_timeout on every collective")

    def at_start(self, launch: Launch) -> None:
        """NCCL's watchdog aborts a timed-out collective instead of the process, so the wait raises (on GPUs)."""
        if not launch.on_cpu:
            from parts.hangs.guard import nccl_timeouts_raise

            nccl_timeouts_raise()

    def started(self, run: Started) -> str:
        """Every rank reaches every other, proven before training: the host/rank/device map for the log."""
        from parts.hangs.guard import preflight

        return preflight(run.accelerator, run.args.ddp_timeout)

    def around_training(self, loop: Loop):
        """A collective that timed out, as one error naming the step and rank."""
        from parts.hangs.guard import collective_timeouts_reported

        return collective_timeouts_reported(loop.accelerator, loop.args.ddp_timeout, loop.current_step)


PART = Hangs()
