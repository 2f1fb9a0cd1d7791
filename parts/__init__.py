"""Optional features, one package each, that plug into the core through training/parts.py's hooks.

A part's `__init__.py` imports nothing heavy (train.py --help reads every part's flags before torch
loads) and defines `PART`; its hooks import what they need when they run. Delete a part's folder
and the template trains without it: no core module names a part.
"""
