"""Layers shared by DiT3D and STDiT. Pure math: no devices, no distribution, no offloading.

Token grids are (B, T, H, W, C) throughout, so every self-attention operator sees the 3D layout.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN: x (B, ..., C) scaled and shifted per sample by (B, C) vectors."""
    view = (x.shape[0],) + (1,) * (x.dim() - 2) + (x.shape[-1],)
    return x * (1 + scale.view(view)) + shift.view(view)


def sincos_1d(positions: Tensor, dim: int) -> Tensor:
    """Sin-cos features (N, dim) of float positions (N,); dim is even."""
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, dtype=torch.float64) / (dim // 2))
    angles = positions.to(torch.float64)[:, None] * freqs[None]  # (N, dim/2)
    return torch.cat([angles.sin(), angles.cos()], dim=1).float()  # (N, dim)


def sincos_3d(grid: tuple[int, int, int], dim: int) -> Tensor:
    """Fixed 3D positions (T, H, W, dim): the channels are split into three even parts for t, h, w.

    Computed for any grid, so a model trained on short clips runs on longer ones unchanged.
    """
    d_t = d_h = (dim // 3) // 2 * 2
    d_w = dim - d_t - d_h
    t, h, w = grid
    parts = [
        sincos_1d(torch.arange(t), d_t)[:, None, None, :].expand(t, h, w, d_t),
        sincos_1d(torch.arange(h), d_h)[None, :, None, :].expand(t, h, w, d_h),
        sincos_1d(torch.arange(w), d_w)[None, None, :, :].expand(t, h, w, d_w),
    ]
    return torch.cat(parts, dim=-1)  # (T, H, W, dim)


class TimestepEmbedder(nn.Module):
    """Flow time t in [0, 1] (B,) -> conditioning vector (B, hidden), as DiT's (on t * 1000)."""

    def __init__(self, hidden: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: Tensor) -> Tensor:
        freqs = sincos_1d(t.float() * 1000.0, self.freq_dim).to(t.device)  # (B, freq_dim)
        return self.mlp(freqs.to(self.mlp[0].weight.dtype))  # (B, hidden)


class TextProjection(nn.Module):
    """Text encoder states (B, L, text_dim) -> (B, L, hidden), as PixArt's caption projection."""

    def __init__(self, text_dim: int, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(text_dim, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, hidden))

    def forward(self, context: Tensor) -> Tensor:
        return self.mlp(context)


class PooledTextEmbedder(nn.Module):
    """Text states (B, L, text_dim) -> one conditioning vector (B, hidden): the mean over real
    tokens through an MLP whose last layer starts at zero, so adding it changes nothing at first
    (a checkpoint without it loads into a model with it and behaves the same)."""

    def __init__(self, text_dim: int, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(text_dim, hidden), nn.SiLU(), nn.Linear(hidden, hidden))
        nn.init.zeros_(self.mlp[2].weight)
        nn.init.zeros_(self.mlp[2].bias)

    def forward(self, context: Tensor, mask: Tensor | None = None) -> Tensor:
        """`mask` (B, L) is True on real tokens; without it, tokens whose states are all zero are
        padding (`TextEncoder.encode` and the caption cache zero the padding)."""
        if mask is None:
            mask = context.ne(0).any(-1)  # (B, L)
        weight = mask.to(context.dtype)[..., None]  # (B, L, 1)
        pooled = (context * weight).sum(1) / weight.sum(1).clamp(min=1.0)  # (B, text_dim)
        return self.mlp(pooled)  # (B, hidden)


class Mlp(nn.Module):
    def __init__(self, dim: int, ratio: float):
        super().__init__()
        inner = int(dim * ratio)
        self.fc1 = nn.Linear(dim, inner)
        self.fc2 = nn.Linear(inner, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CrossAttention(nn.Module):
    """Video tokens (B, N, C) attend to text tokens (B, L, C); `mask` (B, L) is True on real tokens."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor, context: Tensor, mask: Tensor | None) -> Tensor:
        b, n, c = x.shape
        q = self.q(x).view(b, n, self.heads, -1).transpose(1, 2)  # (B, heads, N, D)
        k, v = self.kv(context).view(b, -1, 2, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)  # (B, heads, L, D)
        attn_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, L)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)  # (B, heads, N, D)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class DiTBlock(nn.Module):
    """Self-attention over the grid, cross-attention to text, MLP; adaLN-Zero conditioning (DiT).

    `attn` maps (B, T, H, W, C) -> (B, T, H, W, C); what it attends over (the whole grid, a window,
    one frame, one position through time) is its own business. `kind` names it for outside plans.
    """

    def __init__(self, dim: int, heads: int, mlp_ratio: float, attn: nn.Module, kind: str = "full"):
        super().__init__()
        self.kind = kind
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = attn
        self.norm_cross = nn.LayerNorm(dim, eps=1e-6)
        self.cross_attn = CrossAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(dim, mlp_ratio)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim))
        nn.init.zeros_(self.adaLN_modulation[1].weight)  # adaLN-Zero: every block starts as identity
        nn.init.zeros_(self.adaLN_modulation[1].bias)

    def forward(self, x: Tensor, c: Tensor, context: Tensor, context_mask: Tensor | None = None) -> Tensor:
        """x (B, T, H, W, C), c (B, C), context (B, L, C), context_mask (B, L) -> (B, T, H, W, C)."""
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaLN_modulation(c).chunk(6, dim=-1)  # 6 x (B, C)
        gate = (x.shape[0], 1, 1, 1, x.shape[-1])
        x = x + gate_a.view(gate) * self.attn(modulate(self.norm1(x), shift_a, scale_a))
        tokens = x.flatten(1, 3)  # (B, N, C)
        tokens = tokens + self.cross_attn(self.norm_cross(tokens), context, context_mask)
        x = tokens.view_as(x)
        return x + gate_m.view(gate) * self.mlp(modulate(self.norm2(x), shift_m, scale_m))


class FinalLayer(nn.Module):
    """adaLN-modulated norm, then a zero-initialised projection to patch values (B, ..., p*C_out)."""

    def __init__(self, dim: int, patch_values: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim))
        self.linear = nn.Linear(dim, patch_values)
        for layer in (self.adaLN_modulation[1], self.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)  # 2 x (B, C)
        return self.linear(modulate(self.norm(x), shift, scale))


def unpatchify(x: Tensor, patch: tuple[int, int, int], channels: int) -> Tensor:
    """Patch values (B, T', H', W', pt*ph*pw*C) -> video latents (B, C, T'*pt, H'*ph, W'*pw)."""
    b, t, h, w, _ = x.shape
    pt, ph, pw = patch
    x = x.view(b, t, h, w, pt, ph, pw, channels)
    x = x.permute(0, 7, 1, 4, 2, 5, 3, 6)  # (B, C, T', pt, H', ph, W', pw)
    return x.reshape(b, channels, t * pt, h * ph, w * pw)
