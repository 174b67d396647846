"""Head-parallel (Ulysses) attention for tokens sharded by positions.

The block is unchanged; only a view of it gets its self-attention wrapped: the qkv projection runs
on the local positions, one all-to-all trades positions for heads (every rank then sees all
positions of its heads), the unchanged operator attends, and a second all-to-all trades back.
Heads that P does not divide are split unevenly; a rank may get none and then attends to nothing.
"""

import copy

import torch
from torch import Tensor, nn

from slidefusion.attention import GridAttention
from slidefusion.errors import UserError
from slidefusion.parallel.comm import Comm
from slidefusion.parallel.layout import Split


class GridShape:
    """The (H, W) token grid of the current forward, shared by the wrappers (set per call)."""

    hw: tuple[int, int] = (0, 0)


def _trade(comm: Comm, x: Tensor, scatter_dim: int, scatter: Split, gather_dim: int, gather: Split, name: str) -> Tensor:
    """Blocking uneven all-to-all: x's `scatter_dim` is cut by `scatter` (piece j to rank j) and the
    received pieces are concatenated along `gather_dim` in source order (source i holds gather's piece i)."""
    pieces = [x.narrow(scatter_dim, *scatter.range(j)).contiguous() for j in range(comm.size)]
    out_shapes = []
    for i in range(comm.size):
        shape = list(pieces[comm.rank].shape)
        shape[gather_dim] = gather.sizes[i]
        out_shapes.append(shape)
    numels = [int(torch.Size(s).numel()) for s in out_shapes]
    flat = torch.cat([p.reshape(-1) for p in pieces])
    received = comm.all_to_all(flat, [p.numel() for p in pieces], numels, name).wait()
    blocks = [b.view(s) for b, s in zip(received.split(numels), out_shapes)]
    return torch.cat(blocks, dim=gather_dim)


class UlyssesAttention(nn.Module):
    """Wraps a `GridAttention` that attends across positions; input (B, T, S_r, 1, C) by positions."""

    def __init__(self, inner: GridAttention, grid: str, comm: Comm, shape: GridShape, name: str):
        super().__init__()
        if not isinstance(inner, GridAttention):
            raise UserError(f"ulysses needs a GridAttention (qkv, attend, proj) at the plan's attention path; "
                            f"got {type(inner).__name__}")
        self.inner, self.grid, self.comm, self.shape, self.name = inner, grid, comm, shape, name

    def forward(self, x: Tensor) -> Tensor:
        b, t, s_local, _, c = x.shape
        heads, hd = self.inner.heads, c // self.inner.heads
        h, w = self.shape.hw
        positions, head_split = Split(h * w, self.comm.size), Split(heads, self.comm.size)
        qkv = self.inner.qkv(x).view(b, t, s_local, 3, heads, hd)  # (B, T, S_r, 3, heads, D)
        qkv = _trade(self.comm, qkv, 4, head_split, 2, positions, f"{self.name} qkv heads")  # (B, T, S, 3, h_r, D)
        mine = qkv.shape[4]
        if mine and t:
            grid = (b * t, 1, h, w) if self.grid == "frame" else (b, t, h, w)
            q, k, v = qkv.reshape(*grid, 3, mine, hd).unbind(dim=4)  # each (*grid, h_r, D)
            out = self.inner.attend(q, k, v).reshape(b, t, h * w, mine, hd)  # (B, T, S, h_r, D)
        else:  # no heads (heads < P) or no frames here: nothing to attend, still take part in the trade
            out = qkv.new_zeros(b, t, h * w, mine, hd)
        out = _trade(self.comm, out, 2, positions, 3, head_split, f"{self.name} out heads")  # (B, T, S_r, heads, D)
        return self.inner.proj(out.reshape(b, t, s_local, 1, c))


def ulysses_view(block: nn.Module, attention_path: str, grid: str, comm: Comm, shape: GridShape, name: str) -> nn.Module:
    """A shallow view of `block` (same parameters, same forward) whose self-attention is wrapped.

    The model itself is not modified: the view has its own submodule table."""
    inner = block.get_submodule(attention_path)
    view = copy.copy(block)
    view._modules = dict(block._modules)
    setattr(view, attention_path.split(".")[0], UlyssesAttention(inner, grid, comm, shape, name))
    return view
