"""`SlideProcessor`: a diffusers attention processor that runs the model's own stock processor and
replaces only its softmax attention by slide attention.

The stock processor keeps computing everything it computes today - projections, QK-norm, RoPE,
the text/video concatenation of a joint block, output projections - with the model's own code. While
it runs, a `TorchFunctionMode` (torch's documented hook for intercepting torch functions in a region)
catches its call(s) to `F.scaled_dot_product_attention` and answers them with `slide_attention`
(video only) or `joint_attention` (video queries: window + every text token; text queries: dense) on
the same q, k, v. Nothing in torch or diffusers is patched; outside the call nothing changes.

The token grid of the current forward comes from a `GridState` a forward pre-hook on the
transformer fills (see `swap.py`); the offset network is the attention module's `slide_offsets`
submodule, so it trains, is saved and streams with its block.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from slidefusion.attention import effective_kernel, joint_attention, slide_attention
from slidefusion.attention.redirect import RedirectAttention, native_copy
from slidefusion.core.errors import UserError, check
from slidefusion.swap.records import Triple, view_grid

OFFSETS_ATTR = "slide_offsets"  # the offset network's name under the attention module


def is_offset_weight(name: str) -> bool:
    """A state-dict name of an offset network `use_slide_attention` added to a diffusers model."""
    return f".{OFFSETS_ATTR}." in name


class GridState:
    """The (T, H, W) token grid of the transformer call in progress (set by a forward pre-hook)."""

    def __init__(self):
        self.grid: Triple | None = None


@dataclass(frozen=True)
class SitePlan:
    """One swapped attention: its path in the model, block kind ("full" | "spatial" | "temporal"),
    window `kernel` for that kind, where text tokens sit ("first" | "last" | None) and the backend."""

    path: str
    kind: str
    kernel: Triple
    text: str | None
    backend: str


class SlideProcessor:
    """Base of the per-stock-class processors `slide_processor_class` makes (they differ only in the
    call signature diffusers inspects to filter keyword arguments)."""

    def __init__(self, stock, plan: SitePlan, state: GridState):
        self.stock, self.plan, self.state = stock, plan, state
        # Our own copy of the stock processor on the native backend: the only one that reaches
        # F.scaled_dot_product_attention (flash / sage backends would bypass the redirect).
        self.inner = native_copy(stock)
        if getattr(stock, "_parallel_config", None) is not None:
            raise UserError(f"{plan.path}: slide attention cannot run under diffusers' context parallelism")

    def run(self, attn, args: tuple, kwargs: dict):
        grid = self.state.grid
        check(grid is not None, f"{self.plan.path}: slide attention needs the token grid, which the transformer's "
                                "forward provides; call the transformer, not the attention module alone")
        redirect = RedirectAttention(functools.partial(self.attend, attn, view_grid(self.plan.kind, grid)))
        with redirect:
            out = self.inner(attn, *args, **kwargs)
        if redirect.calls == 0:
            raise RuntimeError(f"{self.plan.path}: {type(self.stock).__name__} never called softmax attention")
        return out

    def attend(self, attn, view: Triple, query: Tensor, key: Tensor, value: Tensor, attn_mask=None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False):
        """The stock processor's SDPA call: q, k, v (b, heads, S, D) -> (b, heads, S, D), S = the view's
        video tokens plus any text tokens (on the plan's `text` side)."""
        b, heads, S, D = query.shape
        n = math.prod(view)
        check(dropout_p == 0.0 and not is_causal and not enable_gqa and key.shape == query.shape,
              f"{self.plan.path}: slide attention replaces plain self-attention only "
              "(no dropout, causal mask or GQA)")
        check(S == n or (self.plan.text is not None and S > n),
              f"{self.plan.path}: the attention sees {S} tokens but the token grid {view} holds {n}")
        text = slice(0, S - n) if self.plan.text == "first" else slice(n, S)
        video = slice(S - n, S) if self.plan.text == "first" else slice(0, n)
        q, k, v = (x[:, :, video].transpose(1, 2).reshape(b, *view, heads, D) for x in (query, key, value))
        kernel = effective_kernel(self.plan.kernel, view)
        net = getattr(attn, OFFSETS_ATTR, None)
        offsets = None if net is None else net(q, kernel)
        if S == n:
            out = slide_attention(q, k, v, self.plan.kernel, offsets, scale, backend=self.plan.backend)
            return out.reshape(b, n, heads, D).transpose(1, 2)
        tq, tk, tv = (x[:, :, text].transpose(1, 2) for x in (query, key, value))  # (b, L, heads, D)
        text_mask = _text_mask(attn_mask, b, S, text, self.plan.path)
        out, text_out = joint_attention(q, k, v, tq, tk, tv, self.plan.kernel, offsets, scale,
                                        text_mask=text_mask, backend=self.plan.backend)
        parts = (text_out, out.reshape(b, n, heads, D))
        return torch.cat(parts if self.plan.text == "first" else parts[::-1], dim=1).transpose(1, 2)


def _text_mask(mask, b: int, S: int, text: slice, path: str):
    """A key-padding mask (b, S) or (b, 1, 1, S), bool, True = attend -> its text part (b, L)."""
    if mask is None:
        return None
    ok = isinstance(mask, Tensor) and mask.dtype == torch.bool and mask.shape[-1] == S
    ok = ok and (mask.dim() == 2 or (mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == 1))
    check(ok, f"{path}: slide attention takes a boolean key-padding mask only, got {getattr(mask, 'shape', mask)}")
    return mask.reshape(mask.shape[0], S).expand(b, S)[:, text]


@functools.cache
def slide_processor_class(stock_cls: type) -> type:
    """A `SlideProcessor` subclass whose `__call__` has `stock_cls.__call__`'s signature: diffusers'
    `Attention.forward` drops keyword arguments (RoPE tables, ...) the processor does not declare."""

    def __call__(self, attn, *args, **kwargs):
        return self.run(attn, args, kwargs)

    __call__.__signature__ = inspect.signature(stock_cls.__call__)
    return type(f"Slide{stock_cls.__name__}", (SlideProcessor,), {"__call__": __call__, "__module__": __name__})
