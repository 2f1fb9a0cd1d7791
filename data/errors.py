"""The one error type of data/: data that cannot be used as given."""


class DataError(ValueError):
    """Data that cannot be used as given; the message says what to change."""
