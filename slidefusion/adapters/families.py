"""Records for the diffusers video transformers, each with the one call function it needs.

Each call reproduces what the family's own pipeline passes the transformer (read from
diffusers' `pipelines/<family>/pipeline_<family>.py`), so `predict` equals the model's forward
as the pipeline runs it. Timesteps are always in the model's own units (`Objective.timestep`).
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch
from torch import Tensor, nn

from slidefusion.adapters.base import ModelAdapter
from slidefusion.adapters.records import BlockList, Objective, TextConditioning, TextSpec, TokenArg, TokenTiling
from slidefusion.errors import check

T5 = ("T5EncoderModel",)
ONE_T5 = dict(encoders=("text_encoder",), tokenizers=("tokenizer",), encoder_classes=T5)


# ---------------------------------------------------------------- Wan 2.1 / 2.2
def _call_wan(adapter: ModelAdapter, model: nn.Module, x: Tensor, t: Tensor, text: TextConditioning) -> Tensor:
    first_frame = adapter.options["expand_timesteps"] and text.video is not None
    if adapter.options["expand_timesteps"] and t.ndim == 1:
        # Wan 2.2 TI2V: one timestep per video token, as WanPipeline builds them (all equal for text-to-video;
        # WanImageToVideoPipeline's image mode gives the first latent frame's tokens timestep 0)
        per_token = t[:, None].expand(-1, adapter.tokens(model, x.shape))
        if first_frame:
            per_frame = math.prod(adapter.token_grid(model, x.shape)[1:])
            per_token = torch.cat([torch.zeros_like(per_token[:, :per_frame]), per_token[:, per_frame:]], dim=1)
        t = per_token
    if first_frame:  # the condition's latents stand in for the first latent frame
        x = torch.cat([text.video.to(x.dtype), x[:, :, 1:]], dim=2)
    elif text.video is not None:  # Wan 2.1 I2V: mask and first-frame latents beside the latents
        x = torch.cat([x, text.video.to(x.dtype)], dim=1)
    # WanPipeline zero-pads the prompt states to max_sequence_length and passes no mask.
    states = text.states if text.mask is None else text.states * text.mask[..., None].to(text.states.dtype)
    return model(hidden_states=x, timestep=t, encoder_hidden_states=states,
                 encoder_hidden_states_image=text.image, return_dict=False)[0]


def _check_wan(adapter, model, shape):
    # diffusers' WanRotaryPosEmbed slices a table of rope_max_seq_len positions per axis: past it, a reshape error
    grid = [size // patch for size, patch in zip(shape[2:], adapter.patch_size(model))]
    longest = int(model.config.rope_max_seq_len)
    check(max(grid) <= longest, f"latent grid {'x'.join(map(str, grid))} exceeds this Wan's rotary table: "
                                f"frames, height and width / patch must each be <= rope_max_seq_len={longest}")


WAN = ModelAdapter(
    family="wan", class_name="WanTransformer3DModel", channels="out_channels",  # I2V: in = latents + condition
    block_lists=(BlockList("blocks", "full", "attn1"),),
    call=_call_wan, patch=("patch_size.0", "patch_size.1", "patch_size.2"),
    objective=Objective("flow", "sigma", 1000.0, "UniPCMultistepScheduler", velocity="noise-x0"),
    text=TextSpec(("text_encoder",), ("tokenizer",), ("UMT5EncoderModel",), 512, "zeros"),
    pipelines=("WanPipeline", "WanImageToVideoPipeline"),
    options=MappingProxyType({"expand_timesteps": False}),
    check_latents=_check_wan,
    # WanTransformerBlock.forward(hidden_states, encoder_hidden_states, temb, rotary_emb): the RoPE
    # tables are (1, N, 1, D) each; temb is (B, 6, C), or (B, N, 6, C) with expand_timesteps (2.2 TI2V)
    token_tiling=TokenTiling(MappingProxyType({"hidden_states": TokenArg(1), "temb": TokenArg(1, ndim=4),
                                               "rotary_emb": TokenArg(1)}), ("WanAttnProcessor",)),
)


# ---------------------------------------------------------------- CogVideoX 1.0 / 1.5
def _cogvideox_rotary(model: nn.Module, grid: tuple[int, int, int], device) -> tuple[Tensor, Tensor]:
    """The 3D RoPE CogVideoXPipeline computes for a (T', H', W') grid (latent units throughout)."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    cfg, (t, h, w) = model.config, grid
    base_w, base_h = cfg.sample_width // cfg.patch_size, cfg.sample_height // cfg.patch_size
    if cfg.patch_size_t is None:  # 1.0: crop region of the base grid
        crops = get_resize_crop_region_for_grid((h, w), base_w, base_h)
        return get_3d_rotary_pos_embed(embed_dim=cfg.attention_head_dim, crops_coords=crops, grid_size=(h, w),
                                       temporal_size=t, device=device)
    check(h <= base_h and w <= base_w, f"latent grid {h}x{w} exceeds this CogVideoX 1.5's rotary table "
                                       f"{base_h}x{base_w} (sample_height, sample_width / patch_size)")
    return get_3d_rotary_pos_embed(embed_dim=cfg.attention_head_dim, crops_coords=None, grid_size=(h, w),
                                   temporal_size=t, grid_type="slice", max_size=(base_h, base_w), device=device)


def _call_cogvideox(adapter, model, x, t, text):
    cfg = model.config
    if not cfg.use_rotary_positional_embeddings or cfg.use_learned_positional_embeddings:
        # Its position table covers exactly max_text_seq_length text tokens before the video tokens.
        check(text.states.shape[1] == cfg.max_text_seq_length,
              f"text.states has {text.states.shape[1]} tokens; this CogVideoX needs exactly "
              f"max_text_seq_length={cfg.max_text_seq_length} (pad the prompt to that length)")
    grid = adapter.token_grid(model, x.shape)
    rotary = _cogvideox_rotary(model, grid, x.device) if cfg.use_rotary_positional_embeddings else None
    ofs = x.new_full((1,), 2.0) if cfg.ofs_embed_dim else None  # CogVideoX 1.5 I2V, as its pipeline
    out = model(hidden_states=x.transpose(1, 2), encoder_hidden_states=text.states, timestep=t, ofs=ofs,
                image_rotary_emb=rotary, return_dict=False)[0]  # (B, T, C, H, W)
    return out.transpose(1, 2)


COGVIDEOX = ModelAdapter(
    family="cogvideox", class_name="CogVideoXTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "full", "attn1", joint=True),),
    call=_call_cogvideox, patch=("patch_size_t", "patch_size", "patch_size"),
    objective=Objective("v", "index", 1000.0, "CogVideoXDDIMScheduler"),
    text=TextSpec(**ONE_T5, max_length=226, padding="encoder"),
    pipelines=("CogVideoXPipeline", "CogVideoXImageToVideoPipeline"),
    input_layout="BTCHW", text_dim="text_embed_dim", fps=8,
)


# ---------------------------------------------------------------- HunyuanVideo
def _call_hunyuan(adapter, model, x, t, text):
    check(text.pooled is not None, "text.pooled is required for HunyuanVideo: (B, pooled_projection_dim), "
                                   "the pooled output of its CLIP text_encoder_2")
    mask = text.bool_mask()
    # The model counts real tokens and keeps the first ones, so the mask must be a prefix.
    check(bool((mask.int().diff(dim=1) <= 0).all()), "text.mask must mark a prefix of real tokens for HunyuanVideo")
    guidance = None
    if model.config.guidance_embeds:  # guidance-distilled: the pipeline embeds guidance_scale * 1000
        scale = adapter.options["guidance_scale"] if text.guidance is None else text.guidance
        guidance = torch.as_tensor(scale, dtype=model.dtype, device=x.device).expand(x.shape[0]) * 1000.0
    return model(hidden_states=x, timestep=t, encoder_hidden_states=text.states, encoder_attention_mask=mask,
                 pooled_projections=text.pooled, guidance=guidance, return_dict=False)[0]


HUNYUAN = ModelAdapter(
    family="hunyuanvideo", class_name="HunyuanVideoTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "full", "attn", joint=True),
                 BlockList("single_transformer_blocks", "full", "attn", joint=True)),
    call=_call_hunyuan, patch=("patch_size_t", "patch_size", "patch_size"),
    objective=Objective("flow", "sigma", 1000.0, "FlowMatchEulerDiscreteScheduler", velocity="noise-x0"),
    text=TextSpec(("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"), ("LlamaModel", "CLIPTextModel"),
                  256, "encoder", pooled=True),
    pipelines=("HunyuanVideoPipeline",), text_dim="text_embed_dim", pooled_dim="pooled_projection_dim",
    options=MappingProxyType({"guidance_scale": 6.0}),  # HunyuanVideoPipeline's default
    schedule="linspace", guidance="embedded", fps=15,
)


