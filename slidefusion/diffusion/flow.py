"""Rectified flow: x_t = (1 - t) x_0 + t noise, and the model predicts the velocity noise - x_0.

t = 0 is data and t = 1 is noise. The model never sees this schedule; it sees (x_t, t).
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from slidefusion.core.errors import check
from slidefusion.diffusion.rows import Rows, local_rows


@dataclass
class FlowConfig:
    """Training-time timestep law: t = sigmoid(N(logit_mean, logit_std)) (SD3's logit-normal)."""

    logit_mean: float = 0.0
    logit_std: float = 1.0
    caption_dropout: float = 0.1  # the fraction of captions replaced by "" so CFG has an unconditional model
    # image-to-video fine-tunes: the fraction of steps that train without the image (its states and
    # latents zeroed; Wan 2.2 TI2V: a text-to-video step)
    image_dropout: float = 0.0
    # The direction contrast (`contrastive_flow_loss`): weight of the hinge that asks the loss with
    # the caption's direction changed to exceed the true caption's by `contrast_margin`; 0 is off.
    direction_contrast: float = 0.0
    contrast_margin: float = 0.01
    contrast_min_t: float = 0.0  # the hinge only where t >= this: at low noise x_t itself shows the motion

    def __post_init__(self):
        check(self.logit_std > 0, f"diffusion.logit_std={self.logit_std} must be > 0")
        check(0 <= self.caption_dropout < 1, f"diffusion.caption_dropout={self.caption_dropout} must be in [0, 1)")
        check(0 <= self.image_dropout < 1, f"diffusion.image_dropout={self.image_dropout} must be in [0, 1)")
        check(0 <= self.direction_contrast <= 100,
              f"diffusion.direction_contrast={self.direction_contrast} must be in [0, 100] (0 is off)")
        check(0 < self.contrast_margin <= 10, f"diffusion.contrast_margin={self.contrast_margin} must be in (0, 10]")
        check(0 <= self.contrast_min_t < 1, f"diffusion.contrast_min_t={self.contrast_min_t} must be in [0, 1)")


def sample_timesteps(batch: int, config: FlowConfig, generator: torch.Generator) -> Tensor:
    """Logit-normal flow times (B,) in (0, 1)."""
    normal = torch.randn(batch, generator=generator)
    return torch.sigmoid(config.logit_mean + config.logit_std * normal)


def interpolate(x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
    """The point x_t on the straight path from data x0 (B, ...) to noise at times t (B,)."""
    t = t.view(-1, *([1] * (x0.dim() - 1))).to(x0)
    return (1 - t) * x0 + t * noise


VelocityFn = Callable[[Tensor, Tensor], Tensor]


def flow_loss(velocity: VelocityFn, x0: Tensor, config: FlowConfig, generator: torch.Generator,
              rows: Rows | None = None) -> Tensor:
    """Mean squared velocity error at logit-normal times; `velocity(x_t, t)` is the model.

    Noise and times come from `generator` on the CPU, so a step's randomness depends on the seed
    alone, not on the device or on what ran before. `rows`: x0 holds these rows of a larger batch
    (data-parallel), whose times and noise are drawn whole and cut (`rows.Rows`).
    """
    t, noise = _draws(x0, config, generator, local_rows(rows, x0.shape[0]))
    target = noise - x0
    prediction = velocity(interpolate(x0, noise, t), t.to(x0.device))
    return torch.mean((prediction.float() - target.float()) ** 2)


def contrastive_flow_loss(velocity: VelocityFn, x0: Tensor, has_negative: Tensor, config: FlowConfig,
                          generator: torch.Generator, rows: Rows | None = None) -> Tensor:
    """`flow_loss` plus the direction contrast, from one forward pass over twice the batch.

    `velocity(x_t, t)` takes (2B, ...) inputs: rows 0..B-1 are the clips with their own captions,
    rows B..2B-1 the same x_t and t with negative captions (another direction). `has_negative` (B,)
    bool marks the rows that have one. The loss is the mean squared error of the first half plus
    `direction_contrast` times the mean, over rows with a negative and t >= `contrast_min_t`, of
    relu(contrast_margin - (error with the negative - error with the true caption)).

    Plain regression cannot teach the model to tell directions apart while its prediction does not
    yet depend on them (docs/results/demo-model.md, probe 6); the hinge's gradient is the difference of the
    two captions' predictions, so it acts on exactly that. An ideal denoiser meets the default
    margin at every t below ~0.95, so the hinge does not pull away from the regression's optimum.
    Draws t and noise as `flow_loss` does, so without negatives the two are the same loss. With
    `rows`, `has_negative` is the whole batch's (B_total,), and the hinge is scaled so that the mean
    of every rank's loss is the loss of the whole batch.
    """
    batch, rows = x0.shape[0], local_rows(rows, x0.shape[0])
    t_all = sample_timesteps(rows.total, config, generator)
    t, noise = rows.take(t_all), rows.take(torch.randn((rows.total, *x0.shape[1:]), generator=generator)).to(x0)
    target = (noise - x0).float()
    x_t = interpolate(x0, noise, t)
    prediction = velocity(torch.cat([x_t, x_t]), torch.cat([t, t]).to(x0.device)).float()
    error = ((prediction - torch.cat([target, target])) ** 2).flatten(1).mean(1)
    true, negative = error[:batch], error[batch:]
    everywhere = (has_negative & (t_all >= config.contrast_min_t)).to(torch.float32)  # the whole batch's rows
    mask = rows.take(everywhere).to(error.device)
    hinge = torch.relu(config.contrast_margin - (negative - true)) * mask
    return true.mean() + config.direction_contrast * hinge.sum() / rows.share / everywhere.sum().clamp(min=1)


def _draws(x0: Tensor, config: FlowConfig, generator: torch.Generator, rows: Rows) -> tuple[Tensor, Tensor]:
    """(t (B,), noise like x0) of this process's rows, drawn for the whole batch."""
    t = rows.take(sample_timesteps(rows.total, config, generator))
    return t, rows.take(torch.randn((rows.total, *x0.shape[1:]), generator=generator)).to(x0)
