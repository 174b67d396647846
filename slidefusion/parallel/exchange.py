"""Uneven all-to-all of one tensor along two dimensions, behind a handle.

`start_trade` cuts `x` along `scatter_dim` into one piece per rank (piece j goes to rank j) and
returns a `Trade` at once; `Trade.wait()` blocks on exactly that transfer and concatenates what
arrived along `gather_dim`, in source-rank order (source i sends `gather_sizes[i]` rows). This is
the Ulysses exchange (tokens for heads and back); sliced Ulysses starts one per token chunk.
"""

import math

import torch
from torch import Tensor

from slidefusion.parallel.comm import Comm, Handle


class Trade:
    """An exchange in flight; `wait()` returns the received tensor."""

    def __init__(self, handle: Handle, shapes: list[tuple[int, ...]], gather_dim: int):
        self.handle, self.shapes, self.gather_dim = handle, shapes, gather_dim

    def wait(self) -> Tensor:
        flat = self.handle.wait()
        numels = [math.prod(s) for s in self.shapes]
        blocks = [b.view(s) for b, s in zip(flat.split(numels), self.shapes)]
        return torch.cat(blocks, dim=self.gather_dim)


def start_trade(comm: Comm, x: Tensor, scatter_dim: int, scatter_sizes: list[int], gather_dim: int,
                gather_sizes: list[int], name: str) -> Trade:
    """Start the exchange: rank j gets x's `scatter_sizes[j]` rows along `scatter_dim` (in order);
    this rank receives from each source i a block whose `gather_dim` has `gather_sizes[i]` rows and
    whose `scatter_dim` has this rank's `scatter_sizes[rank]` rows."""
    pieces = list(torch.split(x, scatter_sizes, dim=scatter_dim))
    shapes = []
    for i in range(comm.size):
        shape = list(x.shape)
        shape[scatter_dim] = scatter_sizes[comm.rank]
        shape[gather_dim] = gather_sizes[i]
        shapes.append(tuple(shape))
    flat = torch.cat([p.reshape(-1) for p in pieces])
    handle = comm.all_to_all(flat, [p.numel() for p in pieces], [math.prod(s) for s in shapes], name)
    return Trade(handle, shapes, gather_dim)


def gather_shards(comm: Comm, local: Tensor, axis: int, sizes: list[int], name: str = "gather tokens") -> Tensor:
    """Every rank's shard along `axis` (rank i holds `sizes[i]` rows) -> the whole tensor, on every
    rank. Shards are padded to one size, as gloo's all_gather needs equal shapes."""
    pad = list(local.shape)
    pad[axis] = max(sizes) - local.shape[axis]
    padded = torch.cat([local, local.new_zeros(pad)], dim=axis)
    pieces = comm.all_gather(padded, name)
    return torch.cat([p.narrow(axis, 0, n) for p, n in zip(pieces, sizes)], dim=axis)
