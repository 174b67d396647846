"""`use_slide_attention`: swap a model's video self-attention for slide attention, reversibly.

    handle = use_slide_attention(transformer, kernel_size=(3, 7, 7), offsets="sample")
    ...                       # train / sample as usual; the offset networks are model parameters
    handle.remove()           # or restore_attention(transformer): the stock model again, bitwise

diffusers models keep their modules: each swapped attention gets a `SlideProcessor` (`set_processor`,
the stock one kept for `remove`) and, with offsets, an `OffsetNet` submodule `slide_offsets`; a hook
on the transformer (`GRID_HOOK` in the one registry, `slidefusion.core.hooks`) reads the token grid
from the latents (`adapter.grid_from_call`).
Our own DiT3D / STDiT compute on grids already: their grid operator is replaced by a
`SlideAttention3d` / `NeighborhoodAttention3d` that shares the old operator's q/k/v and output
projections (the state dict then reads exactly like a model built with `model.attention=slide`).

The swap changes what the model is made of (processors, modules, parameters), so it is the innermost
layer: it goes on before offload streaming, tiling or a parallel plan is attached (they read the
model's modules and parameters when attached) and comes off after they are gone; the other order is
refused with one line.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from slidefusion.attention import GridAttention, NeighborhoodAttention3d, OffsetNet, SlideAttention3d
from slidefusion.core import hooks
from slidefusion.core.errors import check
from slidefusion.families import AttentionSite, ModelAdapter, SwapRecord, adapter_for, adapters_with, config_value
from slidefusion.swap import persist
from slidefusion.swap.processor import OFFSETS_ATTR, GridState, SitePlan, slide_processor_class
from slidefusion.swap.records import SlideOptions

GRID_HOOK = "swap.grid"
# The engines that read the model's modules and parameters when they are attached.
_ENGINES = ("offload", "tiling", "parallel")
_SWAPPED: weakref.WeakKeyDictionary[nn.Module, SlideAttentionHandle] = weakref.WeakKeyDictionary()


@dataclass
class SlideAttentionHandle:
    """What `use_slide_attention` changed on `model`; `remove()` undoes it. `paths` lists the swapped
    attention modules (qualified names), `options` the settings they run with."""

    model: nn.Module
    options: SlideOptions
    paths: list[str]
    _undo: list = field(default_factory=list, repr=False)

    def remove(self) -> None:
        """Restore the stock attention: processors (the very objects that were there), the grid
        hook, and no offset modules; the model's own weights keep whatever training did to them."""
        hooks.refuse_hooks(self.model, {e: "remove them before the slide attention" for e in _ENGINES})
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        _SWAPPED.pop(self.model, None)


def use_slide_attention(transformer: nn.Module, kernel_size=(3, 7, 7), offsets: str | None = "sample", *,
                        max_offset: float = 0.9, temporal: str = "dense", backend: str = "auto",
                        grid=None, from_pretrained=None) -> SlideAttentionHandle:
    """Swap the video self-attention of `transformer` (a supported diffusers video transformer, or
    our DiT3D / STDiT) for slide attention; see `SlideOptions` for the arguments.

    `from_pretrained=DIR`: the swap a diffusers model was saved with (`save_pretrained` after a
    swap records its options in config.json and its offset networks with the weights), restored
    with those options and trained offsets (`slidefusion.swap.persist`); give no other option.

    Full blocks get a (kt, kh, kw) window, spatial ones (Latte's) a (1, kh, kw) window in each frame,
    temporal ones a (kt, 1, 1) window or stay dense (`temporal`). In joint text+video blocks
    (CogVideoX, HunyuanVideo, Mochi) video queries see their window plus every text token, and
    text queries stay dense. Offset networks start at zero, so with a window covering the grid the
    swapped model computes what the stock one does. The model's RoPE and QK-norm run where they
    ran (the stock processor computes them). Returns a handle; `handle.remove()` or
    `restore_attention(transformer)` undoes the swap. UserError for an unsupported model, a model
    swapped already, or bad options.
    """
    options = SlideOptions(kernel_size, offsets, max_offset, temporal, backend, grid)
    if from_pretrained is not None:
        check(options == SlideOptions(), "use_slide_attention(from_pretrained=DIR) takes the options DIR was saved "
                                         "with; give no other option")
        return _restore(transformer, from_pretrained)
    adapter = adapter_for(transformer)
    hooks.refuse_hooks(transformer, {e: "swap the attention first, then attach them" for e in _ENGINES})
    check(transformer not in _SWAPPED, f"{type(transformer).__name__} already uses slide attention; "
                                       "call restore_attention(model) before swapping it again")
    record = adapter.swap
    check(record is not None, f"use_slide_attention does not cover {adapter.class_name} yet; supported: "
                              f"{', '.join(a.class_name for a in adapters_with('swap'))}")
    options = options.clamped(_grid_bound(transformer, record))
    sites = [s for s in adapter.attention_sites(transformer)
             if s.kind != "temporal" or options.temporal == "slide"]
    handle = SlideAttentionHandle(transformer, options, [s.path for s in sites])
    try:
        if record.processors:
            _swap_diffusers(transformer, adapter, record, sites, options, handle)
            persist.record_options(transformer, options, handle)  # what save_pretrained writes
        else:  # our own models: grid operators, replaced as modules
            _swap_ours(transformer, sites, options, handle)
    except BaseException:
        handle.remove()
        raise
    _SWAPPED[transformer] = handle
    return handle


