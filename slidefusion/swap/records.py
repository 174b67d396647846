"""`SlideOptions`: the user's choice of slide attention for a swap, validated when built.

What each family needs to be swapped (its stock processors, where a joint block's text tokens sit)
is its `SwapRecord`, on the family's record (`slidefusion.families`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from slidefusion.attention.backends import BACKENDS
from slidefusion.attention.functional import check_kernel_size
from slidefusion.core.errors import check, choose

Triple = tuple[int, int, int]
OFFSETS = ("sample", "shift", None)
TEMPORAL = ("dense", "slide")


@dataclass(frozen=True)
class SlideOptions:
    """How `use_slide_attention` swaps a model's self-attention.

    kernel_size: (kt, kh, kw) odd window sizes in tokens (an int: the same on every axis). A window
        larger than the token grid along an axis is clamped to that axis: it is attended whole.
    offsets: "sample" (one learned offset per window slot, the paper's form), "shift" (one per
        window and head, K times fewer offset parameters) or None (plain neighbourhood attention,
        no offset network).
    max_offset: offsets are bounded to +-max_offset tokens (tanh).
    temporal: what a temporal block (attention along time at each position: Latte's temporal
        blocks, STDiT's) gets: "dense" (stays stock; default, a short sequence of frames) or
        "slide" (a 1D window of kt frames).
    backend: the slide kernel, as `slide_attention`'s backend= ("auto" chooses per device).
    grid: the largest token grid (T, H, W) the model will run on, or None. A window wider than it
        along an axis is built just wide enough to cover it (the next odd size), so the offset
        network holds no window slots a forward can never use; on that grid the model computes what
        the window asked for computes. None: the model's own bound where its family has one (Wan:
        rope_max_seq_len on every axis), else the window as asked.
    """

    kernel_size: Triple = (3, 7, 7)
    offsets: str | None = "sample"
    max_offset: float = 0.9
    temporal: str = "dense"
    backend: str = "auto"
    grid: Triple | None = None

    def __post_init__(self):
        kernel = self.kernel_size
        if isinstance(kernel, int) and not isinstance(kernel, bool):
            kernel = (kernel,) * 3
        elif isinstance(kernel, Sequence) and not isinstance(kernel, str):
            kernel = tuple(kernel)  # a YAML list
        object.__setattr__(self, "kernel_size", check_kernel_size(kernel))
        choose(self.offsets, OFFSETS, "offsets")
        ok = isinstance(self.max_offset, (int, float)) and not isinstance(self.max_offset, bool)
        check(ok and math.isfinite(self.max_offset) and self.max_offset > 0,
              f"max_offset={self.max_offset!r} must be a finite number > 0 (tokens)")
        choose(self.temporal, TEMPORAL, "temporal")
        choose(self.backend, BACKENDS, "backend")
        if self.grid is not None:
            grid = tuple(self.grid) if isinstance(self.grid, Sequence) and not isinstance(self.grid, str) else ()
            ok = len(grid) == 3 and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in grid)
            check(ok, f"grid={self.grid!r} must be three ints >= 1 (T, H, W tokens), or None")
            object.__setattr__(self, "grid", grid)

    def clamped(self, bound: Triple | None) -> SlideOptions:
        """These options with the window built for `grid` (or `bound` when grid is None): each axis
        at most the next odd size >= the grid's, which still covers that axis whole."""
        grid = self.grid or bound
        if grid is None:
            return self
        kernel = tuple(min(k, n + 1 - n % 2) for k, n in zip(self.kernel_size, grid))
        return dataclasses.replace(self, kernel_size=kernel)

    def site_kernel(self, kind: str) -> Triple:
        """The window of a block of `kind`: full 3D, (1, kh, kw) inside each frame, (kt, 1, 1) along time."""
        kt, kh, kw = self.kernel_size
        return {"full": (kt, kh, kw), "spatial": (1, kh, kw), "temporal": (kt, 1, 1)}[kind]


def view_grid(kind: str, grid: Triple) -> Triple:
    """The grid one attention call sees for a model token grid (T, H, W): all of it, one frame
    (1, H, W) per row of a spatial block, or one position's frames (T, 1, 1) in a temporal block."""
    t, h, w = grid
    return {"full": grid, "spatial": (1, h, w), "temporal": (t, 1, 1)}[kind]
