"""Starting a run from another run's weights: every name and shape that matches loads, the rest is listed."""

import torch
from torch import nn


def load_matching(model: nn.Module, weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Copy every weight whose name and shape match into `model`.

    Returns (loaded, not_loaded); the second lists model keys left at their initial value with the
    reason, so adapting a dense-attention checkpoint to another attention is explicit.
    """
    own = model.state_dict()
    loaded, skipped = [], []
    for name, target in own.items():
        source = weights.get(name)
        if source is None:
            skipped.append(f"{name} (not in checkpoint)")
        elif source.shape != target.shape:
            skipped.append(f"{name} (shape {tuple(source.shape)} in checkpoint, {tuple(target.shape)} in model)")
        else:
            with torch.no_grad():
                target.copy_(source)
            loaded.append(name)
    skipped += [f"{name} (not in model)" for name in weights if name not in own]
    return loaded, skipped