# ---------------------------------------------------------------- LTX-Video
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


LTX = ModelAdapter(
    family="ltx", class_name="LTXVideoTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "full", "attn1"),),
    call=_call_ltx, patch=("patch_size_t", "patch_size", "patch_size"),
    objective=Objective("flow", "sigma", 1000.0, "FlowMatchEulerDiscreteScheduler", velocity="noise-x0"),
    text=TextSpec(**ONE_T5, max_length=128, padding="encoder"),
    pipelines=("LTXPipeline", "LTXImageToVideoPipeline"),
    input_layout="packed", text_dim="caption_channels",
    # LTXPipeline: (VAE temporal compression / frame_rate, spatial, spatial) = (8 / 25, 32, 32) by default
    options=MappingProxyType({"rope_interpolation_scale": (8 / 25, 32, 32)}),
    schedule="shifted-linspace", fps=24,
    # LTXVideoTransformerBlock.forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb,
    # encoder_attention_mask): RoPE (B, N, D) each; temb (B, 1, 6C), or (B, N, 6C) for per-token timesteps
    token_tiling=TokenTiling(MappingProxyType({"hidden_states": TokenArg(1), "temb": TokenArg(1, sized=True),
                                               "image_rotary_emb": TokenArg(1)}), ("LTXVideoAttnProcessor",)),
)


