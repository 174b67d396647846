"""Euler sampling of the flow ODE from noise (t = 1) to data (t = 0), with classifier-free guidance."""

import torch
from torch import Tensor
from tqdm.auto import tqdm

from slidefusion.core.errors import check


def timestep_schedule(steps: int, shift: float = 1.0) -> Tensor:
    """Times (steps + 1,) from 1 to 0; `shift` > 1 spends more steps near noise (SD3's shift)."""
    check(steps >= 1, f"steps={steps} must be >= 1")
    check(shift > 0, f"shift={shift} must be > 0")
    t = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).float()


def pad_tokens(states: Tensor, mask: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Right-pad text states (B, L, D) and mask (B, L) to `length` tokens."""
    extra = length - states.shape[1]
    if extra == 0:
        return states, mask
    states = torch.cat([states, states.new_zeros(states.shape[0], extra, states.shape[2])], dim=1)
    return states, torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1)


def guided_velocity(model, x: Tensor, t: Tensor, cond: tuple[Tensor, Tensor], uncond: tuple[Tensor, Tensor] | None,
                    guidance: float) -> Tensor:
    """v = v_u + guidance (v_c - v_u), both halves in one batch; plain v_c without `uncond`."""
    if uncond is None or guidance == 1.0:
        return model(x, t, *cond)
    length = max(cond[0].shape[1], uncond[0].shape[1])
    (c_states, c_mask), (u_states, u_mask) = pad_tokens(*cond, length), pad_tokens(*uncond, length)
    v = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([c_states, u_states]), torch.cat([c_mask, u_mask]))
    v_cond, v_uncond = v.chunk(2)
    return v_uncond + guidance * (v_cond - v_uncond)


@torch.no_grad()
def sample(model, shape: tuple[int, ...], cond: tuple[Tensor, Tensor], uncond: tuple[Tensor, Tensor] | None = None,
           *, steps: int = 30, guidance: float = 4.0, seed: int = 0, shift: float = 1.0,
           device: str | torch.device = "cpu", progress: bool = True, noise: Tensor | None = None) -> Tensor:
    """Integrate dx/dt = v from pure noise to latents of `shape` (B, C, T, H, W).

    `cond` and `uncond` are (states (B, L, D), mask (B, L)) text encodings; the initial noise is
    drawn on the CPU from `seed`, so the same seed gives the same video bit for bit on a device.
    `noise` of `shape` replaces that draw (a batch whose videos each keep their own seed).
    """
    if noise is None:
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    check(tuple(noise.shape) == tuple(shape), f"noise has shape {tuple(noise.shape)}; expected {tuple(shape)}")
    x = noise.to(device)
    cond = tuple(c.to(device) for c in cond)
    uncond = None if uncond is None else tuple(u.to(device) for u in uncond)
    times = timestep_schedule(steps, shift)
    for i in tqdm(range(steps), desc="sampling", disable=not progress, leave=False):
        t = times[i].expand(shape[0]).to(device)
        v = guided_velocity(model, x, t, cond, uncond, guidance)
        x = x + (times[i + 1] - times[i]).item() * v
    return x
