"""Wan 2.1 / 2.2 (diffusers' WanTransformer3DModel): everything slidefusion knows about the family.

The call reproduces what WanPipeline passes the transformer, so `predict` equals the model's forward
as the pipeline runs it; timesteps are in the model's own units (sigma * 1000). Besides: how its
pipeline encodes prompts (zero-padded umT5 states, no mask), its self-attention processor (swapped
for slide attention, tiled by query ranges, split by heads under Ulysses), the parallel plan's facts,
the published sizes the offload planner knows, and where its VAE's decoder splits.
"""

from __future__ import annotations

import math
from types import MappingProxyType

import torch
from torch import Tensor, nn

from slidefusion.core.errors import check
from slidefusion.io import wan_layout
from slidefusion.families.base import ModelAdapter
from slidefusion.families.records import (
    ROWS,
    AttentionAccess,
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
from slidefusion.families.shared import (
    attention_output,
    encode_states_only,
    pipeline_for,
    pixels,
    run_pipeline,
    sdpa,
)

PROCESSOR = "WanAttnProcessor"  # the stock processor of its self-attention


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


def _image_mode(config, options) -> str | None:
    """Wan 2.1 I2V (an image projection, or more input than output channels): "channels"; Wan 2.2
    TI2V (`expand_timesteps`): "first-frame"; text-to-video: None (`ImageToVideo`)."""
    if config.get("image_dim") is not None or int(config.get("in_channels", 0)) != int(config.get("out_channels") or 0):
        return "channels"
    return "first-frame" if options["expand_timesteps"] else None


def _check_wan(adapter, model, shape):
    # diffusers' WanRotaryPosEmbed slices a table of rope_max_seq_len positions per axis: past it, a reshape error
    grid = [size // patch for size, patch in zip(shape[2:], adapter.patch_size(model))]
    longest = int(model.config.rope_max_seq_len)
    check(max(grid) <= longest, f"latent grid {'x'.join(map(str, grid))} exceeds this Wan's rotary table: "
                                f"frames, height and width / patch must each be <= rope_max_seq_len={longest}")


def _states(text: TextConditioning | None):
    """WanPipeline's prompt embeddings: zero past the prompt, no mask (what `_call_wan` passes too)."""
    if text is None or text.mask is None:
        return None if text is None else text.states
    return text.states * text.mask[..., None].to(text.states.dtype)


def _sample(parts, noise: Tensor, cond: TextConditioning, uncond, steps: int, guidance: float, progress: bool,
            cfg_batch: bool = False) -> Tensor | None:
    """WanPipeline's own loop (both experts of Wan 2.2 A14B, per-token timesteps of 2.2 TI2V). Not
    under CFG-parallel (None: the generic loop): the pipeline calls the transformer once for the
    conditional and once for the unconditional prediction, and CFG-parallel needs both in one batch."""
    pipe = pipeline_for(parts, noise)
    if pipe is None or (cfg_batch and uncond is not None):
        return None
    sizes = pixels(pipe, noise.shape[2:])
    if sizes["height"] % 16 or sizes["width"] % 16:  # WanPipeline's own rule for the sizes it takes
        return None
    return run_pipeline(pipe, noise, steps, guidance if uncond is not None else 1.0, progress, **sizes,
                        prompt_embeds=_states(cond), negative_prompt_embeds=_states(uncond))


# ---------------------------------------------------------------- head-parallel attention
def _check_attention(m) -> None:
    processor = type(m.processor).__name__
    check(processor == PROCESSOR,
          f"ulysses cannot split a {type(m).__name__} run by {processor}; valid: {PROCESSOR} (the default)")
    check(not m.is_cross_attention and m.add_k_proj is None, "ulysses splits Wan's self-attention only")


def _rotate(h: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Wan's rotary embedding on interleaved pairs (its processor's apply_rotary_emb)."""
    x1, x2 = h.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(h)
    out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
    out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
    return out.type_as(h)


def _project(m, x: Tensor, args=(), kwargs=None, span=None) -> Tensor:
    """x (G, n, C), this rank's tokens [start, start + n) -> (G, n, 3, heads, D). Wan's RMSNorm spans
    every head of a token, so it is per token; the rotary table (1, N_r, 1, D) is this rank's and is
    cut to the chunk."""
    kwargs = kwargs or {}
    rotary = kwargs.get("rotary_emb", args[2] if len(args) > 2 else None)
    if m.fused_projections:
        q, k, v = m.to_qkv(x).chunk(3, dim=-1)
    else:
        q, k, v = m.to_q(x), m.to_k(x), m.to_v(x)
    q, k, v = (t.unflatten(2, (m.heads, -1)) for t in (m.norm_q(q), m.norm_k(k), v))
    if rotary is not None:
        cos, sin = (t.narrow(1, *span) for t in rotary)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    return torch.stack((q, k, v), dim=2)


ATTENTION = AttentionAccess(heads=lambda m: m.heads, project=_project, attend=sdpa, output=attention_output,
                            dense=True, check=_check_attention)


# ---------------------------------------------------------------- the planner: published sizes
# The Wan 2.1 text-to-video transformers as diffusers configures them; both take umT5-XXL text
# (4096 wide, 512 tokens) and latents of a 4x temporal / 8x spatial VAE.
_COMMON = dict(patch_size=[1, 2, 2], attention_head_dim=128, in_channels=16, out_channels=16, text_dim=4096,
               freq_dim=256, cross_attn_norm=True, qk_norm="rms_norm_across_heads", image_dim=None,
               added_kv_proj_dim=None, pos_embed_seq_len=None)
PRESETS = {"wan2.1-1.3b": dict(_COMMON, num_attention_heads=12, ffn_dim=8960, num_layers=30),
           "wan2.1-14b": dict(_COMMON, num_attention_heads=40, ffn_dim=13824, num_layers=40)}


def _widths(model: nn.Module) -> tuple[int, int, float]:
    cfg = model.config
    hidden = int(cfg.num_attention_heads) * int(cfg.attention_head_dim)
    return hidden, int(cfg.num_attention_heads), float(cfg.ffn_dim) / hidden


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
                                               "rotary_emb": TokenArg(1)}), (PROCESSOR,)),
    encode=encode_states_only, sample=_sample,
    swap=SwapRecord((PROCESSOR,), grid_bound="rope_max_seq_len"),  # its RoPE table's length
    parallel=ModelAccess(
        output="proj_out", layout=ROWS,
        batched=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
        token_args=MappingProxyType({"timestep": 1}),  # Wan 2.2 TI2V: (B, N), one timestep per token
        token_outputs=MappingProxyType({"rope": 1})),  # (cos, sin), each (1, N, 1, D)
    attention=MappingProxyType({"diffusers.models.transformers.transformer_wan.WanAttention": ATTENTION}),
    presets=MappingProxyType(PRESETS), widths=_widths,
    # Its decoder is local after the mid-block: the up path splits by columns (parallel decode).
    vae=VaeFacts(splits=MappingProxyType({"AutoencoderKLWan": TileSplit(
        "decoder.mid_block", ("decoder.up_blocks", "decoder.norm_out", "decoder.conv_out"))})),
    image_to_video=ImageToVideo("WanImageToVideoPipeline", _image_mode),
    layout=wan_layout,  # the Wan repository's names, which ComfyUI loads and names LoRA modules by
)

ADAPTERS = (WAN,)