def restore_attention(transformer: nn.Module) -> None:
    """Undo `use_slide_attention` on `transformer` (UserError if it was not swapped)."""
    check(transformer in _SWAPPED, f"{type(transformer).__name__} does not use swapped slide attention")
    _SWAPPED[transformer].remove()


def slide_attention_handle(transformer: nn.Module) -> SlideAttentionHandle | None:
    """The live handle of a swapped model, or None."""
    return _SWAPPED.get(transformer)


def _grid_bound(model: nn.Module, record: SwapRecord):
    """The largest token grid the family's model can take on any axis (its swap record's config
    key), as (n, n, n); None where there is no such bound."""
    if record.grid_bound is None:
        return None
    n = int(config_value(model, record.grid_bound))
    return (n, n, n)


def _restore(model: nn.Module, path) -> SlideAttentionHandle:
    """The swap the folder `path` was saved with, and its trained offset networks (`persist`)."""
    options, entries = persist.saved_swap(model, path)
    handle = use_slide_attention(model, **asdict(options))
    try:
        persist.load_offsets(model, entries, path)
    except BaseException:
        handle.remove()
        raise
    return handle


# ---------------------------------------------------------------- diffusers models
def _swap_diffusers(model, adapter: ModelAdapter, record: SwapRecord, sites: list[AttentionSite],
                    options: SlideOptions, handle: SlideAttentionHandle) -> None:
    state = GridState()
    for site in sites:
        attn = model.get_submodule(site.path)
        processor = attn.processor
        name = type(processor).__name__
        check(name in record.processors, f"use_slide_attention: {site.path} runs {name}; it swaps the stock "
                                         f"processor {' or '.join(record.processors)} only")
        plan = SitePlan(site.path, site.kind, options.site_kernel(site.kind), record.text if site.joint else None,
                        options.backend)
        _set_processor(attn, slide_processor_class(type(processor))(processor, plan, state))
        handle._undo.append(lambda attn=attn, processor=processor: _set_processor(attn, processor))
        if options.offsets is not None:
            _add_offsets(attn, plan.kernel, options, handle)

    hooks.add_hook(model, GRID_HOOK, _GridHook(adapter, state))
    handle._undo.append(lambda: hooks.remove_hook(model, GRID_HOOK))


class _GridHook:
    """The token grid of this call, for the model's slide processors. An object, not a closure, so
    that a deep copy of the model hooks its own copied processors' state."""

    def __init__(self, adapter: ModelAdapter, state: GridState):
        self.adapter, self.state = adapter, state

    def __deepcopy__(self, memo):  # the adapter is shared data (it holds read-only mappings)
        return _GridHook(self.adapter, copy.deepcopy(self.state, memo))

    def __call__(self, module, call_next, *args, **kwargs):
        self.state.grid = self.adapter.grid_from_call(module, args, kwargs)
        return call_next(*args, **kwargs)


def _set_processor(attn: nn.Module, processor) -> None:
    """Per module, as `set_attn_processor` does; Mochi's attention has no `set_processor` and its
    transformer lacks that mixin, so a plain attribute (what `set_processor` sets) stands in."""
    if hasattr(attn, "set_processor"):
        attn.set_processor(processor)
    else:
        attn.processor = processor


def _add_offsets(attn: nn.Module, kernel, options: SlideOptions, handle: SlideAttentionHandle) -> None:
    """Register a zero-initialised offset network on `attn`, on its weights' device and dtype."""
    check(not hasattr(attn, OFFSETS_ATTR), f"{type(attn).__name__} already has a {OFFSETS_ATTR} attribute")
    weight = attn.to_q.weight
    net = OffsetNet(attn.to_q.out_features, attn.heads, kernel, options.offsets, options.max_offset)
    attn.add_module(OFFSETS_ATTR, net.to(device=weight.device, dtype=weight.dtype))
    handle._undo.append(lambda: delattr(attn, OFFSETS_ATTR))


# ---------------------------------------------------------------- our DiT3D / STDiT
def _swap_ours(model, sites: list[AttentionSite], options: SlideOptions, handle: SlideAttentionHandle) -> None:
    for site in sites:
        parent_path, _, name = site.path.rpartition(".")
        parent = model.get_submodule(parent_path)
        old = getattr(parent, name)
        check(isinstance(old, GridAttention) and not isinstance(old, SlideAttention3d),
              f"{site.path} is {type(old).__name__}; use_slide_attention swaps a dense, window or neighbourhood "
              "operator (a model built with model.attention=slide has slide attention already)")
        kernel = options.site_kernel(site.kind)
        with torch.device("meta"):  # its projections are the old ones: build nothing twice
            if options.offsets is None:
                new = NeighborhoodAttention3d(old.dim, old.heads, kernel)
            else:
                new = SlideAttention3d(old.dim, old.heads, kernel, options.offsets, options.max_offset)
        new.qkv, new.proj = old.qkv, old.proj
        if options.offsets is not None:
            weight = old.qkv.weight
            new.offset_conv = _materialise(new.offset_conv, weight)
            new.offset_linear = _materialise(new.offset_linear, weight)
            nn.init.zeros_(new.offset_linear.weight)
            nn.init.zeros_(new.offset_linear.bias)
        setattr(parent, name, new)
        handle._undo.append(lambda parent=parent, name=name, old=old: setattr(parent, name, old))


def _materialise(layer: nn.Module, like: torch.Tensor) -> nn.Module:
    """A meta-device layer on `like`'s device and dtype, initialised by its own reset_parameters."""
    layer = layer.to_empty(device=like.device).to(like.dtype)
    layer.reset_parameters()
    return layer


__all__ = ["SlideAttentionHandle", "restore_attention", "slide_attention_handle", "use_slide_attention"]
