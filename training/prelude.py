"""Owns what train.py does first, before torch and the other libraries load, and once they have.

- The parts' `before_imports` run first (parts/preemption: stop signals handled from the first line on).
- `--help` is answered before torch loads: under 2 s.
- The cyclic garbage collector waits for the imports: importing torch, transformers and datasets
  allocates millions of objects, and it would walk them again and again (1.1 s of a 5 s start,
  measured). `after_imports` freezes what they made, which lives as long as the process, and turns
  it back on.
"""

from __future__ import annotations

import gc
import sys


def before_imports() -> None:
    """train.py's first call, as `__main__`."""
    gc.disable()
    from training.parts import parts

    parts().before_imports()
    if {"-h", "--help"} & set(sys.argv[1:]):
        from training.flags import build_parser

        build_parser().print_help()
        sys.exit(0)


def after_imports() -> None:
    """Once the libraries are loaded: no collection need look at what they made again."""
    gc.freeze()
    gc.enable()
