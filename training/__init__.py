"""The pieces `train.py` is built from, one concern per module."""
