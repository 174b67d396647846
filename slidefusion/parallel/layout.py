"""Layout maths for sequence parallelism: uneven splits and the chunks of a sliced switch.

Pure tensor code, no torch.distributed, so every rule here is tested with hash-coded positions.

Tokens are handled in a canonical 4-D view (B, T, S, C), S = H*W flattened in row-major order.
A *layout* is the axis the ranks shard: FRAMES (axis 1, each rank holds whole frames, what a spatial
block needs) or POSITIONS (axis 2, each rank holds every frame of some positions, what a temporal
block needs). Sizes that P does not divide are split unevenly (the first `n % P` ranks get one
more); a rank may hold nothing (T < P), and then it simply computes nothing.

A *switch* moves tokens from sharding axis `a` to sharding axis `b`. It is cut into chunks
(p, c): p is the producer's slice of its own shard along `a` (the sender can send it as soon as that
slice is computed), c the consumer's slice of its shard along `b` (the receiver can compute it as
soon as every chunk (., c) arrived). Chunk (p, c) is one all-to-all: sender r gives rank j the
block x[a in A_r^p, b in B_j^c]; rank j reassembles slice c as the concatenation over (i, p).
"""

from dataclasses import dataclass

import torch
from torch import Tensor

FRAMES, POSITIONS = 1, 2  # the sharded axis of the canonical (B, T, S, C) view
AXIS_NAMES = {FRAMES: "frames", POSITIONS: "positions"}


def split_sizes(n: int, parts: int) -> list[int]:
    """Sizes of `parts` contiguous pieces of `n` items; the first `n % parts` get one more."""
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


@dataclass(frozen=True)
class Split:
    """An uneven split of `n` items into `parts` contiguous ranges."""

    n: int
    parts: int

    @property
    def sizes(self) -> list[int]:
        return split_sizes(self.n, self.parts)

    def start(self, i: int) -> int:
        return sum(self.sizes[:i])

    def range(self, i: int) -> tuple[int, int]:
        """(start, length) of piece i."""
        return self.start(i), self.sizes[i]

    def sub(self, i: int, slices: int) -> "list[tuple[int, int]]":
        """Piece i cut into `slices` sub-ranges, as (start, length) in global coordinates."""
        start, length = self.range(i)
        out = []
        for size in split_sizes(length, slices):
            out.append((start, size))
            start += size
        return out


def shard(x: Tensor, axis: int, split: Split, rank: int) -> Tensor:
    """Rank's piece of the full canonical tensor x (B, T, S, C) along `axis`."""
    start, length = split.range(rank)
    return x.narrow(axis, start, length)


def local_slices(x: Tensor, axis: int, slices: int) -> list[Tensor]:
    """A local shard cut into `slices` contiguous pieces along `axis` (uneven, maybe empty)."""
    return list(torch.split(x, split_sizes(x.shape[axis], slices), dim=axis))


def pack_chunk(piece: Tensor, b_axis: int, b_split: Split, c: int, slices: int) -> tuple[Tensor, list[int]]:
    """Send buffer of chunk (p, c): for every destination j, piece[b in B_j^c], flattened and
    concatenated in rank order. `piece` is the producer slice p (B, ., ., C). Returns (buffer, numels)."""
    parts = []
    for j in range(b_split.parts):
        start, length = b_split.sub(j, slices)[c]
        parts.append(piece.narrow(b_axis, start, length).reshape(-1))
    return torch.cat(parts), [p.numel() for p in parts]


def chunk_shapes(shape: tuple[int, ...], a_axis: int, a_split: Split, producer_slices: int, p: int,
                 b_axis: int, b_split: Split, rank: int, consumer_slices: int, c: int) -> list[tuple[int, ...]]:
    """Shapes of the blocks rank receives in chunk (p, c), one per source rank i:
    x[a in A_i^p, b in B_rank^c] with the other axes of `shape` (the full canonical shape)."""
    b_len = b_split.sub(rank, consumer_slices)[c][1]
    shapes = []
    for i in range(a_split.parts):
        dims = list(shape)
        dims[a_axis] = a_split.sub(i, producer_slices)[p][1]
        dims[b_axis] = b_len
        shapes.append(tuple(dims))
    return shapes


def unpack_consumer_slice(buffers: list[Tensor], shapes: list[list[tuple[int, ...]]], a_axis: int) -> Tensor:
    """Consumer slice c from its received chunks: buffers[p] is chunk (p, c)'s receive buffer and
    shapes[p] its per-source shapes. The full axis `a` is ordered by source i, then producer slice p."""
    blocks = {}
    for p, (buffer, per_source) in enumerate(zip(buffers, shapes)):
        offset = 0
        for i, block_shape in enumerate(per_source):
            numel = 1
            for d in block_shape:
                numel *= d
            blocks[i, p] = buffer[offset:offset + numel].view(block_shape)
            offset += numel
    order = sorted(blocks)  # (i, p) lexicographic: source rank first, then its slices
    return torch.cat([blocks[key] for key in order], dim=a_axis)
