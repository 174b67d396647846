"""Latte (diffusers' LatteTransformer3DModel): everything slidefusion knows about it.

Spatial and temporal blocks interleave; the call reproduces what LattePipeline passes the transformer
(states cut after the longest prompt, epsilon prediction with learned variance at DDPM indices). How
its pipeline encodes prompts, its self-attention processor (slide swap, Ulysses), the parallel plan's
facts (per-frame text rows) and its 2-D VAE.
"""

from __future__ import annotations

from types import MappingProxyType

import torch
from torch import Tensor

from slidefusion.core.errors import UserError, check
from slidefusion.families.base import ModelAdapter
from slidefusion.families.records import (
    ROWS,
    AttentionAccess,
    BlockList,
    ModelAccess,
    Objective,
    SwapRecord,
    TextConditioning,
    TextSpec,
    VaeFacts,
)
from slidefusion.families.shared import (
    ONE_T5,
    attention_output,
    batched_pair,
    pipeline_for,
    run_pipeline,
    sdpa,
    text_device,
)

PROCESSOR = "AttnProcessor2_0"  # diffusers' default processor, which its self-attention runs

def _check_latte(adapter, model, shape):
    frames = shape[2]
    check(frames == 1 or frames == model.config.video_length,
          f"latent frames={frames} must be 1 or this Latte's video_length={model.config.video_length} "
          "(its temporal position table has that many rows)")


def _call_latte(adapter, model, x, t, text):
    states = text.states
    if text.mask is not None:  # LattePipeline's mask_feature: cut after the longest prompt
        states = states[:, : max(1, int(text.mask.sum(dim=1).max()))]
    return model(hidden_states=x, timestep=t, encoder_hidden_states=states, enable_temporal_attentions=True,
                 return_dict=False)[0]


def _encode(pipe, prompts: list[str], parts) -> TextConditioning:
    """LattePipeline cuts the states after the prompt (`mask_feature`); the call does the cut from
    the mask, so whole states and the tokenizer's mask are kept (a batch cuts at its longest prompt).
    clean_caption=False: the pipeline's own fallback when beautifulsoup is absent."""
    states, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=text_device(parts),
                                   mask_feature=False, clean_caption=False)
    tokens = pipe.tokenizer(prompts, padding="max_length", max_length=states.shape[1], truncation=True,
                            add_special_tokens=True, return_tensors="pt")
    return TextConditioning(states.float(), tokens.attention_mask.bool())


def _sample(parts, noise: Tensor, cond: TextConditioning, uncond, steps: int, guidance: float, progress: bool,
            cfg_batch: bool = False) -> Tensor | None:
    """LattePipeline's own loop: both prompts in one batch [uncond, cond], cut after the longest
    prompt as `_call_latte` cuts them (the pipeline cuts only embeddings it encodes itself)."""
    pipe = pipeline_for(parts, noise)
    if pipe is None or not batched_pair(cond, uncond):
        return None
    texts = [t for t in (cond, uncond) if t is not None]
    keep = max(max(1, int(t.mask.sum(dim=1).max())) if t.mask is not None else t.states.shape[1] for t in texts)
    t, h, w = noise.shape[2:]
    return run_pipeline(pipe, noise, steps, guidance if uncond is not None else 1.0, progress, video_length=t,
                        height=h * pipe.vae_scale_factor, width=w * pipe.vae_scale_factor,
                        prompt_embeds=cond.states[:, :keep], mask_feature=False, negative_prompt=None,
                        negative_prompt_embeds=None if uncond is None else uncond.states[:, :keep])


# ---------------------------------------------------------------- head-parallel attention
def _check_attention(m) -> None:
    """diffusers' `Attention` under its default processor, as Latte's self-attention uses it."""
    processor = type(m.processor).__name__
    check(processor == PROCESSOR,
          f"ulysses cannot split a diffusers Attention run by {processor}; valid: {PROCESSOR} (the default)")
    extras = {"spatial_norm": m.spatial_norm is not None, "group_norm": m.group_norm is not None,
              "residual_connection": m.residual_connection, "rescale_output_factor": m.rescale_output_factor != 1.0,
              "only_cross_attention": m.only_cross_attention}
    unsupported = [name for name, present in extras.items() if present]
    if unsupported:
        raise UserError(f"ulysses cannot split this diffusers Attention: {unsupported[0]} is not supported "
                        "(valid: a plain self-attention with optional per-head q/k norms)")


def _project(m, x: Tensor, args=(), kwargs=None, span=None) -> Tensor:
    mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None) if kwargs is not None else None
    check(mask is None, "ulysses cannot split a self-attention that is given an attention mask")
    q, k, v = (p(x).unflatten(-1, (m.heads, -1)) for p in (m.to_q, m.to_k, m.to_v))  # (G, n, heads, D)
    q = q if m.norm_q is None else m.norm_q(q)  # the processor's norms act on D, per head and token
    k = k if m.norm_k is None else m.norm_k(k)
    return torch.stack((q, k, v), dim=2)


ATTENTION = AttentionAccess(heads=lambda m: m.heads, project=_project, attend=sdpa, output=attention_output,
                            dense=True, check=_check_attention)


LATTE = ModelAdapter(
    family="latte", class_name="LatteTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "spatial", "attn1"),
                 BlockList("temporal_transformer_blocks", "temporal", "attn1")),
    interleave=True,
    call=_call_latte, patch=(1, "patch_size", "patch_size"),
    objective=Objective("epsilon", "index", 1000.0, "DDIMScheduler", learned_sigma=True),
    text=TextSpec(**ONE_T5, max_length=120, padding="truncate"),
    pipelines=("LattePipeline",), text_dim="caption_channels",
    check_latents=_check_latte, fps=8, encode=_encode, sample=_sample,
    swap=SwapRecord((PROCESSOR,)),
    parallel=ModelAccess(
        output="proj_out", layout=ROWS,
        batched=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"),
        # Latte repeats the text states and timestep embedding per frame (spatial) or position (temporal)
        rows=MappingProxyType({"spatial": ("encoder_hidden_states", "timestep"), "temporal": ("timestep",)})),
    attention=MappingProxyType({"diffusers.models.attention_processor.Attention": ATTENTION}),
    vae=VaeFacts(image=("AutoencoderKL",)),  # a 2-D VAE, run frame by frame
)

ADAPTERS = (LATTE,)
