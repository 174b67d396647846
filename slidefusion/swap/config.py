"""The seams a training run needs to put slide attention into a pretrained model from its config.

    handle = use_configured_attention(transformer, config.model.attention, config.model.attention_options)
    weights = slide_offset_weights(transformer, seed)   # initial offset-network weights, by name

`use_configured_attention` maps `model.attention` = "dense" (nothing to do) | "neighborhood" (no
offsets) | "slide" and its options (kernel_size, offsets, max_offset, temporal, backend - the
names `model.attention=slide` takes on our own models, plus `temporal` and `backend`) onto
`use_slide_attention`. On a meta-device model the offset networks are created on the meta device
too; `slide_offset_weights` gives their initial values (the same for the same seed), for the
offload engine's `load_weights` next to the checkpoint's, or `load_state_dict(strict=False)` on a
resident model, so resident and offloaded runs start equal.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from slidefusion.attention import OffsetNet, swappable
from slidefusion.core.errors import UserError, check, unknown_value
from slidefusion.core.validate import renamed_keys
from slidefusion.swap.processor import OFFSETS_ATTR, is_offset_weight  # noqa: F401  (re-exported)
from slidefusion.swap.records import SlideOptions
from slidefusion.swap.apply import SlideAttentionHandle, slide_attention_handle, use_slide_attention

PRETRAINED_ATTENTION = swappable()
_OPTIONS = tuple(f.name for f in dataclasses.fields(SlideOptions))  # the use_slide_attention arguments


def configured_options(attention: str, options: Mapping | None = None) -> SlideOptions | None:
    """`model.attention` / `model.attention_options` of a pretrained model, validated: the
    `SlideOptions` they name, or None for dense. UserError (one line, naming the key) otherwise."""
    options = renamed_keys(options or {}, {"offset_mode": "offsets"}, "model.attention_options")
    if attention not in PRETRAINED_ATTENTION:
        raise unknown_value("model.attention", attention, PRETRAINED_ATTENTION, noun="not available for a pretrained model")
    if attention == "dense":
        check(not options, f"model.attention_options {sorted(options)} need model.attention=slide or neighborhood")
        return None
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise UserError(f"model.attention_options has no {unknown[0]!r} for model.attention={attention}; "
                        f"valid: {', '.join(_OPTIONS)}")
    kwargs = dict(options)
    if attention == "neighborhood":
        check(kwargs.get("offsets") is None, "model.attention=neighborhood has no offsets; drop "
                                             "model.attention_options.offsets or use model.attention=slide")
        kwargs["offsets"] = None
    try:
        return SlideOptions(**kwargs)
    except UserError as error:
        raise UserError(f"model.attention_options: {error}") from None


def use_configured_attention(transformer: nn.Module, attention: str, options: Mapping | None = None,
                             ) -> SlideAttentionHandle | None:
    """Swap `transformer`'s attention as `model.attention` / `model.attention_options` say; None for dense."""
    chosen = configured_options(attention, options)
    if chosen is None:
        return None
    return use_slide_attention(transformer, **dataclasses.asdict(chosen))


def slide_offset_weights(transformer: nn.Module, seed: int = 0) -> dict[str, torch.Tensor]:
    """Fresh initial weights of every offset network `use_slide_attention` added to `transformer`
    (zero last layer), as {state-dict name: CPU tensor in the parameter's dtype}; {} without offsets."""
    handle = slide_attention_handle(transformer)
    check(handle is not None, f"{type(transformer).__name__} does not use swapped slide attention")
    if handle.options.offsets is None:
        return {}
    weights = {}
    for index, path in enumerate(handle.paths):
        module = transformer.get_submodule(path)
        prefix, layers = f"{path}.", module  # our SlideAttention3d holds its offset layers itself
        if hasattr(module, OFFSETS_ATTR):
            prefix, layers = f"{path}.{OFFSETS_ATTR}.", getattr(module, OFFSETS_ATTR)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + index)
            fresh = OffsetNet(layers.offset_conv.in_channels, layers.offset_heads, layers.kernel_size,
                              layers.offsets, layers.max_offset)
        dtype = layers.offset_linear.weight.dtype
        weights.update({prefix + name: value.to(dtype) for name, value in fresh.state_dict().items()})
    return weights
