"""A checkpoint's weights as one `model.safetensors`, whatever strategy and process count wrote it.

    python scripts/checkpoint_weights.py outputs/default/checkpoints/step_200 merged/

`checkpoints/step_N/model_state/` holds each tensor whole (training/checkpoints/), so this replaces DeepSpeed's
`zero_to_fp32.py` and `accelerate merge-weights` for this template's checkpoints. Copy config.json and the tokenizer
files from final/ (or the model you started from) beside it to load it with `from_pretrained`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from training.checkpoints.tensors import MODEL_STATE, ModelState  # noqa: E402


def checkpoint_weights(checkpoint: Path) -> dict:
    """Every tensor's value in its own dtype, by the model's own names, assembled from the ranks' pieces."""
    if not list((checkpoint / MODEL_STATE).glob("rank*.safetensors")):
        raise SystemExit(f"error: {checkpoint / MODEL_STATE} holds no tensors: give a checkpoints/step_N directory "
                         "written by this template")
    with contextlib.ExitStack() as files:
        state = ModelState(checkpoint, files)
        return {name: state.whole(name).value for name in state.shapes}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoints/step_N directory")
    parser.add_argument("out_dir", type=Path, help="where model.safetensors goes")
    args = parser.parse_args(argv)
    weights = checkpoint_weights(args.checkpoint)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    save_file(weights, args.out_dir / "model.safetensors", metadata={"format": "pt"})
    print(f"{len(weights)} tensors from {args.checkpoint} written to {args.out_dir / 'model.safetensors'}")


if __name__ == "__main__":
    main()
