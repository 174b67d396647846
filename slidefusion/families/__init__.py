"""Model families: one module per family (ours, wan, cogvideox, hunyuanvideo, ltx, mochi, latte), each
holding everything slidefusion knows about it as one declarative record per model class, read by
generic functions, so engines never special-case a class. This package is the only place a family
or a diffusers class is named.

    adapter = adapter_for(transformer)
    adapter.blocks(model), adapter.block_kinds(model), adapter.attention_sites(model)
    adapter.token_grid(model, latents.shape), adapter.predict(model, latents, timesteps, text)
    adapter.swap, adapter.parallel, adapter.attention, adapter.encode, adapter.timesteps, ...
"""

from slidefusion.families.base import ModelAdapter, config_value
from slidefusion.families.records import (
    AttentionAccess,
    AttentionSite,
    BlockList,
    ImageToVideo,
    ModelAccess,
    Objective,
    SwapRecord,
    TextConditioning,
    TextSpec,
    TileSplit,
    TokenArg,
    TokenTiling,
    VaeFacts,
)
from slidefusion.families.registry import (
    ADAPTERS,
    DIFFUSERS_CLASSES,
    FAMILIES,
    adapter_for,
    adapter_for_class,
    adapters_with,
    original_layout,
    supported_classes,
    vae_facts,
)

__all__ = ["ADAPTERS", "DIFFUSERS_CLASSES", "FAMILIES", "AttentionAccess", "AttentionSite", "BlockList",
           "ImageToVideo", "ModelAccess", "ModelAdapter", "Objective", "SwapRecord", "TextConditioning", "TextSpec", "TileSplit",
           "TokenArg", "TokenTiling", "VaeFacts", "adapter_for", "adapter_for_class", "adapters_with", "config_value", "original_layout",
           "supported_classes", "vae_facts"]
