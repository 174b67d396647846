"""Hand tokens from one layer to the next, slice by slice.

The producing layer calls `send(p, piece)` as soon as its slice p is computed; the consuming layer
calls `receive(c)` right before computing its slice c. A `Switch` (layouts differ) turns each
(p, c) chunk into one all-to-all and waits only on the chunks slice c needs; a `Handoff` (same
layout) is a local re-slicing. With `overlap=False` every all-to-all is waited on at once (DSP).
"""

import math

import torch
from torch import Tensor

from slidefusion.parallel.comm import Comm, Handle
from slidefusion.parallel.layout import AXIS_NAMES, Split, chunk_shapes, local_slices, pack_chunk, unpack_consumer_slice


class Handoff:
    """Same layout on both sides: concatenate the producer slices, re-cut for the consumer."""

    def __init__(self, axis: int, consumer_slices: int):
        self.axis, self.consumer_slices = axis, consumer_slices
        self.pieces: dict[int, Tensor] = {}
        self.cut: list[Tensor] | None = None

    def send(self, p: int, piece: Tensor) -> None:
        self.pieces[p] = piece

    def receive(self, c: int) -> Tensor:
        if self.cut is None:
            whole = torch.cat([self.pieces[p] for p in sorted(self.pieces)], dim=self.axis)
            self.cut = local_slices(whole, self.axis, self.consumer_slices)
        return self.cut[c]


class Switch:
    """Shard axis a -> shard axis b for canonical tokens of `full_shape` (B, T, S, C)."""

    def __init__(self, comm: Comm, full_shape: tuple[int, ...], a_axis: int, b_axis: int,
                 producer_slices: int, consumer_slices: int, overlap: bool, name: str):
        self.comm, self.full_shape, self.name, self.overlap = comm, full_shape, name, overlap
        self.a_axis, self.b_axis = a_axis, b_axis
        self.a_split, self.b_split = Split(full_shape[a_axis], comm.size), Split(full_shape[b_axis], comm.size)
        self.np, self.nc = producer_slices, consumer_slices
        self.handles: dict[tuple[int, int], Handle] = {}

    def shapes(self, p: int, c: int) -> list[tuple[int, ...]]:
        return chunk_shapes(self.full_shape, self.a_axis, self.a_split, self.np, p,
                            self.b_axis, self.b_split, self.comm.rank, self.nc, c)

    def send(self, p: int, piece: Tensor) -> None:
        """Start chunks (p, 0..nc-1), consumer slice 0 first since it is needed first."""
        for c in range(self.nc):
            buffer, numels = pack_chunk(piece, self.b_axis, self.b_split, c, self.nc)
            recv_numels = [math.prod(shape) for shape in self.shapes(p, c)]
            label = f"{self.name} {AXIS_NAMES[self.a_axis]}->{AXIS_NAMES[self.b_axis]} ({p},{c})"
            handle = self.comm.all_to_all(buffer, numels, recv_numels, label)
            if not self.overlap:
                handle.wait()  # DSP: the switch blocks the layer that produced it
            self.handles[p, c] = handle

    def receive(self, c: int) -> Tensor:
        """Consumer slice c: waits on exactly the chunks (., c), nothing else."""
        buffers = [self.handles.pop((p, c)).wait() for p in range(self.np)]
        return unpack_consumer_slice(buffers, [self.shapes(p, c) for p in range(self.np)], self.a_axis)
