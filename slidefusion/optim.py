"""The optimizer section of a training config, shared by the resident trainer and the offload engine.

It sits below both (training -> offload -> here), so the engine reads the same hyper-parameters the
trainer validated instead of repeating them.
"""

from dataclasses import dataclass

from slidefusion.core import validate
from slidefusion.core.errors import check, choose

SCHEDULES = ("constant", "linear", "cosine")  # after warm-up: keep lr, or decay it to min_lr by the last step
LR_MAX = 1.0  # AdamW moves each weight by up to about lr per step; beyond 1 nothing trains, and
# lr / (1 - beta1) stops fitting a float32 long before torch would tell you why


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then a schedule (`training.schedule`), optional clipping, and an EMA
    copy of the weights for sampling."""

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 50
    schedule: str = "constant"  # constant | linear | cosine (decay from lr to min_lr over the steps after warm-up)
    min_lr: float = 0.0
    max_grad_norm: float | None = 1.0
    ema_decay: float | None = 0.999

    def __post_init__(self):
        self.betas = tuple(self.betas)
        validate.finite(self.lr, "optim.lr", 0, LR_MAX, low_open=True)
        check(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), f"optim.betas={self.betas} must be two numbers in [0, 1)")
        validate.finite(self.eps, "optim.eps", 0, low_open=True)
        validate.finite(self.weight_decay, "optim.weight_decay", 0)
        check(self.warmup_steps >= 0, f"optim.warmup_steps={self.warmup_steps} must be >= 0")
        choose(self.schedule, SCHEDULES, "optim.schedule")
        validate.finite(self.min_lr, "optim.min_lr", 0, self.lr)
        if self.max_grad_norm is not None:
            validate.finite(self.max_grad_norm, "optim.max_grad_norm", 0, low_open=True)
        check(self.ema_decay is None or 0 < self.ema_decay < 1, f"optim.ema_decay={self.ema_decay} must be in (0, 1) or null")
