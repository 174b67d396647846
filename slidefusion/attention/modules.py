"""Thin nn.Modules around the functional attention ops, and their registry entries.

Each module maps tokens x (B, T, H, W, C) -> (B, T, H, W, C): one qkv projection, the operator,
one output projection. `GridAttention` owns the projections, so an operator only supplies
`attend(q, k, v)` on (B, T, H, W, heads, D) tensors.
"""

from collections.abc import Sequence

import torch
from torch import nn

from slidefusion.attention.functional import check_window_args, dense_attention, window_attention
from slidefusion.attention.registry import register_attention
from slidefusion.errors import UserError, check


class GridAttention(nn.Module):
    """Multi-head self-attention on a 3D token grid; subclasses define `attend`."""

    def __init__(self, dim: int, heads: int, qkv_bias: bool = True):
        super().__init__()
        check(heads >= 1, f"heads must be >= 1; got {heads}")
        check(dim % heads == 0, f"dim={dim} must be divisible by heads={heads}")
        self.dim, self.heads = dim, heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """(B, T, H, W, heads, D) x3 -> (B, T, H, W, heads, D)."""
        raise NotImplementedError(f"{type(self).__name__} must implement attend(q, k, v)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        check(
            x.dim() == 5 and x.shape[-1] == self.dim,
            f"x must be (B, T, H, W, C={self.dim}); got shape {tuple(x.shape)}",
        )
        B, T, H, W, C = x.shape
        qkv = self.qkv(x).reshape(B, T, H, W, 3, self.heads, C // self.heads)  # (B, T, H, W, 3, heads, D)
        q, k, v = qkv.unbind(dim=4)  # each (B, T, H, W, heads, D)
        out = self.attend(q, k, v).reshape(B, T, H, W, C)  # (B, T, H, W, C)
        return self.proj(out)  # (B, T, H, W, C)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}"


class DenseAttention3d(GridAttention):
    """Every token attends to every token (the quadratic baseline)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_attention(q, k, v)


class WindowAttention3d(GridAttention):
    """Swin-style (shifted) window attention; see `functional.window_attention` for the semantics."""

    def __init__(
        self,
        dim: int,
        heads: int,
        window_size: Sequence[int] = (2, 4, 4),
        shift: Sequence[int] = (0, 0, 0),
        qkv_bias: bool = True,
    ):
        super().__init__(dim, heads, qkv_bias)
        # Validate now so a bad config fails when the model is built, not at the first step.
        self.window_size, self.shift = check_window_args(window_size, shift)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return window_attention(q, k, v, self.window_size, self.shift)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window_size={self.window_size}, shift={self.shift}"


def _reject_unknown(name: str, options: dict, valid: Sequence[str]) -> None:
    if options:
        unknown = ", ".join(sorted(options))
        raise UserError(f"attention={name!r} has no option {unknown}; valid: {', '.join(valid) or 'none'}")


@register_attention("dense")
def build_dense(dim: int, heads: int, *, block_index: int = 0, **options) -> DenseAttention3d:
    qkv_bias = options.pop("qkv_bias", True)
    _reject_unknown("dense", options, ["qkv_bias"])
    return DenseAttention3d(dim, heads, qkv_bias=qkv_bias)


@register_attention("window")
def build_window(dim: int, heads: int, *, block_index: int = 0, **options) -> WindowAttention3d:
    """Windows of `window_size`; odd blocks shift by half a window on every axis (Swin's alternation)."""
    window_size = options.pop("window_size", (2, 4, 4))
    qkv_bias = options.pop("qkv_bias", True)
    _reject_unknown("window", options, ["window_size", "qkv_bias"])
    window_size, _ = check_window_args(window_size, (0, 0, 0))  # a YAML list becomes a tuple
    shift = tuple(w // 2 for w in window_size) if block_index % 2 else (0, 0, 0)
    return WindowAttention3d(dim, heads, window_size, shift, qkv_bias=qkv_bias)
