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

Blocks on packed tokens (diffusers Wan and LTX-Video, `token_tiles`) take (B, T*H*W, C) in
frame-major order: a tile of frames is a contiguous token range, and every input the family's
record names as per token (the tokens, RoPE tables, per-token modulation) is cut to it along its
own dimension; the rest is used whole. Their self-attention is dense (the global case above).

The block is stopped at its attention by standing in for the attention module's own forward
(`core.hooks.stand_in`: a hook of the one registry that answers without calling on); the block's
code never changes.

Backward recomputes tile by tile, each with its own small graph: weight gradients and the
conditioning's gradients are summed over tiles (in float32 when they are lower precision), the
gradients of the inputs tiles cut (the grid, per-token modulation) are summed by slab (halo
frames receive from their neighbours' tiles; the gradient of a discarded halo output is zero,
so duplicated work adds nothing), and in the global
case the key/value gradients of all query tiles are summed before one more pass pushes them
through the key/value projections. Offsets (slide) get their gradients through the local path.
The result equals untiled execution within float32 rounding.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from slidefusion.attention.tiling import TileRule
from slidefusion.core.hooks import stand_in


class _Reached(Exception):
    """Raised by the stand-in to stop a block at its self-attention."""


@dataclass
class Site:
    """One block call being tiled.

    inner: the block's own forward; attn: its self-attention module (stood in for); ops: what
    answers `tile_keys` / `tile_attend` (the module itself, or `attention.redirect.StockQueryTiles`);
    rule: the attention's TileRule; flat, spec: the call's inputs (`tree_flatten((args, kwargs))`),
    the first the tokens (or grid) the block returns, cut on the same dimension; dims: per flat
    input, the dimension tiles cut (None: used whole); unit: elements along those dimensions per
    slice of the rule's axis (1 on a grid (B, T, H, W, C); H*W tokens per frame in a sequence
    (B, T*H*W, C)); length: slices on the axis."""

    inner: Callable
    attn: nn.Module
    ops: object
    rule: TileRule
    flat: list
    spec: object
    dims: list
    unit: int = 1
    length: int = 0

    def part(self, t: torch.Tensor, dim: int, start: int, stop: int) -> torch.Tensor:
        """Slices [start, stop) of the axis of `t` (cut on `dim`)."""
        return t.narrow(dim, start * self.unit, (stop - start) * self.unit)

    def inputs(self, start: int, stop: int, leaves: bool = False, flat=None) -> list:
        """The flat inputs (or `flat`, already cut) restricted to slices [start, stop) of the axis,
        as fresh leaves where they require grad (`leaves`: each tile's graph ends there)."""
        out = []
        for t, dim in zip(self.flat if flat is None else flat, self.dims):
            if dim is not None:
                if leaves and t.requires_grad:
                    t = self.part(t.detach(), dim, start, stop).requires_grad_()
                else:
                    t = self.part(t, dim, start, stop)
            out.append(t)
        return out

    def run(self, flat: list):
        args, kwargs = tree_unflatten(flat, self.spec)
        return self.inner(*args, **kwargs)

    def attention_input(self, flat: list) -> tuple:
        """(y, args, kwargs): what the attention receives when the block runs on `flat`; the
        block stops there."""
        seen = []

        def reached(*args, **kwargs):
            seen.append(queries(args, kwargs))
            raise _Reached

        with stand_in(self.attn, "tiling.reach", reached):
            try:
                self.run(flat)
            except _Reached:
                return seen[0]
        raise RuntimeError(f"{type(self.attn).__name__} was never called by its block")

    def replay(self, flat: list, attend: Callable):
        """The block on `flat`, with `attend(y, *args, **kwargs)` giving its attention's output."""
        def answer(*args, **kwargs):
            y, args, kwargs = queries(args, kwargs)
            return attend(y, *args, **kwargs)

        with stand_in(self.attn, "tiling.answer", answer):
            return self.run(flat)

    def place(self, out, piece: torch.Tensor, start: int, dim: int = 1) -> torch.Tensor:
        """Write a tile's `piece` (cut on `dim`) into `out` at slice `start` (allocated at the first)."""
        return _place(out, piece, self.length * self.unit, dim, start * self.unit)


def queries(args: tuple, kwargs: dict) -> tuple:
    """(y, args, kwargs) of a call to a self-attention: y, its input tokens, is the first positional
    argument or diffusers' `hidden_states=` keyword (LTX's blocks pass it so)."""
    if args:
        return args[0], args[1:], kwargs
    kwargs = dict(kwargs)
    return kwargs.pop("hidden_states"), (), kwargs


