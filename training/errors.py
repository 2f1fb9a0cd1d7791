"""The error a strategy or launch setting that cannot work raises: train.py prints its one line and exits 2."""


class StrategyError(RuntimeError):
    """The strategy in use differs from the one configured; training would silently be wrong."""
