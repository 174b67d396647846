"""Tiling blocks that take packed video tokens (diffusers' Wan): the family's `TokenTiling` record,
read by one generic class.

A Wan block is called with the video tokens (B, N, C), N = T*H*W frame-major, the text states,
the timestep modulation and the RoPE tables. A tile of frames [a, b) is the token range
[a*H*W, b*H*W): the record names the arguments that are per token (the tokens, the RoPE tables,
Wan 2.2 TI2V's per-token modulation), and those are cut to the tile; the rest (text states, a
per-sample modulation) go in whole. Everything in the block but its self-attention is per token
(norms, modulation, cross-attention to the text, MLP), and the self-attention is dense over the
clip: its keys and values are computed for every tile first (a pre-pass up to the attention's
projections), then each tile's queries attend to all of them, through the stock processor
(`attention.redirect.StockQueryTiles`), so the model's own projections, QK-norm and RoPE compute
them. The token grid of the call in progress comes from a forward pre-hook on the transformer.

Memory: one block's per-token intermediates (the MLP's hidden layer, ffn_dim wide, the attention
projections and cross-attention buffers, the attention scores or their flash log-sum-exp) scale with
the tile; the keys and values of the whole clip (2 x N x C, and their float32 gradients in backward)
and the block's input, output and their gradients stay whole. Cost: per tile, the pre-pass computes
the tile's queries too, and the attention pass its keys and values again (the stock processor makes
all three): forward about one extra set of Q/K/V projections over the clip; the checkpointed
backward two (pre-pass, and the pass that pushes the summed key/value gradients through the
projections).
"""

from __future__ import annotations

import inspect
import math

from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from slidefusion.families import ModelAdapter, adapter_for
from slidefusion.attention.redirect import StockQueryTiles
from slidefusion.core import hooks
from slidefusion.errors import check

_WHOLE = -1  # tree_map cannot return None for a leaf (None is an empty node to pytrees)


def token_tiling_refusal(model: nn.Module, adapter: ModelAdapter) -> str | None:
    """Why `model`'s packed-token blocks cannot be tiled (a swapped self-attention), or None."""
    record = adapter.token_tiling
    for site in adapter.attention_sites(model):
        name = type(getattr(model.get_submodule(site.path), "processor", None)).__name__
        if name not in record.processors:
            return (f"{site.path} runs {name}; tiling {adapter.class_name}'s blocks needs its stock "
                    f"{' or '.join(record.processors)} (dense attention over the video tokens)")
    return None


class TokenBlocks:
    """What `TiledBlock` needs of a model whose blocks take packed tokens: per block, its
    self-attention (answered through `StockQueryTiles`), which call arguments are per token, and
    the token grid of the transformer call in progress. `close()` removes the grid hook."""

    def __init__(self, model: nn.Module, hook: str = "tiling.grid"):
        self.adapter = adapter = adapter_for(model)
        check(adapter.token_tiling is not None, f"{adapter.class_name} declares no token tiling")
        sites = adapter.attention_sites(model)
        self.ops = {id(block): StockQueryTiles(model.get_submodule(site.path), site.path)
                    for block, site in zip(adapter.blocks(model), sites)}
        self.grid: tuple[int, int, int] | None = None
        self.model, self.hook = model, hook
        hooks.add_hook(model, hook, self._see_grid)

    def _see_grid(self, module, call_next, *args, **kwargs):
        self.grid = self.adapter.grid_from_call(module, args, kwargs)
        return call_next(*args, **kwargs)

    def close(self) -> None:
        hooks.remove_hook(self.model, self.hook)

    def cut(self, block: nn.Module, args: tuple, kwargs: dict, flat: list) -> tuple[StockQueryTiles, list, tuple]:
        """(the block's attention ops, per flat input the dimension tiles cut or None, the grid)."""
        check(self.grid is not None, f"tiling {self.adapter.class_name}'s blocks needs the token grid, which the "
                                     "transformer's forward provides; call the transformer, not a block alone")
        check(id(block) in self.ops, f"{type(block).__name__} is not a block of this {self.adapter.class_name}")
        tokens = math.prod(self.grid)
        per_token = self.adapter.token_tiling.per_token
        names = list(inspect.signature(type(block).forward).parameters)[1:]

        def dims_of(name: str):
            rule = per_token.get(name)

            def dim(t):
                cut = rule is not None and hasattr(t, "ndim") and rule.ndim in (None, t.ndim)
                return rule.dim if cut and (not rule.sized or t.shape[rule.dim] == tokens) else _WHOLE
            return dim

        marked = ([tree_map(dims_of(name), arg) for name, arg in zip(names, args)],
                  {key: tree_map(dims_of(key), value) for key, value in kwargs.items()})
        dims = [None if d == _WHOLE else d for d in tree_flatten(marked)[0]]
        first = next(iter(per_token))
        check(len(dims) == len(flat) and (bool(args) or first in kwargs) and dims[0] == per_token[first].dim,
              f"{type(block).__name__}: tiling needs the video tokens (B, N, C) as the block's first argument, {first}")
        for t, dim in ((t, dim) for t, dim in zip(flat, dims) if dim is not None):
            check(t.shape[dim] == tokens, f"{type(block).__name__}: a per-token input has {t.shape[dim]} tokens, "
                                          f"the grid {'x'.join(map(str, self.grid))} has {tokens}")
        return self.ops[id(block)], dims, self.grid
