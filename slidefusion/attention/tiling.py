"""What part of the token grid a self-attention's outputs depend on: the capability tiling reads.

A module that can run on a slab of the grid declares `tile_rule(grid) -> TileRule`; an engine
then runs the block around it slab by slab (`slidefusion.offload.tiling.tiled`). A module without the
method has an unknown halo and cannot be tiled.

A tile is a range [a, b) along one grid axis of (B, T, H, W, C) (frames, or rows for attention
along time). Its *context* [A, B) is the range whose attention, computed on the cropped grid
alone, gives exactly the full grid's outputs at the tile's queries. `halo=None` means no crop is
exact (dense attention: every key matters): the queries of a tile then run against keys and values
of the whole grid (`tile_keys` / `tile_attend` on the module).

The halos, derived from each operator's own definition (tests/offload/test_offload_tiling.py
checks each is exact and that one frame less is not):

Neighbourhood, kernel k along the axis (NATTEN's border rule: the window of query t starts at
clamp(t - k//2, 0, L - k)). Away from the grid's ends a query needs k//2 frames each side. At an
end the window is pinned: query 0 sees [0, k), so a 1-frame tile at the edge needs k - 1 frames of
context on its far side, and a cropped grid shorter than k would shrink the window itself. So
halo = k - 1 (for k > L the context is the whole axis, and the window is clamped alike).

Slide: the same window, every sample point moved by an offset |o| <= m (the module's
max_offset) and read by trilinear interpolation. The far corner of the last point is
floor(window end + m) + 1, the near corner floor(window start - m); both must lie inside the
context, because clamping a point (or its upper corner) at the context's edge is not clamping it at
the grid's edge, and the corner's value enters the offset gradient even where its weight is 0.
With the pinned edge window that is halo = (k - 1) + floor(m) + 1 = k + floor(m) (the near side
needs k - 1 + ceil(m), never more). The offset network reads the queries through a 3-wide
depthwise convolution: 1 frame of context, already covered.

Swin windows of w frames shifted by s (boundaries at s + j*w, and the grid's ends): a tile's
queries see exactly their own segment, so the context must contain whole segments and be
partitioned the same way. Starting the context at a multiple of w keeps the boundaries at the same
offsets (`align=w`); ending it w - 1 frames past the tile puts the tile's last segment inside it
(the partial segment it may cut contains no tile query). With a shift, a context of exactly w
frames (a 1-frame tile at the grid's start) would be treated as one unshifted window, so shifted
windows need one frame more. So halo = w - 1 unshifted, w shifted, align = w. Padding and shift
masks are then computed by the operator on coordinates that agree with the full grid's.
"""

import math
from dataclasses import dataclass

from slidefusion.errors import check

AXES = {1: "frames", 2: "rows"}


@dataclass(frozen=True)
class TileRule:
    """How a self-attention over (B, T, H, W, C) can run on a slab of the grid.

    axis: the grid axis tiles cut (1: frames, 2: rows); halo: slices of context each side of a
    tile (None: the queries need every key, see the module docstring); align: the context starts
    at a multiple of this (window attention)."""

    axis: int = 1
    halo: int | None = 0
    align: int = 1

    def __post_init__(self):
        check(self.axis in AXES, f"TileRule.axis={self.axis} must be 1 (frames) or 2 (rows)")
        check(self.halo is None or self.halo >= 0, f"TileRule.halo={self.halo} must be >= 0 or None")
        check(self.align >= 1, f"TileRule.align={self.align} must be >= 1")

    def context(self, start: int, stop: int, length: int) -> tuple[int, int]:
        """[A, B): the range of the axis (of `length` slices) the queries [start, stop) depend on."""
        if self.halo is None:
            return 0, length
        first = max(0, start - self.halo) // self.align * self.align
        return first, min(length, stop + self.halo)


def neighborhood_halo(kernel: int) -> int:
    """Frames of context each side for a neighbourhood window of `kernel` frames (module docstring)."""
    return kernel - 1


def slide_halo(kernel: int, max_offset: float, conv_radius: int = 1) -> int:
    """Frames of context each side for slide attention: the pinned window, the bounded offsets and
    the trilinear corner (module docstring), and the offset network's own receptive field."""
    return max(kernel + math.floor(max_offset), conv_radius)


def window_rule(window_frames: int, shifted: bool) -> TileRule:
    """Swin windows of `window_frames` frames, `shifted` or not: whole, aligned windows."""
    return TileRule(axis=1, halo=window_frames - 1 + int(shifted), align=window_frames)