def tiles_for(rule: TileRule, grid: tuple[int, int, int], frames: int) -> list[tuple[int, int]]:
    """Ranges along the rule's axis of a token grid (T, H, W), `frames` frames' worth of tokens
    each (rows: frames * H // T of them, at least 1); the last may be shorter."""
    length = grid[rule.axis - 1]
    size = frames if rule.axis == 1 else max(1, frames * grid[1] // grid[0])
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


def local_piece(site: Site, sub: list, offset: int, size: int, span: int) -> torch.Tensor:
    """The block's output at slices [offset, offset + size) of the context (`span` slices) its
    inputs `sub` cover."""
    dim = site.dims[0]
    if span == size:
        return site.run(sub)
    y, args, kwargs = site.attention_input(sub)
    kept = site.part(site.attn(y, *args, **kwargs), dim, offset, offset + size)
    return site.replay(site.inputs(offset, offset + size, flat=sub), _fixed(kept))


def keys_of(site: Site, tiles) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the whole clip, computed tile by tile; the tile axis is their dimension 1
    ((B, T, H, W, heads, D) on a grid, (B, N, heads, D) in a sequence)."""
    keys = values = None
    for a, b in tiles:
        y, args, kwargs = site.attention_input(site.inputs(a, b))
        k, v = site.ops.tile_keys(y, *args, **kwargs)
        keys, values = site.place(keys, k, a), site.place(values, v, a)
    return keys, values


def _global_attend(site: Site, keys: torch.Tensor, values: torch.Tensor) -> Callable:
    return lambda y, *args, **kwargs: site.ops.tile_attend(y, keys, values, *args, **kwargs)


def forward_tiles(site: Site, tiles) -> torch.Tensor:
    """The block's output over the whole clip, tile by tile (no graph is kept)."""
    out, dim = None, site.dims[0]
    if site.rule.halo is None:
        attend = _global_attend(site, *keys_of(site, tiles))
    for a, b in tiles:
        if site.rule.halo is None:
            piece = site.replay(site.inputs(a, b), attend)
        else:
            first, last = site.rule.context(a, b, site.length)
            piece = local_piece(site, site.inputs(first, last), a - first, b - a, last - first)
        out = site.place(out, piece, a, dim)
    return out


class Sums:
    """Per-tile gradients summed: those of the inputs tiles cut by slab, of the other inputs and
    the weights whole (in float32 where they are lower precision, cast back in `result`)."""

    def __init__(self, site: Site, weights: list[torch.Tensor]):
        self.site, self.weights = site, weights
        wanted = [i for i, t in enumerate(site.flat) if torch.is_tensor(t) and t.requires_grad]
        self.cut = {i: torch.zeros_like(site.flat[i]) for i in wanted if site.dims[i] is not None}
        self.whole = [i for i in wanted if site.dims[i] is None]
        self.sums: list[torch.Tensor | None] = [None] * (len(self.whole) + len(weights))

    def add(self, outputs, grad_outputs, inputs: list, start: int, extra=()) -> list:
        """Gradients of one tile's `outputs` (its inputs `inputs`, cut from slice `start`) into
        the sums; returns the gradients of `extra`."""
        outputs, grad_outputs = tree_flatten(outputs)[0], tree_flatten(grad_outputs)[0]
        wanted = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
        targets = [inputs[i] for i in self.cut] + [inputs[i] for i in self.whole] + self.weights + list(extra)
        if not wanted or not targets:
            return [None] * len(extra)
        grads = list(torch.autograd.grad([o for o, _ in wanted], targets, [g for _, g in wanted], allow_unused=True))
        for (i, total), grad in zip(self.cut.items(), grads):
            if grad is not None:
                dim = self.site.dims[i]
                total.narrow(dim, start * self.site.unit, grad.shape[dim]).add_(grad)
        grads = grads[len(self.cut):]
        for i, grad in enumerate(grads[:len(self.sums)]):
            if grad is None:
                continue
            if self.sums[i] is None:  # a copy: autograd may hand one tensor to two targets (an add of
                # equal shapes, e.g. Wan's modulation table + temb at batch 1), which add_ would count twice
                self.sums[i] = grad.to(torch.promote_types(grad.dtype, torch.float32), copy=True)
            else:
                self.sums[i].add_(grad)
        return grads[len(self.sums):]

    def result(self) -> tuple[list, list]:
        """(per flat input: its gradient, None where it needs none; the weights' gradients), each
        in its tensor's dtype."""
        flat, weights = self.site.flat, self.weights
        cast = [None if s is None else s.to(t.dtype) for s, t in zip(self.sums, [flat[i] for i in self.whole] + weights)]
        inputs = [None] * len(flat)
        for i, total in self.cut.items():
            inputs[i] = total
        for i, grad in zip(self.whole, cast):
            inputs[i] = grad
        return inputs, cast[len(self.whole):]


def grad_tiles(site: Site, tiles, grad_out: torch.Tensor, sums: Sums) -> None:
    """Recompute the block tile by tile with a graph and add each tile's gradients to `sums`."""
    if site.rule.halo is None:
        return _grad_global(site, tiles, grad_out, sums)
    dim = site.dims[0]
    for a, b in tiles:
        first, last = site.rule.context(a, b, site.length)
        sub = site.inputs(first, last, leaves=True)
        with torch.enable_grad():
            piece = local_piece(site, sub, a - first, b - a, last - first)
        sums.add(piece, site.part(grad_out, dim, a, b), sub, first)


def _grad_global(site: Site, tiles, grad_out: torch.Tensor, sums: Sums) -> None:
    """Query tiles against leaf keys and values (their gradients summed over tiles, in float32),
    then the summed key/value gradients back through each tile's projections."""
    with torch.no_grad():
        keys, values = (t.requires_grad_() for t in keys_of(site, tiles))
    d_keys, d_values = (torch.zeros(t.shape, dtype=torch.promote_types(t.dtype, torch.float32), device=t.device) for t in (keys, values))
    attend, dim = _global_attend(site, keys, values), site.dims[0]
    for a, b in tiles:
        sub = site.inputs(a, b, leaves=True)
        with torch.enable_grad():
            piece = site.replay(sub, attend)
        for total, grad in zip((d_keys, d_values), sums.add(piece, site.part(grad_out, dim, a, b), sub, a, (keys, values))):
            if grad is not None:
                total.add_(grad)
    for a, b in tiles:
        sub = site.inputs(a, b, leaves=True)
        with torch.enable_grad():
            y, args, kwargs = site.attention_input(sub)
            k, v = site.ops.tile_keys(y, *args, **kwargs)
        sums.add((k, v), (site.part(d_keys, 1, a, b).to(k.dtype), site.part(d_values, 1, a, b).to(v.dtype)), sub, a)
