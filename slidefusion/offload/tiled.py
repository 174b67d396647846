"""Tiled block execution: one transformer block run tile by tile, forward and checkpointed backward.

The activation wall is one block's working set over every token of a long clip. Outside its
self-attention a DiT block works per token (norms, modulation, cross-attention, MLP) or per sample
(adaLN from the conditioning vector), so it can run on a slab of the token grid (B, T, H, W, C) if
its attention can produce the outputs of the slab's queries. Each attention module declares how
(`tile_rule`, see `slidefusion.attention.tiling`), and the block is cut into tiles of `frames`
frames along the rule's axis (rows for STDiT's attention through time, same tokens per tile):

  local (halo h)   for the tile [a, b), the block runs up to its attention on the context
                   [a - h, b + h) (clamped, aligned), the attention runs on that cropped grid and
                   keeps the tile's queries; the block then finishes on [a, b) alone. Halo frames
                   cost norms, adaLN and the attention's own work; the MLP and cross-attention
                   run on the tile only. halo 0 (frames of STDiT's spatial blocks, rows of its
                   temporal ones) is the block itself on the slab.
  global (dense)   no crop is exact: keys and values of every tile are computed first
                   (`tile_keys`, per token), then each tile's queries attend to all of them
                   (`tile_attend`) while the rest of the block runs on the tile.

The block is stopped at its attention by standing in for the attention module's `forward` on the
instance (a forward hook cannot skip the call); the block's code never changes.

Backward recomputes tile by tile, each with its own small graph: weight gradients and the
conditioning's gradients are summed over tiles (in float32 when they are lower precision), the
grid's input gradient is summed by slab (halo frames receive from their neighbours' tiles; the
gradient of a discarded halo output is zero, so duplicated work adds nothing), and in the global
case the key/value gradients of all query tiles are summed before one more pass pushes them
through the key/value projections. Offsets (slide) get their gradients through the local path.
The result equals untiled execution within float32 rounding.
"""

from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from slidefusion.attention.tiling import TileRule


class _Reached(Exception):
    """Raised by the stand-in to stop a block at its self-attention."""


@contextmanager
def stand_in(module: nn.Module, forward: Callable):
    """`module.forward = forward` on the instance for the duration (restoring what was there)."""
    previous = module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous


@dataclass
class Site:
    """One block call being tiled: the block's own forward, its attention module and rule, and
    the arguments after the token grid."""

    inner: Callable
    attn: nn.Module
    rule: TileRule
    rest: tuple
    kwargs: dict

    def run(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x, *self.rest, **self.kwargs)

    def attention_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the attention receives when the block runs on the slab x; the block stops there."""
        seen = []

        def reached(y, *args, **kwargs):
            seen.append(y)
            raise _Reached

        with stand_in(self.attn, reached):
            try:
                self.run(x)
            except _Reached:
                return seen[0]
        raise RuntimeError(f"{type(self.attn).__name__} was never called by its block")

    def replay(self, x: torch.Tensor, attend: Callable) -> torch.Tensor:
        """The block on the slab x, with `attend(y)` giving its attention's output."""
        with stand_in(self.attn, attend):
            return self.run(x)


