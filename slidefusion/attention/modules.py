"""Thin nn.Modules around the functional attention ops, and their registry entries.

Each module maps tokens x (B, T, H, W, C) -> (B, T, H, W, C): one qkv projection, the operator,
one output projection. `GridAttention` owns the projections, so an operator only supplies
`attend(q, k, v)` on (B, T, H, W, heads, D) tensors.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from slidefusion.attention.functional import (
    check_kernel_size,
    check_window_args,
    dense_attention,
    effective_kernel,
    slide_attention,
    window_attention,
)
from slidefusion.attention.registry import register_attention
from slidefusion.attention.tiling import TileRule, neighborhood_halo, slide_halo, window_rule
from slidefusion.core.errors import UserError, check, choose
from slidefusion.core.validate import renamed_keys


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
    """Every token attends to every token (the quadratic baseline).

    Tiling (see `attention.tiling`): no crop of the grid is exact, so a tile's queries run against
    keys and values of the whole grid: `tile_keys` on every tile, then `tile_attend` per tile.
    """

    def tile_rule(self, grid: tuple[int, int, int]) -> TileRule:
        return TileRule(axis=1, halo=None)

    def tile_keys(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens x (B, t, H, W, C) -> their keys and values, each (B, t, H, W, heads, D)."""
        C = self.dim
        bias = None if self.qkv.bias is None else self.qkv.bias[C:]
        kv = F.linear(x, self.qkv.weight[C:], bias).reshape(*x.shape[:4], 2, self.heads, C // self.heads)
        return kv[..., 0, :, :], kv[..., 1, :, :]

    def tile_attend(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Query tokens x (B, t, H, W, C) against keys and values (B, T, H, W, heads, D) of the
        whole grid -> (B, t, H, W, C): this module's forward, restricted to the queries x."""
        B, t, H, W, C = x.shape
        bias = None if self.qkv.bias is None else self.qkv.bias[:C]
        q = F.linear(x, self.qkv.weight[:C], bias).reshape(B, t * H * W, self.heads, C // self.heads)
        keys, values = (z.reshape(B, -1, self.heads, C // self.heads).transpose(1, 2) for z in (k, v))  # (B, heads, N, D)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values)  # (B, heads, t*H*W, D)
        return self.proj(out.transpose(1, 2).reshape(B, t, H, W, C))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return dense_attention(q, k, v)


class WindowAttention3d(GridAttention):
    """Swin-style (shifted) window attention; see `functional.window_attention` for the semantics."""

    def tile_rule(self, grid: tuple[int, int, int]) -> TileRule:
        return window_rule(self.window_size[0], self.shift[0] > 0)

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


@register_attention("dense", memory="dense", swap=True)
def build_dense(dim: int, heads: int, *, block_index: int = 0, **options) -> DenseAttention3d:
    qkv_bias = options.pop("qkv_bias", True)
    _reject_unknown("dense", options, ["qkv_bias"])
    return DenseAttention3d(dim, heads, qkv_bias=qkv_bias)


@register_attention("window", memory="window")
def build_window(dim: int, heads: int, *, block_index: int = 0, **options) -> WindowAttention3d:
    """Windows of `window_size`; odd blocks shift by half a window on every axis (Swin's alternation)."""
    window_size = options.pop("window_size", (2, 4, 4))
    qkv_bias = options.pop("qkv_bias", True)
    _reject_unknown("window", options, ["window_size", "qkv_bias"])
    window_size, _ = check_window_args(window_size, (0, 0, 0))  # a YAML list becomes a tuple
    shift = tuple(w // 2 for w in window_size) if block_index % 2 else (0, 0, 0)
    return WindowAttention3d(dim, heads, window_size, shift, qkv_bias=qkv_bias)


class NeighborhoodAttention3d(GridAttention):
    """Each token attends to its kt x kh x kw neighbourhood (NATTEN's na3d border rule)."""

    def tile_rule(self, grid: tuple[int, int, int]) -> TileRule:
        return TileRule(axis=1, halo=neighborhood_halo(self.kernel_size[0]))

    def __init__(self, dim: int, heads: int, kernel_size: Sequence[int] = (3, 7, 7), qkv_bias: bool = True):
        super().__init__(dim, heads, qkv_bias)
        self.kernel_size = check_kernel_size(kernel_size)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return slide_attention(q, k, v, self.kernel_size)  # a window larger than the grid is clamped to it

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, kernel_size={self.kernel_size}"


OFFSETS = ("sample", "shift")  # the offset network's forms (see `_OffsetLayers`)


class _OffsetLayers:
    """The learned offsets of slide attention, shared by `SlideAttention3d` and `OffsetNet`.

    The offset network reads the queries: a depthwise 3x3x3 Conv3d (local motion context), GELU,
    and a Linear to `heads * K * 3` offsets (offsets="sample", one per window slot, the paper's
    form) or `heads * 3` (offsets="shift": the whole window of each head moves, K times cheaper
    to predict). The Linear starts at zero, so training starts as neighbourhood attention, and
    offsets are bounded to +-max_offset tokens by a tanh; below 1 the kernels' halo grows by only
    one token per side.
    """

    def _build_offset_layers(self, dim: int, heads: int, kernel_size, offsets: str, max_offset: float) -> None:
        self.kernel_size = check_kernel_size(kernel_size)
        choose(offsets, OFFSETS, "offsets")
        check(
            isinstance(max_offset, (int, float)) and not isinstance(max_offset, bool) and max_offset > 0,
            f"max_offset={max_offset!r} must be a number > 0 (tokens)",
        )
        self.offsets, self.max_offset, self.offset_heads = offsets, float(max_offset), heads
        kt, kh, kw = self.kernel_size
        self.slots = kt * kh * kw if offsets == "sample" else 1
        self.offset_conv = nn.Conv3d(dim, dim, kernel_size=3, padding=1, groups=dim)
        self.offset_linear = nn.Linear(dim, heads * self.slots * 3)
        nn.init.zeros_(self.offset_linear.weight)
        nn.init.zeros_(self.offset_linear.bias)

    def predict_offsets(self, q: torch.Tensor, kernel: tuple[int, int, int]) -> torch.Tensor:
        """Queries (B, T, H, W, heads, D) -> offsets (B, T, H, W, heads, K or 1, 3) in tokens for
        `kernel`, the window the op uses (`kernel_size` clamped to the grid)."""
        B, T, H, W, heads, D = q.shape
        # Contiguous (B, C, T, H, W): with the channels-last strides the permute leaves, CPU torch
        # 2.13's depthwise Conv3d backward sometimes returns a garbage weight gradient (1e18 or
        # NaN where the exact one is 1e-5; seen in bf16 under the offload engine's recompute).
        x = q.reshape(B, T, H, W, heads * D).permute(0, 4, 1, 2, 3).contiguous()  # (B, C, T, H, W)
        x = F.gelu(self.offset_conv(x)).permute(0, 2, 3, 4, 1)  # (B, T, H, W, C)
        off = self.max_offset * torch.tanh(self.offset_linear(x))  # (B, T, H, W, heads*slots*3)
        if self.slots == 1:
            return off.view(B, T, H, W, heads, 1, 3)
        # A window clamped to a small grid keeps the offsets of its centre slots.
        off = off.view(B, T, H, W, heads, *self.kernel_size, 3)
        for axis, (k_full, k) in enumerate(zip(self.kernel_size, kernel)):
            off = off.narrow(5 + axis, (k_full - k) // 2, k)
        return off.reshape(B, T, H, W, heads, -1, 3)


class OffsetNet(_OffsetLayers, nn.Module):
    """The offset network of slide attention on its own, for attention modules we do not own
    (diffusers' processors, see `slidefusion.swap`). `forward(q, kernel)` = `predict_offsets`."""

    def __init__(self, dim: int, heads: int, kernel_size: Sequence[int] = (3, 7, 7), offsets: str = "sample",
                 max_offset: float = 0.9):
        super().__init__()
        check(dim % heads == 0, f"dim={dim} must be divisible by heads={heads}")
        self._build_offset_layers(dim, heads, kernel_size, offsets, max_offset)

    def forward(self, q: torch.Tensor, kernel: tuple[int, int, int]) -> torch.Tensor:
        return self.predict_offsets(q, kernel)

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, offsets={self.offsets!r}, max_offset={self.max_offset}"


class SlideAttention3d(_OffsetLayers, GridAttention):
    """3D deformable slide attention: a neighbourhood window whose sample points move by learned
    offsets (see `_OffsetLayers` for the offset network and its zero start)."""

    def tile_rule(self, grid: tuple[int, int, int]) -> TileRule:
        radius = self.offset_conv.kernel_size[0] // 2  # the offset network's reach along time
        return TileRule(axis=1, halo=slide_halo(self.kernel_size[0], self.max_offset, radius))

    def __init__(
        self,
        dim: int,
        heads: int,
        kernel_size: Sequence[int] = (3, 7, 7),
        offsets: str = "sample",
        max_offset: float = 0.9,
        qkv_bias: bool = True,
    ):
        super().__init__(dim, heads, qkv_bias)
        self._build_offset_layers(dim, heads, kernel_size, offsets, max_offset)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kernel = effective_kernel(self.kernel_size, tuple(q.shape[1:4]))  # the window the op will use
        return slide_attention(q, k, v, self.kernel_size, offsets=self.predict_offsets(q, kernel))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, kernel_size={self.kernel_size}, offsets={self.offsets!r}, "
            f"max_offset={self.max_offset}"
        )


def _kernel_option(options: dict) -> tuple[int, int, int]:
    return check_kernel_size(tuple(options.pop("kernel_size", (3, 7, 7))))  # a YAML list becomes a tuple


@register_attention("neighborhood", swap=True)
def build_neighborhood(dim: int, heads: int, *, block_index: int = 0, **options) -> NeighborhoodAttention3d:
    kernel = _kernel_option(options)
    qkv_bias = options.pop("qkv_bias", True)
    _reject_unknown("neighborhood", options, ["kernel_size", "qkv_bias"])
    return NeighborhoodAttention3d(dim, heads, kernel, qkv_bias=qkv_bias)


@register_attention("slide", memory="slide", swap=True)
def build_slide(dim: int, heads: int, *, block_index: int = 0, **options) -> SlideAttention3d:
    options = renamed_keys(options, {"offset_mode": "offsets"}, "model.attention_options")
    kernel = _kernel_option(options)
    offsets = options.pop("offsets", "sample")
    max_offset = options.pop("max_offset", 0.9)
    qkv_bias = options.pop("qkv_bias", True)
    _reject_unknown("slide", options, ["kernel_size", "offsets", "max_offset", "qkv_bias"])
    return SlideAttention3d(dim, heads, kernel, offsets, max_offset, qkv_bias=qkv_bias)
