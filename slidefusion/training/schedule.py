"""The learning rate of each step: linear warm-up, then constant, linear or cosine decay to `min_lr`.

    lr(step) = lr * (step + 1) / warmup_steps                     for step < warmup_steps
             = lr                                                 constant
             = min_lr + (lr - min_lr) * (1 - p)                   linear
             = min_lr + (lr - min_lr) * (1 + cos(pi * p)) / 2     cosine

with p = (step - warmup_steps) / (total - warmup_steps) in [0, 1], so the last step (total - 1)
trains at nearly min_lr. Steps count from 0. The rate is a function of (config, step, total) alone,
so a resumed run follows the schedule of an uninterrupted one.
"""

from __future__ import annotations

import math

from slidefusion.optim import OptimConfig


def lr_at(optim: OptimConfig, step: int, total: int) -> float:
    """The learning rate of step `step` (0-based) of a run of `total` steps."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.schedule == "constant":
        return optim.lr
    span = max(1, total - optim.warmup_steps)
    progress = min(1.0, (step - optim.warmup_steps) / span)
    if optim.schedule == "linear":
        factor = 1.0 - progress
    else:
        factor = (1.0 + math.cos(math.pi * progress)) / 2.0
    return optim.min_lr + (optim.lr - optim.min_lr) * factor