def tiles_for(rule: TileRule, shape, frames: int) -> list[tuple[int, int]]:
    """Ranges along the rule's axis of a grid of `shape` (B, T, H, W, C), `frames` frames' worth
    of tokens each (rows: frames * H // T of them, at least 1); the last may be shorter."""
    length = shape[rule.axis]
    size = frames if rule.axis == 1 else max(1, frames * shape[2] // shape[1])
    size = max(1, min(size, length))
    return [(a, min(a + size, length)) for a in range(0, length, size)]


def _place(out, piece: torch.Tensor, length: int, axis: int, start: int) -> torch.Tensor:
    """Write a tile's `piece` into `out` (allocated at the first tile, `length` long on `axis`)."""
    if out is None:
        shape = list(piece.shape)
        shape[axis] = length
        out = piece.new_empty(shape)
    out.narrow(axis, start, piece.shape[axis]).copy_(piece)
    return out


def _fixed(value: torch.Tensor) -> Callable:
    def attend(y, *args, **kwargs):
        assert y.shape[:-1] == value.shape[:-1], (tuple(y.shape), tuple(value.shape))
        return value
    return attend


def local_piece(site: Site, sub: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    """The block's output at slices [offset, offset + size) of its context slab `sub`."""
    axis = site.rule.axis
    if sub.shape[axis] == size:
        return site.run(sub)
    kept = site.attn(site.attention_input(sub)).narrow(axis, offset, size)
    return site.replay(sub.narrow(axis, offset, size), _fixed(kept))


def keys_of(site: Site, x: torch.Tensor, tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (B, T, H, W, heads, D) of the whole grid, computed tile by tile."""
    keys = values = None
    for a, b in tiles:
        k, v = site.attn.tile_keys(site.attention_input(x.narrow(1, a, b - a)))
        keys, values = _place(keys, k, x.shape[1], 1, a), _place(values, v, x.shape[1], 1, a)
    return keys, values


def _global_attend(site: Site, keys: torch.Tensor, values: torch.Tensor) -> Callable:
    return lambda y, *args, **kwargs: site.attn.tile_attend(y, keys, values)


def forward_tiles(site: Site, x: torch.Tensor, tiles) -> torch.Tensor:
    """The block's output over the whole grid, tile by tile (no graph is kept)."""
    axis, out = site.rule.axis, None
    if site.rule.halo is None:
        attend = _global_attend(site, *keys_of(site, x, tiles))
    for a, b in tiles:
        if site.rule.halo is None:
            piece = site.replay(x.narrow(1, a, b - a), attend)
        else:
            first, last = site.rule.context(a, b, x.shape[axis])
            piece = local_piece(site, x.narrow(axis, first, last - first), a - first, b - a)
        out = _place(out, piece, x.shape[axis], axis, a)
    return out


class Sums:
    """Per-tile gradients summed: the grid's by slab, the other inputs' and the weights' whole
    (in float32 where they are lower precision, cast back in `result`)."""

    def __init__(self, x: torch.Tensor, others: list[torch.Tensor], weights: list[torch.Tensor]):
        self.others, self.weights = others, weights  # leaves that require grad
        self.x = torch.zeros_like(x) if x.requires_grad else None
        self.sums: list[torch.Tensor | None] = [None] * (len(others) + len(weights))

    def add(self, outputs, grad_outputs, slab: torch.Tensor, axis: int, start: int, extra=()) -> list:
        """Gradients of `outputs` (one tile's) into the sums; returns the gradients of `extra`."""
        outputs, grad_outputs = tree_flatten(outputs)[0], tree_flatten(grad_outputs)[0]
        wanted = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
        targets = ([slab] if self.x is not None else []) + self.others + self.weights + list(extra)
        if not wanted or not targets:
            return [None] * len(extra)
        grads = list(torch.autograd.grad([o for o, _ in wanted], targets, [g for _, g in wanted], allow_unused=True))
        if self.x is not None:
            slab_grad = grads.pop(0)
            if slab_grad is not None:
                self.x.narrow(axis, start, slab.shape[axis]).add_(slab_grad)
        for i, grad in enumerate(grads[:len(self.sums)]):
            if grad is not None:
                grad = grad.to(torch.promote_types(grad.dtype, torch.float32))
                self.sums[i] = grad if self.sums[i] is None else self.sums[i].add_(grad)
        return grads[len(self.sums):]

    def result(self) -> tuple[torch.Tensor | None, list, list]:
        """(the grid's gradient, the other inputs', the weights'), each in its tensor's dtype."""
        cast = [None if s is None else s.to(t.dtype) for s, t in zip(self.sums, self.others + self.weights)]
        return self.x, cast[:len(self.others)], cast[len(self.others):]


def _slab(x: torch.Tensor, axis: int, start: int, stop: int) -> torch.Tensor:
    """A fresh leaf holding x's slices [start, stop): each tile's graph ends here."""
    return x.detach().narrow(axis, start, stop - start).requires_grad_(x.requires_grad)


def grad_tiles(site: Site, x: torch.Tensor, tiles, grad_out: torch.Tensor, sums: Sums) -> None:
    """Recompute the block tile by tile with a graph and add each tile's gradients to `sums`."""
    axis = site.rule.axis
    if site.rule.halo is None:
        return _grad_global(site, x, tiles, grad_out, sums)
    for a, b in tiles:
        first, last = site.rule.context(a, b, x.shape[axis])
        sub = _slab(x, axis, first, last)
        with torch.enable_grad():
            piece = local_piece(site, sub, a - first, b - a)
        sums.add(piece, grad_out.narrow(axis, a, b - a), sub, axis, first)


def _grad_global(site: Site, x: torch.Tensor, tiles, grad_out: torch.Tensor, sums: Sums) -> None:
    """Query tiles against leaf keys and values (their gradients summed over tiles, in float32),
    then the summed key/value gradients back through each tile's projections."""
    with torch.no_grad():
        keys, values = (t.requires_grad_() for t in keys_of(site, x.detach(), tiles))
    d_keys, d_values = (torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device) for t in (keys, values))
    attend = _global_attend(site, keys, values)
    for a, b in tiles:
        slab = _slab(x, 1, a, b)
        with torch.enable_grad():
            piece = site.replay(slab, attend)
        for total, grad in zip((d_keys, d_values), sums.add(piece, grad_out.narrow(1, a, b - a), slab, 1, a, (keys, values))):
            if grad is not None:
                total.add_(grad)
    for a, b in tiles:
        slab = _slab(x, 1, a, b)
        with torch.enable_grad():
            k, v = site.attn.tile_keys(site.attention_input(slab))
        sums.add((k, v), (d_keys.narrow(1, a, b - a).to(k.dtype), d_values.narrow(1, a, b - a).to(v.dtype)), slab, 1, a)
