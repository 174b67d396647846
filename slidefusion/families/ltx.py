"""LTX-Video (diffusers' LTXVideoTransformer3DModel): everything slidefusion knows about it.

The call reproduces what LTXPipeline passes the transformer (packed tokens with the grid as keywords,
the rope interpolation scale it derives from its VAE); how its pipeline encodes prompts (T5 states and
mask) and shifts its timesteps; its self-attention processor, which the slide swap replaces and
token tiling runs by query ranges.
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
from torch import Tensor

from slidefusion.families.base import ModelAdapter
from slidefusion.families.records import BlockList, Objective, SwapRecord, TextSpec, TokenArg, TokenTiling
from slidefusion.families.shared import ONE_T5, batched_pair, encode_with_mask, pipeline_for, pixels, run_pipeline

PROCESSOR = "LTXVideoAttnProcessor"  # the stock processor of its self-attention
FRAME_RATE = 25  # LTXPipeline's default frame_rate, which its rope interpolation scale divides

def pack_tokens(x: Tensor, patch: tuple[int, int, int]) -> Tensor:
    """(B, C, T, H, W) -> (B, T'H'W', C*pt*ph*pw), LTXPipeline's token layout."""
    b, c, t, h, w = x.shape
    pt, ph, pw = patch
    x = x.reshape(b, c, t // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4, 7).flatten(1, 3)


def unpack_tokens(tokens: Tensor, grid: tuple[int, int, int], patch: tuple[int, int, int]) -> Tensor:
    """(B, T'H'W', C*pt*ph*pw) -> (B, C, T, H, W), the inverse of `pack_tokens`."""
    (t, h, w), (pt, ph, pw) = grid, patch
    x = tokens.reshape(tokens.shape[0], t, h, w, -1, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).flatten(6, 7).flatten(4, 5).flatten(2, 3)


def _call_ltx(adapter, model, x, t, text):
    patch, grid = adapter.patch_size(model), adapter.token_grid(model, x.shape)
    mask = None if text.mask is None else text.mask.bool()
    out = model(hidden_states=pack_tokens(x, patch), encoder_hidden_states=text.states, timestep=t,
                encoder_attention_mask=mask, num_frames=grid[0], height=grid[1], width=grid[2],
                rope_interpolation_scale=adapter.options["rope_interpolation_scale"], return_dict=False)[0]
    return unpack_tokens(out, grid, patch)


def _sample(parts, noise: Tensor, cond, uncond, steps: int, guidance: float, progress: bool,
            cfg_batch: bool = False) -> Tensor | None:
    """LTXPipeline's own loop: latents as its packed tokens, both prompts in one batch [uncond, cond]."""
    pipe = pipeline_for(parts, noise)
    if pipe is None or not batched_pair(cond, uncond):
        return None
    model, adapter = parts.transformer, parts.adapter
    patch, grid = adapter.patch_size(model), adapter.token_grid(model, noise.shape)
    sizes = pixels(pipe, noise.shape[2:], "vae_temporal_compression_ratio", "vae_spatial_compression_ratio")
    texts = dict(prompt_embeds=cond.states, prompt_attention_mask=cond.bool_mask())
    if uncond is not None:
        texts.update(negative_prompt_embeds=uncond.states, negative_prompt_attention_mask=uncond.bool_mask())
    out = run_pipeline(pipe, pack_tokens(noise, patch), steps, guidance if uncond is not None else 1.0, progress,
                       **sizes, **texts)
    return unpack_tokens(out, grid, patch)


def _timesteps(scheduler, steps: int, shape: tuple[int, ...]) -> None:
    """LTXPipeline: sigmas 1 .. 1/steps, shifted by mu from the latent token count."""
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    cfg = scheduler.config
    mu = calculate_shift(shape[2] * shape[3] * shape[4], cfg.get("base_image_seq_len", 256),
                         cfg.get("max_image_seq_len", 4096), cfg.get("base_shift", 0.5), cfg.get("max_shift", 1.15))
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)


def _folder_options(vae_config) -> dict:
    """The rope interpolation scale LTXPipeline derives from its VAE: (temporal compression /
    frame_rate, spatial, spatial)."""
    from slidefusion.vae.base import video_vae_factors

    temporal, spatial = video_vae_factors(vae_config)
    return {"rope_interpolation_scale": (temporal / FRAME_RATE, spatial, spatial)}


LTX = ModelAdapter(
    family="ltx", class_name="LTXVideoTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "full", "attn1"),),
    call=_call_ltx, patch=("patch_size_t", "patch_size", "patch_size"),
    objective=Objective("flow", "sigma", 1000.0, "FlowMatchEulerDiscreteScheduler", velocity="noise-x0"),
    text=TextSpec(**ONE_T5, max_length=128, padding="encoder"),
    pipelines=("LTXPipeline", "LTXImageToVideoPipeline"),
    input_layout="packed", text_dim="caption_channels",
    # LTXPipeline: (VAE temporal compression / frame_rate, spatial, spatial) = (8 / 25, 32, 32) by default
    options=MappingProxyType({"rope_interpolation_scale": (8 / FRAME_RATE, 32, 32)}),
    folder_options=_folder_options, timesteps=_timesteps, encode=encode_with_mask, sample=_sample, fps=24,
    # LTXVideoTransformerBlock.forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
    # encoder_attention_mask): RoPE (B, N, D) each; temb (B, 1, 6C), or (B, N, 6C) for per-token timesteps
    token_tiling=TokenTiling(MappingProxyType({"hidden_states": TokenArg(1), "temb": TokenArg(1, sized=True),
                                               "image_rotary_emb": TokenArg(1)}), (PROCESSOR,)),
    swap=SwapRecord((PROCESSOR,)),
)

ADAPTERS = (LTX,)
