"""Owns the ways a run ends early that train.py reports in one line, and their exit codes. Any other exception is a
bug: traceback, exit 1. A new one-line error subclasses one of these, and train.py needs no edit."""

EXIT_UNEXPECTED = 1  # any other exception: its traceback is printed


class RunEnded(Exception):
    """A documented end of a run: `prefix: message` on stderr, then `exit_code`."""

    exit_code = EXIT_UNEXPECTED
    prefix = "error"
    every_rank = False  # one machine's ranks read the same flags, files and data, so fail alike: one line per machine


class BadInputError(RunEnded):
    """A flag, file, config or checkpoint that cannot work; the message says which and how to fix it."""

    exit_code = 2


class ArgumentError(BadInputError, ValueError):
    """A flag or recipe value the template cannot use; its message says how to fix it."""


class DataError(BadInputError, ValueError):
    """Data that cannot be used as given; the message says what to change."""


class ModelError(BadInputError, ValueError):
    """A model or tokenizer that cannot be loaded or used as asked; the message says how to fix it."""


class StrategyError(BadInputError, RuntimeError):
    """The strategy in use differs from the one configured, or cannot run here; training would be wrong."""


class ResumeError(BadInputError, RuntimeError):
    """A checkpoint that cannot continue this run exactly; the message says what to do."""


class NonFiniteLossError(RunEnded, RuntimeError):
    """The loss became NaN or infinite; nothing was saved from the poisoned weights."""

    exit_code = 3


class CollectiveTimeoutError(RunEnded, RuntimeError):
    """A collective did not complete within its timeout: a rank stalled, died or cannot be reached."""

    exit_code = 4
    every_rank = True  # each waiting rank names itself


class Preempted(RunEnded):
    """Training stopped on a signal after saving a checkpoint; resuming continues exactly."""

    exit_code = 75  # EX_TEMPFAIL: rerun with --resume_from_checkpoint latest
    prefix = "stopped"


class PeerEnded(RunEnded, RuntimeError):
    """Another process ended the run (its own line says why) while this one waited on it: a traceback would bury it."""

    exit_code = 4  # a collective failed, as for a timeout; torchrun's report names the first failure its root cause


PEER_GONE = ("Connection closed by peer", "Connection reset by peer")  # gloo's, in a collective whose peer exited


def ending(error: BaseException) -> RunEnded | None:
    """`error` as a documented end (a missing file: bad input; a peer that ended first: its end), else None."""
    if isinstance(error, RunEnded):
        return error
    if isinstance(error, FileNotFoundError):
        return BadInputError(str(error))
    if isinstance(error, RuntimeError) and any(sign in str(error) for sign in PEER_GONE):
        return PeerEnded("another process ended the run first; its own error line says why")
    return None