# ---------------------------------------------------------------- Mochi
def _call_mochi(adapter, model, x, t, text):
    return model(hidden_states=x, encoder_hidden_states=text.states, timestep=t,
                 encoder_attention_mask=text.bool_mask(), return_dict=False)[0]


MOCHI = ModelAdapter(
    family="mochi", class_name="MochiTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "full", "attn1", joint=True),),
    call=_call_mochi, patch=(1, "patch_size", "patch_size"),
    # Mochi's scheduler inverts the sigmas: the model sees (1 - sigma) * 1000 and predicts x0 - noise.
    objective=Objective("flow", "1-sigma", 1000.0, "FlowMatchEulerDiscreteScheduler", velocity="x0-noise"),
    text=TextSpec(**ONE_T5, max_length=256, padding="encoder"),
    pipelines=("MochiPipeline",), text_dim="text_embed_dim", schedule="linear-quadratic", fps=30,
)


# ---------------------------------------------------------------- Latte
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


LATTE = ModelAdapter(
    family="latte", class_name="LatteTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "spatial", "attn1"),
                 BlockList("temporal_transformer_blocks", "temporal", "attn1")),
    interleave=True,
    call=_call_latte, patch=(1, "patch_size", "patch_size"),
    objective=Objective("epsilon", "index", 1000.0, "DDIMScheduler", learned_sigma=True),
    text=TextSpec(**ONE_T5, max_length=120, padding="truncate"),
    pipelines=("LattePipeline",), text_dim="caption_channels",
    check_latents=_check_latte, fps=8,
)

DIFFUSERS_ADAPTERS = (WAN, COGVIDEOX, HUNYUAN, LTX, MOCHI, LATTE)
