"""One model call's tokens on one rank: the canonical view, this rank's shard, and the gather.

Between blocks, every schedule keeps a model's tokens sharded by *positions*: a spatial-temporal
model holds every frame of positions S_r of each frame, a full-3D one positions N_r of the flattened
T*H*W sequence (seen as one frame). That layout survives whatever a model's forward does between
its blocks (Latte reshapes (B*T, S, C) <-> (B*S, T, C) and adds a temporal position table there),
because per-token code does not care how many positions a tensor holds.

Hooks see a block's own token tensor; `Tokens` converts it to and from the canonical (B, T', L, C)
view of `layout.py` (T' = T and L = H*W for spatial-temporal models, T' = 1 and L = T*H*W for
full-3D ones), for the two layouts of `records.ModelAccess`:
  GRID: (B, T, H, W, C), a shard of positions as (B, T', L_r, 1, C) (our DiT3D / STDiT);
  ROWS: (B*T', L, C) into spatial and full blocks, (B*L, T, C) into temporal ones (Latte, Wan).
"""

from dataclasses import dataclass

from torch import Tensor

from slidefusion.parallel.comm import Comm
from slidefusion.parallel.exchange import gather_shards
from slidefusion.parallel.layout import POSITIONS, Split
from slidefusion.families.records import GRID


@dataclass(frozen=True)
class Tokens:
    """grid (T, H, W) after patching; batch B of this call (after a CFG-parallel split);
    keep_frames: spatial-temporal (positions sharded within each frame) or full-3D; layout GRID | ROWS;
    ranks / rank: the sequence group."""

    grid: tuple[int, int, int]
    batch: int
    keep_frames: bool
    layout: str
    ranks: int
    rank: int

    @property
    def frames(self) -> int:
        """T' of the canonical view."""
        return self.grid[0] if self.keep_frames else 1

    @property
    def length(self) -> int:
        """L of the canonical view: positions per frame, or every token of a full-3D model."""
        t, h, w = self.grid
        return h * w if self.keep_frames else t * h * w

    @property
    def full(self) -> tuple[int, int, int]:
        """(B, T', L) of the whole canonical tensor (C is the caller's)."""
        return self.batch, self.frames, self.length

    @property
    def split(self) -> Split:
        return Split(self.length, self.ranks)

    @property
    def span(self) -> tuple[int, int]:
        """(start, count) of this rank's positions."""
        return self.split.range(self.rank)

    def canonical(self, x: Tensor, kind: str) -> Tensor:
        """A block's token tensor (any shard) -> (B, T'', L'', C)."""
        b, c = self.batch, x.shape[-1]
        if self.layout == GRID:
            frames = 1 if kind == "full" else x.shape[1]
            return x.reshape(b, frames, x.numel() // max(1, b * frames * c), c)
        rows = x.shape[0] // b  # not -1: a rank may hold no rows
        if kind == "temporal":  # (B*L'', T, C)
            return x.view(b, rows, x.shape[1], c).transpose(1, 2)
        return x.view(b, rows, x.shape[1], c)  # (B*T'', L'', C); a full block's (B, N'', C)

    def block_input(self, canonical: Tensor, kind: str, whole_frames: bool) -> Tensor:
        """(B, T'', L'', C) -> the block's own token tensor. whole_frames: the piece holds whole
        frames (L'' = H*W), which our grid blocks take as (B, T'', H, W, C)."""
        b, t, n, c = canonical.shape
        if self.layout == GRID:
            if whole_frames:
                return canonical.reshape(b, t, self.grid[1], self.grid[2], c)
            return canonical.reshape(b, t, n, 1, c)
        if kind == "temporal":
            return canonical.transpose(1, 2).reshape(b * n, t, c)
        return canonical.reshape(b * t, n, c)

    def shard(self, x: Tensor, kind: str) -> Tensor:
        """The first block's whole input -> this rank's positions, in the block's own layout."""
        local = self.canonical(x, kind).narrow(POSITIONS, *self.span)
        return self.block_input(local, kind, whole_frames=False)

    def gather(self, comm: Comm, y: Tensor) -> Tensor:
        """The output module's output on this rank's positions -> the whole of it on every rank:
        GRID (B, T, H, W, K), ROWS (B*T', L, K)."""
        kind = "spatial" if self.keep_frames else "full"
        whole = gather_shards(comm, self.canonical(y, kind), POSITIONS, self.split.sizes)  # (B, T', L, K)
        if self.layout == GRID:
            return whole.reshape(self.batch, *self.grid, whole.shape[-1])
        return whole.reshape(self.batch * self.frames, self.length, whole.shape[-1])

    def cut(self, t: Tensor, dim: int) -> Tensor:
        """A per-token tensor (one entry per position along `dim`) -> this rank's entries."""
        if t.shape[dim] != self.length:
            raise RuntimeError(f"a per-token tensor has {t.shape[dim]} entries along dim {dim}; the call has "
                               f"{self.length} tokens (the model's parallel record does not fit this call)")
        return t.narrow(dim, *self.span)

    def cut_rows(self, t: Tensor, start: int, count: int) -> Tensor:
        """A block argument with one row per (sample, frame) or (sample, position) -> the rows of
        frames / positions [start, start + count)."""
        return t.unflatten(0, (self.batch, -1)).narrow(1, start, count).flatten(0, 1)
