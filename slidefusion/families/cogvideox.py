"""CogVideoX 1.0 / 1.5 (diffusers' CogVideoXTransformer3DModel): everything slidefusion knows about it.

The call reproduces what CogVideoXPipeline passes the transformer (frames-first latents, its 3D RoPE,
v-prediction at DDPM step indices); its pipeline encodes prompts as T5 states without a mask; its
joint text+video attention puts the text tokens first (what the slide swap needs).
"""

from __future__ import annotations

from torch import Tensor, nn

from slidefusion.core.errors import check
from slidefusion.families.base import ModelAdapter
from slidefusion.families.records import BlockList, Objective, SwapRecord, TextSpec
from slidefusion.families.shared import ONE_T5, batched_pair, encode_states_only, pipeline_for, pixels, run_pipeline

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


def _sample(parts, noise: Tensor, cond, uncond, steps: int, guidance: float, progress: bool,
            cfg_batch: bool = False) -> Tensor | None:
    """CogVideoXPipeline's own loop (its DPM scheduler's two-sample step included): latents frames
    first, both prompts in one batch [uncond, cond]."""
    pipe = pipeline_for(parts, noise)
    if pipe is None or not batched_pair(cond, uncond):
        return None
    sizes = pixels(pipe, noise.shape[2:])
    out = run_pipeline(pipe, noise.transpose(1, 2), steps, guidance if uncond is not None else 1.0, progress,
                       **sizes, prompt_embeds=cond.states, negative_prompt_embeds=None if uncond is None else uncond.states)
    return out.transpose(1, 2)  # (B, T, C, H, W) -> (B, C, T, H, W)


COGVIDEOX = ModelAdapter(
    family="cogvideox", class_name="CogVideoXTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "full", "attn1", joint=True),),
    call=_call_cogvideox, patch=("patch_size_t", "patch_size", "patch_size"),
    objective=Objective("v", "index", 1000.0, "CogVideoXDDIMScheduler"),
    text=TextSpec(**ONE_T5, max_length=226, padding="encoder"),
    pipelines=("CogVideoXPipeline", "CogVideoXImageToVideoPipeline"),
    input_layout="BTCHW", text_dim="text_embed_dim", fps=8,
    encode=encode_states_only, sample=_sample,
    swap=SwapRecord(("CogVideoXAttnProcessor2_0",), text="first"),
)

ADAPTERS = (COGVIDEOX,)
