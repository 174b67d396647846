"""Answering a stock attention processor's softmax attention with our own, and query tiles through it.

A diffusers attention processor computes its projections, QK-norm and RoPE with the model's own
code and then calls `F.scaled_dot_product_attention` once. `RedirectAttention`, a
`TorchFunctionMode` (torch's documented hook for intercepting torch functions in a region), answers
that call with another function on the same q, k, v; every other torch function runs as is, and
nothing in torch or diffusers is patched. `slidefusion.swap` answers it with slide attention;
`StockQueryTiles` here uses it to tile a dense self-attention by queries:

  tile_keys(y, ...)         the processor on one tile's tokens y (B, n, C), stopped at its attention
                            call: that tile's keys and values after the processor's own norms and
                            RoPE, (B, n, heads, D) each (its queries are computed and dropped).
  tile_attend(y, K, V, ...) the processor on the tile again, its attention answered with the tile's
                            queries against K, V of the whole clip -> the processor's output (B, n, C)
                            for those queries (the tile's own keys and values are computed and unused).

The extra arguments are those the block passes the attention module (Wan: the RoPE tables, sliced
to the tile by the engine). The processor runs on the native backend (a copy of it, so a flash or
sage backend chosen on the model cannot bypass the redirect).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from slidefusion.attention.tiling import TileRule
from slidefusion.errors import check


class RedirectAttention(TorchFunctionMode):
    """Answers `F.scaled_dot_product_attention` with `attend` (same arguments); counts the calls."""

    def __init__(self, attend: Callable):
        super().__init__()
        self.attend, self.calls = attend, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.calls += 1
            return self.attend(*args, **kwargs)
        if func is Tensor.unflatten:
            # Same op; Dynamo cannot trace Tensor.unflatten's super() call from inside a mode.
            return torch.unflatten(*args, **kwargs)
        return func(*args, **kwargs)


def native_copy(processor):
    """A shallow copy of a stock processor that calls torch's own SDPA (diffusers' native backend)."""
    inner = copy.copy(processor)
    if hasattr(processor, "_attention_backend"):
        inner._attention_backend = "native"
    return inner


class _Stop(Exception):
    """Raised from the redirect once the keys are known: the rest of the processor is not needed."""


def _plain(path: str, attn_mask, dropout_p, is_causal, enable_gqa) -> None:
    check(attn_mask is None and dropout_p == 0.0 and not is_causal and not enable_gqa,
          f"{path}: query tiles need plain self-attention (no mask, dropout, causal mask or GQA)")


class StockQueryTiles:
    """The tiling protocol (`tile_rule`, `tile_keys`, `tile_attend`) for a diffusers self-attention
    module whose stock processor attends once over video tokens only: dense, so a tile's queries
    need the keys and values of the whole clip (`TileRule(halo=None)`). See the module docstring."""

    def __init__(self, attn: nn.Module, path: str):
        self.attn, self.path, self.stock = attn, path, attn.processor
        self.processor = native_copy(attn.processor)

    def tile_rule(self, grid: tuple[int, int, int]) -> TileRule:
        return TileRule(axis=1, halo=None)

    def _run(self, y: Tensor, args: tuple, kwargs: dict, attend: Callable) -> Tensor:
        check(self.attn.processor is self.stock, f"{self.path}: its attention processor changed after tiling was set "
                                                 "up; set processors before building the engine (or tile_blocks)")
        redirect = RedirectAttention(attend)
        with redirect:
            out = self.processor(self.attn, y, *args, **kwargs)
        check(redirect.calls == 1, f"{self.path}: {type(self.attn.processor).__name__} called softmax attention "
                                   f"{redirect.calls} times; query tiles need exactly one call")
        return out

    def tile_keys(self, y: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Tokens y (B, n, C) -> their keys and values (B, n, heads, D), as the processor makes them."""
        seen = []

        def capture(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            _plain(self.path, attn_mask, dropout_p, is_causal, enable_gqa)
            seen.append((key.transpose(1, 2), value.transpose(1, 2)))  # (B, heads, n, D) -> (B, n, heads, D)
            raise _Stop

        try:
            self._run(y, args, kwargs, capture)
        except _Stop:
            return seen[0]
        raise RuntimeError(f"{self.path}: {type(self.attn.processor).__name__} never called softmax attention")

    def tile_attend(self, y: Tensor, keys: Tensor, values: Tensor, *args, **kwargs) -> Tensor:
        """Query tokens y (B, n, C) against keys and values (B, N, heads, D) of the whole clip ->
        (B, n, C): the processor's output for these queries."""
        def against_all(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
            _plain(self.path, attn_mask, dropout_p, is_causal, enable_gqa)
            check(key.shape[-1] == keys.shape[-1] and key.shape[1] == keys.shape[2],
                  f"{self.path}: the tile's keys {tuple(key.shape)} do not match the clip's {tuple(keys.shape)}")
            k, v = keys.transpose(1, 2).to(query.dtype), values.transpose(1, 2).to(query.dtype)
            return F.scaled_dot_product_attention(query, k, v, scale=scale)

        return self._run(y, args, kwargs, against_all)
