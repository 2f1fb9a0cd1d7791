"""Owns the errors of input that cannot work: train.py prints their one line and exits 2."""


class ArgumentError(ValueError):
    """A flag or recipe value the template cannot use; its message says how to fix it."""


class StrategyError(RuntimeError):
    """The strategy in use differs from the one configured; training would silently be wrong."""
