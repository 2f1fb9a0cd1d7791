"""Numbers a model's layers for layer-wise rates: its blocks are its one outermost `nn.ModuleList` (`model.layers`,
`transformer.h`, `blocks`), block i at depth i + 1; what comes before them in `named_parameters` (the embeddings,
and a parameter the model holds itself) is depth 0, what comes after (the final norm, the output head) the top. A
model without one such list (none, or an encoder and a decoder) says how with a method `layer_depth(name) -> int`
(0 lowest), or is refused."""

from __future__ import annotations

import torch

from training.errors import ArgumentError


def layer_depths(model: torch.nn.Module) -> dict[str, int]:
    """Each parameter's depth, by its name as `named_parameters` gives it (a tied weight: its first name); frozen ones
    too, so that the top stays the model's own under an adapter."""
    named = [name for name, _ in model.named_parameters()]
    if callable(depth_of := getattr(model, "layer_depth", None)):
        return {name: int(depth_of(name)) for name in named}
    lists = [name for name, module in model.named_modules() if isinstance(module, torch.nn.ModuleList)]
    outermost = [name for name in lists if not any(name.startswith(f"{other}.") for other in lists)]
    if len(outermost) != 1:
        found = f"{len(outermost)} ({', '.join(outermost)})" if outermost else "none"
        raise ArgumentError(f"--layer_lr_decay numbers the blocks of a model's one outermost nn.ModuleList, and "
                            f"{type(model).__name__} has {found}; give the model a method layer_depth(name) -> int "
                            "(0 for the lowest layer), or drop --layer_lr_decay")
    blocks = outermost[0]
    count = len(model.get_submodule(blocks))
    depths, seen_blocks = {}, False
    for name in named:
        if name.startswith(f"{blocks}."):
            seen_blocks = True
            depths[name] = int(name[len(blocks) + 1:].split(".", 1)[0]) + 1
        else:  # before the blocks (the embeddings), or after them (the final norm, the head)
            depths[name] = count + 1 if seen_blocks else 0
    return depths


def regrouped(groups: list[dict], model: torch.nn.Module, args, decay: float, no_decay_names: str | None) -> list[dict]:
    """`groups` (the core's: weights that decay, and the rest) as one group per depth and weight decay, top first,
    named `layer_<depth>` (`lr/layer_<depth>` in the logs)."""
    depths = layer_depths(model) if decay != 1 else {}  # (one rate: --no_decay_names alone)
    named = {id(parameter): name for name, parameter in model.named_parameters()}
    fragments = [fragment.strip().lower() for fragment in (no_decay_names or "").split(",") if fragment.strip()]
    top = max(depths.values(), default=0)
    by_depth: dict[tuple[int, float], list[torch.nn.Parameter]] = {}
    for group in groups:
        for parameter in group["params"]:
            name = named[id(parameter)]
            weight_decay = group["weight_decay"]  # the core's rule, unless --no_decay_names replaces it
            if fragments:
                weight_decay = 0.0 if any(fragment in name.lower() for fragment in fragments) else args.weight_decay
            by_depth.setdefault((depths.get(name, 0), weight_decay), []).append(parameter)
    return [{"params": parameters, "weight_decay": weight_decay, "name": f"layer_{depth}",
             "lr": args.learning_rate * decay ** (top - depth)}
            for (depth, weight_decay), parameters in sorted(by_depth.items(), key=lambda item: item[0], reverse=True)]
