"""Rectified flow: x_t = (1 - t) x_0 + t noise, and the model predicts the velocity noise - x_0.

t = 0 is data and t = 1 is noise. The model never sees this schedule; it sees (x_t, t).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from slidefusion.errors import check


@dataclass
class FlowConfig:
    """Training-time timestep law: t = sigmoid(N(logit_mean, logit_std)) (SD3's logit-normal)."""

    logit_mean: float = 0.0
    logit_std: float = 1.0
    caption_dropout: float = 0.1  # the fraction of captions replaced by "" so CFG has an unconditional model

    def __post_init__(self):
        check(self.logit_std > 0, f"diffusion.logit_std={self.logit_std} must be > 0")
        check(0 <= self.caption_dropout < 1, f"diffusion.caption_dropout={self.caption_dropout} must be in [0, 1)")


def sample_timesteps(batch: int, config: FlowConfig, generator: torch.Generator) -> Tensor:
    """Logit-normal flow times (B,) in (0, 1)."""
    normal = torch.randn(batch, generator=generator)
    return torch.sigmoid(config.logit_mean + config.logit_std * normal)


def interpolate(x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """The point x_t on the straight path from data x0 (B, ...) to noise at times t (B,)."""
    t = t.view(-1, *([1] * (x0.dim() - 1))).to(x0)
    return (1 - t) * x0 + t * noise


VelocityFn = Callable[[Tensor, Tensor], Tensor]


def flow_loss(velocity: VelocityFn, x0: Tensor, config: FlowConfig, generator: torch.Generator) -> Tensor:
    """Mean squared velocity error at logit-normal times; `velocity(x_t, t)` is the model.

    Noise and times come from `generator` on the CPU, so a step's randomness depends on the seed
    alone, not on the device or on what ran before.
    """
    t = sample_timesteps(x0.shape[0], config, generator)
    noise = torch.randn(x0.shape, generator=generator).to(x0)
    target = noise - x0
    prediction = velocity(interpolate(x0, noise, t), t.to(x0.device))
    return torch.mean((prediction.float() - target.float()) ** 2)
