"""Model adapters: one declarative record per model class (diffusers' video transformers and our
own DiT3D/STDiT), read by generic functions, so engines never special-case a class.

    adapter = adapter_for(transformer)
    adapter.blocks(model), adapter.block_kinds(model), adapter.attention_sites(model)
    adapter.token_grid(model, latents.shape), adapter.predict(model, latents, timesteps, text)
"""

from slidefusion.adapters.base import ModelAdapter, config_value
from slidefusion.adapters.records import AttentionSite, BlockList, Objective, TextConditioning, TextSpec, TokenArg, TokenTiling
from slidefusion.adapters.registry import ADAPTERS, DIFFUSERS_CLASSES, adapter_for, adapter_for_class, supported_classes

__all__ = ["ADAPTERS", "DIFFUSERS_CLASSES", "AttentionSite", "BlockList", "ModelAdapter", "Objective",
           "TextConditioning", "TextSpec", "TokenArg", "TokenTiling", "adapter_for", "adapter_for_class", "config_value", "supported_classes"]
