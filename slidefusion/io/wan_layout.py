"""Wan's original key names <-> diffusers' `WanTransformer3DModel` names, both directions.

The original layout is the state dict of the Wan repository's `WanModel`. ComfyUI loads it
unchanged as a single-file transformer (models/diffusion_models) and names LoRA modules by it under
a "diffusion_model." prefix; diffusers reads it with `WanTransformer3DModel.from_single_file` and
`load_lora_weights`. Every name maps to exactly one name and no tensor is split, fused or reshaped,
so a conversion streams one tensor at a time.

The tables are kept beside the other file formats; the family's record names this module
(`ModelAdapter.layout`). Wan 2.1 (T2V, I2V, FLF2V), Wan 2.2 TI2V and each Wan 2.2 A14B expert share them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from slidefusion.core.errors import UserError

PREFIXES = ("model.diffusion_model.", "diffusion_model.")  # full ComfyUI checkpoints; ComfyUI LoRA names
LORA_PREFIX = "diffusion_model."

# diffusers module (or parameter) path -> original, outside the blocks
_TOP = {
    "patch_embedding": "patch_embedding",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.image_embedder.norm1": "img_emb.proj.0",  # Wan 2.1 I2V / FLF2V image projection
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "condition_embedder.image_embedder.norm2": "img_emb.proj.4",
    "condition_embedder.image_embedder.pos_embed": "img_emb.emb_pos",  # FLF2V's two-image positions
    "proj_out": "head.head",
    "scale_shift_table": "head.modulation",
}
# inside blocks.N., the same
_BLOCK = {
    "scale_shift_table": "modulation",
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o", "attn1.norm_q": "self_attn.norm_q", "attn1.norm_k": "self_attn.norm_k",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o", "attn2.norm_q": "cross_attn.norm_q", "attn2.norm_k": "cross_attn.norm_k",
    "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
    "attn2.norm_added_k": "cross_attn.norm_k_img",
    # the cross-attention's input norm: Wan calls it norm3 (its norm2, before the FFN, has no weights)
    "norm2": "norm3",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_BLOCK_BACK = {v: k for k, v in _BLOCK.items()}
_IN_BLOCK = re.compile(r"^(blocks\.\d+\.)(.+)$")
# LoRA modules whose ".alpha" diffusers' reader of this layout applies (the blocks' attention and
# FFN projections); elsewhere it ignores alpha, so there alpha / rank is folded into lora_B instead.
_ALPHA_MODULES = re.compile(r"^blocks\.\d+\.(self_attn\.[qkvo]|cross_attn\.([qkvo]|k_img|v_img)|ffn\.[02])$")


def _rename(name: str, top: dict, block: dict) -> str | None:
    """`name` (a parameter, or a module path) through the tables, or None if they do not cover it."""
    match = _IN_BLOCK.match(name)
    prefix, rest, table = (match.group(1), match.group(2), block) if match else ("", name, top)
    if rest in table:
        return prefix + table[rest]
    module, _, leaf = rest.rpartition(".")
    return f"{prefix}{table[module]}.{leaf}" if module in table else None


def original_name(name: str) -> str | None:
    """diffusers name ("blocks.0.attn1.to_q.weight", or a module path) -> original, or None."""
    return _rename(name, _TOP, _BLOCK)


def diffusers_name(name: str) -> str | None:
    """Original name ("blocks.0.self_attn.q.weight", or a module path; a ComfyUI prefix is dropped)
    -> diffusers, or None."""
    return _rename(strip_prefix(name), _TOP_BACK, _BLOCK_BACK)


def strip_prefix(name: str) -> str:
    for prefix in PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def layout_of(names: Iterable[str]) -> str | None:
    """"original", "diffusers" or None (neither: another family, or not a transformer) for the
    tensor names of a Wan transformer file."""
    names = {strip_prefix(n) for n in names}
    if "head.modulation" in names and "head.head.weight" in names:
        return "original"
    if "scale_shift_table" in names and "condition_embedder.time_proj.weight" in names:
        return "diffusers"
    return None


def to_original(names: Iterable[str]) -> dict[str, str]:
    """{diffusers name: original name} for every name; UserError naming the first it cannot map."""
    mapping = {}
    for name in names:
        mapped = original_name(name)
        if mapped is None:
            raise UserError(f"weight {name} has no place in Wan's original layout (a Wan variant this "
                            "layout does not cover, e.g. VACE or Animate)")
        mapping[name] = mapped
    return mapping


def alpha_is_read(original_module: str) -> bool:
    """Whether readers of this layout scale the LoRA on `original_module` by its ".alpha" tensor
    (ComfyUI always does; diffusers only on these modules)."""
    return _ALPHA_MODULES.match(original_module) is not None
