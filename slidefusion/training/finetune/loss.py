"""The training loss of a diffusers family, read from the adapter's `Objective` and the folder's scheduler.

flow (Wan, HunyuanVideo, LTX, Mochi): u ~ logit-normal (`diffusion.logit_mean`, `logit_std`), then
    shifted as the folder's scheduler shifts its sigmas: s = shift u / (1 + (shift - 1) u) with
    UniPC's `flow_shift` (Wan) or FlowMatchEuler's `shift`, or exponentially with mu from the token
    count when it shifts dynamically (LTX); x_s = (1 - s) x0 + s noise; the model sees its own
    timestep units (`Objective.model_timesteps`: s * 1000, or (1 - s) * 1000 for Mochi) and the
    loss is the mean squared error of its velocity.
v / epsilon (CogVideoX, Latte): a DDPM step index t ~ U{0 .. num_train_timesteps - 1}, x_t from the
    scheduler's alphas_cumprod, target v (CogVideoX) or the noise (Latte). A learned-variance model
    (Latte) adds the variational bound of its variance channels, as DiT and Latte train: the KL
    between the true posterior q(x_{t-1} | x_t, x0) and the model's Gaussian (mean from the
    detached noise prediction, log variance interpolated between beta_t and the posterior's), in bits
    per dimension, the decoder NLL at t = 0.

A Wan 2.2 A14B expert trains on its own timesteps: sigmas are mapped linearly into its range.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from slidefusion.families import ModelAdapter, TextConditioning
from slidefusion.diffusion.flow import FlowConfig, sample_timesteps
from slidefusion.core.errors import check
from slidefusion.diffusion.rows import Rows, local_rows


class FolderObjective:
    """The loss of one folder's transformer. `scheduler`: the folder's, loaded; `expert_range`: the
    (low, high) model timesteps the trained expert denoises (Wan 2.2 A14B), or None."""

    def __init__(self, adapter: ModelAdapter, scheduler, flow: FlowConfig, expert_range=None):
        self.adapter, self.objective, self.flow = adapter, adapter.objective, flow
        self.config = dict(scheduler.config)
        self.train_steps = int(self.config.get("num_train_timesteps", 1000))
        self.sigma_range = None
        if expert_range is not None and self.objective.kind == "flow":
            low, high = (max(0.0, min(1.0, v / self.train_steps)) for v in expert_range)
            self.sigma_range = (low, high)
        if self.objective.kind != "flow":
            check(hasattr(scheduler, "alphas_cumprod"), f"the folder's {type(scheduler).__name__} has no "
                                                        f"alphas_cumprod; {self.objective.kind}-prediction needs one")
            self.alphas_cumprod = scheduler.alphas_cumprod.double()
            self.betas = scheduler.betas.double()

    # ------------------------------------------------------------------ timesteps
    def shift(self, u: Tensor, tokens: int) -> Tensor:
        """Flow sigmas (B,) from u in (0, 1), shifted as the folder's scheduler shifts its sigmas."""
        cfg = self.config
        if cfg.get("use_dynamic_shifting"):
            from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

            mu = calculate_shift(tokens, cfg.get("base_image_seq_len", 256), cfg.get("max_image_seq_len", 4096),
                                 cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
            return math.exp(mu) / (math.exp(mu) + (1 / u - 1))
        shift = float(cfg.get("flow_shift") if cfg.get("use_flow_sigmas") else cfg.get("shift", 1.0) or 1.0)
        return shift * u / (1 + (shift - 1) * u)

    def sample_t(self, batch: int, tokens: int, generator: torch.Generator) -> Tensor:
        """Flow sigmas (B,) float32 in (0, 1), or DDPM indices (B,) int64."""
        if self.objective.kind != "flow":
            return torch.randint(0, self.train_steps, (batch,), generator=generator)
        sigma = self.shift(sample_timesteps(batch, self.flow, generator).double(), tokens)
        if self.sigma_range is not None:
            low, high = self.sigma_range
            sigma = low + (high - low) * sigma
        return sigma.float()

    def fixed_t(self, count: int, tokens: int) -> Tensor:
        """`count` fixed timesteps (count,): the training distribution's quantiles (k + 0.5) / count
        (flow sigmas float32, or DDPM indices int64), for a held-out loss that moves only with the weights."""
        u = (torch.arange(count, dtype=torch.float64) + 0.5) / count
        if self.objective.kind != "flow":
            return (u * self.train_steps).long()
        raw = torch.sigmoid(self.flow.logit_mean + self.flow.logit_std * torch.special.ndtri(u))
        sigma = self.shift(raw, tokens)
        if self.sigma_range is not None:
            low, high = self.sigma_range
            sigma = low + (high - low) * sigma
        return sigma.float()

    def draw(self, shape: tuple[int, ...], tokens: int, generators: list[torch.Generator]) -> tuple[Tensor, Tensor]:
        """(t (B,), noise (B, C, T, H, W) float32) for latents of `shape`, sample i from `generators[i]`
        alone (its timestep, then its noise), on the CPU."""
        t = torch.cat([self.sample_t(1, tokens, g) for g in generators])
        noise = torch.stack([torch.randn(tuple(shape[1:]), generator=g) for g in generators])
        return t, noise

    # ------------------------------------------------------------------ the loss
    def loss(self, model, x0: Tensor, text: TextConditioning, generator: torch.Generator, rows: Rows | None = None) -> Tensor:
        """The mean loss of one batch of clean latents x0 (B, C, T, H, W); noise and timesteps from
        `generator` (on the CPU, so a step's randomness depends on the seed alone); `rows`: x0 holds
        these rows of a larger batch, whose timesteps and noise are drawn whole and cut."""
        tokens, rows = self.adapter.tokens(model, x0.shape), local_rows(rows, x0.shape[0])
        t = rows.take(self.sample_t(rows.total, tokens, generator))
        noise = rows.take(torch.randn((rows.total, *x0.shape[1:]), generator=generator))
        return self.loss_at(model, x0, text, t, noise)

    def loss_at(self, model, x0: Tensor, text: TextConditioning, t: Tensor, noise: Tensor) -> Tensor:
        """The mean loss of clean latents x0 (B, C, T, H, W) at timesteps `t` (B,) with `noise` (x0's shape)."""
        noise = noise.to(x0)
        acp = None if self.objective.kind == "flow" else self.alphas_cumprod.float()
        x_t = self.objective.noisy(x0, noise, t.to(x0.device), acp)
        out = self.adapter.raw_output(model, x_t, self.objective.model_timesteps(t).to(x0.device), text).float()
        channels = x0.shape[1]
        prediction = out[:, :channels]
        target = self.objective.target(x0, noise, t.to(x0.device), acp).float()
        if text.video is not None and self.adapter.options.get("expand_timesteps"):
            # Wan 2.2 TI2V's image mode: the first latent frame is given (the image's), not predicted
            prediction, target = prediction[:, :, 1:], target[:, :, 1:]
        loss = torch.mean((prediction - target) ** 2)
        if self.objective.learned_sigma and out.shape[1] == 2 * channels:
            loss = loss + self.variational_bound(prediction.detach(), out[:, channels:], x0, x_t, t).mean()
        return loss

    def variational_bound(self, eps: Tensor, v: Tensor, x0: Tensor, x_t: Tensor, t: Tensor) -> Tensor:
        """Per-sample (B,) bits per dimension of the learned variance (DiT's `_vb_terms_bpd` with
        `learned_range`): eps is the detached noise prediction, v in [-1, 1] the variance channels."""
        acp, betas = self.alphas_cumprod, self.betas
        prev = torch.cat([acp.new_ones(1), acp[:-1]])
        posterior_var = betas * (1 - prev) / (1 - acp)
        log_posterior = torch.log(torch.cat([posterior_var[1:2], posterior_var[1:]]))
        coef_x0, coef_xt = betas * prev.sqrt() / (1 - acp), (1 - prev) * (1 - betas).sqrt() / (1 - acp)

        def at(table: Tensor) -> Tensor:
            return table.to(x0.device)[t.long()].float().view(-1, *([1] * (x0.dim() - 1)))

        true_mean = at(coef_x0) * x0 + at(coef_xt) * x_t
        x0_pred = (1 / at(acp)).sqrt() * x_t - (1 / at(acp) - 1).sqrt() * eps
        model_mean = at(coef_x0) * x0_pred + at(coef_xt) * x_t
        frac = (v + 1) / 2
        model_log_var = frac * at(torch.log(betas)) + (1 - frac) * at(log_posterior)
        kl = 0.5 * (-1.0 + model_log_var - at(log_posterior) + torch.exp(at(log_posterior) - model_log_var)
                    + (true_mean - model_mean) ** 2 * torch.exp(-model_log_var))
        nll = -_discretized_gaussian_log_likelihood(x0, model_mean, 0.5 * model_log_var)
        dims = tuple(range(1, x0.dim()))
        kl, nll = kl.mean(dim=dims) / math.log(2.0), nll.mean(dim=dims) / math.log(2.0)
        return torch.where(t.to(x0.device) == 0, nll, kl)


def _approx_standard_normal_cdf(x: Tensor) -> Tensor:
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def _discretized_gaussian_log_likelihood(x: Tensor, means: Tensor, log_scales: Tensor) -> Tensor:
    """log p(x) of data in [-1, 1] quantised to 256 levels under N(means, exp(log_scales)^2) (DDPM's decoder)."""
    centered, inv_stdv = x - means, torch.exp(-log_scales)
    cdf_plus = _approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = _approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    cdf_delta = cdf_plus - cdf_min
    return torch.where(x < -0.999, log_cdf_plus,
                       torch.where(x > 0.999, log_one_minus_cdf_min, torch.log(cdf_delta.clamp(min=1e-12))))
