"""Uneven all-to-all of one tensor along two dimensions, behind a handle.

`start_trade` cuts `x` along `scatter_dim` into one piece per rank (piece j goes to rank j) and
returns a `Trade` at once; `Trade.wait()` blocks on exactly that transfer and concatenates what
arrived along `gather_dim`, in source-rank order (source i sends `gather_sizes[i]` rows). This is
the Ulysses exchange (tokens for heads and back); sliced Ulysses starts one per token chunk.

Both exchanges are differentiable, so sequence-parallel training backpropagates through the same
hooks that serve inference: the backward of a trade is the reverse trade (the received pieces go
back to their sources), and the backward of `gather_shards` keeps this rank's rows of the incoming
gradient. The latter holds because every rank of the group computes the same loss from the whole
gathered tensor: rank r's shard affects that one loss through its own rows only.
"""

import math

import torch
from torch import Tensor

from slidefusion.parallel.comm import Comm, Handle


class Trade:
    """An exchange in flight; `wait()` returns the received tensor (differentiable when the sent
    tensor required grad: `reverse` holds what the backward exchange needs)."""

    def __init__(self, handle: Handle, shapes: list[tuple[int, ...]], gather_dim: int, reverse=None):
        self.handle, self.shapes, self.gather_dim, self.reverse = handle, shapes, gather_dim, reverse

    def wait(self) -> Tensor:
        flat = self.handle.wait()
        numels = [math.prod(s) for s in self.shapes]
        blocks = [b.view(s) for b, s in zip(flat.split(numels), self.shapes)]
        out = torch.cat(blocks, dim=self.gather_dim)
        if self.reverse is None:
            return out
        source, spec = self.reverse
        return _Received.apply(source, _Box(out, spec))


class _Box:
    """A tensor handed to an autograd function as a constant (not an input it differentiates)."""

    def __init__(self, value, spec=None):
        self.value, self.spec = value, spec


class _Received(torch.autograd.Function):
    """The output of a trade as a function of the tensor sent; backward = the reverse trade."""

    @staticmethod
    def forward(ctx, source: Tensor, box: _Box) -> Tensor:
        ctx.spec = box.spec
        return box.value

    @staticmethod
    def backward(ctx, grad: Tensor):
        comm, scatter_dim, scatter_sizes, gather_dim, gather_sizes, name = ctx.spec
        back = start_trade(comm, grad.contiguous(), gather_dim, gather_sizes, scatter_dim, scatter_sizes,
                           f"{name} backward")
        return back.wait(), None


def start_trade(comm: Comm, x: Tensor, scatter_dim: int, scatter_sizes: list[int], gather_dim: int,
                gather_sizes: list[int], name: str) -> Trade:
    """Start the exchange: rank j gets x's `scatter_sizes[j]` rows along `scatter_dim` (in order);
    this rank receives from each source i a block whose `gather_dim` has `gather_sizes[i]` rows and
    whose `scatter_dim` has this rank's `scatter_sizes[rank]` rows."""
    shapes = []
    for i in range(comm.size):
        shape = list(x.shape)
        shape[scatter_dim] = scatter_sizes[comm.rank]
        shape[gather_dim] = gather_sizes[i]
        shapes.append(tuple(shape))
    with torch.no_grad():  # the send buffer is a copy; a differentiable trade attaches to `x` itself
        pieces = list(torch.split(x, scatter_sizes, dim=scatter_dim))
        flat = torch.cat([p.reshape(-1) for p in pieces])
    handle = comm.all_to_all(flat, [p.numel() for p in pieces], [math.prod(s) for s in shapes], name)
    differentiable = torch.is_grad_enabled() and x.requires_grad
    spec = (comm, scatter_dim, scatter_sizes, gather_dim, gather_sizes, name)
    return Trade(handle, shapes, gather_dim, (x, spec) if differentiable else None)


def gather_shards(comm: Comm, local: Tensor, axis: int, sizes: list[int], name: str = "gather tokens") -> Tensor:
    """Every rank's shard along `axis` (rank i holds `sizes[i]` rows) -> the whole tensor, on every
    rank. Shards are padded to one size, as gloo's all_gather needs equal shapes."""
    with torch.no_grad():
        pad = list(local.shape)
        pad[axis] = max(sizes) - local.shape[axis]
        padded = torch.cat([local, local.new_zeros(pad)], dim=axis)
        pieces = comm.all_gather(padded, name)
        whole = torch.cat([p.narrow(axis, 0, n) for p, n in zip(pieces, sizes)], dim=axis)
    if not (torch.is_grad_enabled() and local.requires_grad):
        return whole
    return _Gathered.apply(local, _Box(whole, (axis, sum(sizes[:comm.rank]), sizes[comm.rank])))


class _Gathered(torch.autograd.Function):
    """The gathered whole as a function of this rank's shard; backward keeps the shard's rows
    (see the module docstring for why no exchange is needed)."""

    @staticmethod
    def forward(ctx, local: Tensor, box: _Box) -> Tensor:
        ctx.spec = box.spec
        return box.value

    @staticmethod
    def backward(ctx, grad: Tensor):
        axis, start, count = ctx.spec
        return grad.narrow(axis, start, count), None
