"""Tiny random models of every supported family, and a tiny Wan pipeline folder, built offline.

Shared by the tests (through `tests/conftest.py` fixtures) and the benchmarks. Nothing is
downloaded: configs are small literals, weights are seeded random numbers (every parameter is
perturbed, so zero-initialised output layers do not make every prediction 0), the tokenizer is a
word-level `tokenizers` model. Building any one model takes milliseconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from slidefusion.families import TextConditioning, adapter_for

TEXT_DIM = 16  # the text state width of every tiny model (ours excepted: their presets say)

# family -> (diffusers class, config); a few blocks and small dims, but every layout the real
# checkpoints have (Wan 2.2 TI2V's 48 channels, CogVideoX 1.0 with fixed positions and 1.5 with a
# temporal patch, Latte's learned-sigma output).
TINY: dict[str, tuple[str, dict]] = {
    "wan": ("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=TEXT_DIM, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)),
    "wan2.2-ti2v": ("WanTransformer3DModel", dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=48, out_channels=48,
        text_dim=TEXT_DIM, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32)),
    "cogvideox": ("CogVideoXTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=TEXT_DIM, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True)),
    "cogvideox-sincos": ("CogVideoXTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=TEXT_DIM, num_layers=2, sample_width=8, sample_height=8, sample_frames=9, patch_size=2,
        temporal_compression_ratio=4, max_text_seq_length=8)),
    "cogvideox1.5": ("CogVideoXTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=TEXT_DIM, num_layers=2, sample_width=16, sample_height=16, sample_frames=9, patch_size=2,
        patch_size_t=2, temporal_compression_ratio=4, max_text_seq_length=8, use_rotary_positional_embeddings=True)),
    "hunyuanvideo": ("HunyuanVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=2,
        num_single_layers=2, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=TEXT_DIM,
        pooled_projection_dim=8, rope_axes_dim=(2, 2, 4), guidance_embeds=True)),
    "ltx": ("LTXVideoTransformer3DModel", dict(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=2, caption_channels=TEXT_DIM)),
    "mochi": ("MochiTransformer3DModel", dict(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=TEXT_DIM, time_embed_dim=4, max_sequence_length=16)),
    "latte": ("LatteTransformer3DModel", dict(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, cross_attention_dim=16, caption_channels=TEXT_DIM, video_length=3, norm_type="ada_norm_single",
        num_embeds_ada_norm=1000, activation_fn="gelu-approximate", norm_elementwise_affine=False, norm_eps=1e-6,
        attention_bias=True)),
}
OURS = {"dit3d": "dit3d-tiny", "stdit": "stdit-tiny"}
FAMILIES = tuple(TINY) + tuple(OURS)
# A latent shape (C, T, H, W) that every layout accepts (T = Latte's video_length, even for 1.5's p_t)
# (odd grids, not square, so that a swapped height and width shows).
LATENT_THW = {"cogvideox1.5": (4, 6, 10), "latte": (3, 6, 10), "dit3d": (3, 6, 10), "stdit": (3, 6, 10)}


def perturb_(model: nn.Module, seed: int, scale: float = 0.1) -> nn.Module:
    """Add seeded noise to every parameter, so zero-initialised layers produce non-zero outputs."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale)
    return model


def tiny_model(family: str, seed: int = 0, **overrides) -> nn.Module:
    """A tiny random model of `family` (a key of `TINY` or `OURS`), in eval mode, float32."""
    if family in OURS:
        from slidefusion.models import build_model, preset

        torch.manual_seed(seed)
        return perturb_(build_model(preset(OURS[family], **overrides)), seed).eval()
    import diffusers

    class_name, config = TINY[family]
    torch.manual_seed(seed)
    return perturb_(getattr(diffusers, class_name)(**{**config, **overrides}), seed).eval()


def tiny_latents(model: nn.Module, batch: int = 2, thw: tuple[int, int, int] = (2, 6, 10), seed: int = 0) -> torch.Tensor:
    """Random latents (B, C, T, H, W) for `model`."""
    channels = adapter_for(model).latent_channels(model)
    return torch.randn(batch, channels, *thw, generator=torch.Generator().manual_seed(seed))


def tiny_text(model: nn.Module, batch: int = 2, length: int = 8, seed: int = 0, lengths=None) -> TextConditioning:
    """Random text conditioning of the right widths; `lengths` (per sample) makes a prefix mask."""
    adapter, generator = adapter_for(model), torch.Generator().manual_seed(seed)
    states = torch.randn(batch, length, adapter.text_width(model), generator=generator)
    mask = None
    if lengths is not None:
        mask = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    pooled = None
    if adapter.pooled_dim is not None:
        pooled = torch.randn(batch, int(getattr(model.config, adapter.pooled_dim)), generator=generator)
    return TextConditioning(states, mask, pooled)


def family_latent_thw(family: str) -> tuple[int, int, int]:
    return LATENT_THW.get(family, (2, 6, 10))


# ---------------------------------------------------------------- a tiny Wan pipeline folder
WORDS = ("a an the of on in and with to is red green blue yellow orange purple white black gray navy "
         "circle square triangle star cat dog ball moving up down left right slowly quickly fast slow "
         "background video scene bright dark small large").split()


def tiny_tokenizer(max_length: int = 64):
    """A word-level T5-style tokenizer (pad 0, eos 1, unk 2; "</s>" appended), as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {word: i for i, word in enumerate(["<pad>", "</s>", "<unk>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.normalizer = normalizers.Lowercase()
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>",
                                   model_max_length=max_length)


def tiny_umt5(vocab_size: int, seed: int = 0):
    """A one-layer UMT5 encoder of width TEXT_DIM."""
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    config = UMT5Config(vocab_size=vocab_size, d_model=TEXT_DIM, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                        relative_attention_num_buckets=8, relative_attention_max_distance=16,
                        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
    return UMT5EncoderModel(config).eval()


def tiny_wan_vae(z_dim: int = 4, residual: bool = False, seed: int = 0):
    """AutoencoderKLWan with Wan 2.1's topology (or 2.2's residual, patch-2 one) at 8 base channels:
    time x4, space x8 (x16 for 2.2)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    extra = dict(is_residual=True, patch_size=2, in_channels=12, out_channels=12, scale_factor_spatial=16) if residual else {}
    return AutoencoderKLWan(base_dim=8, z_dim=z_dim, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.0] * z_dim,
                            latents_std=[1.0] * z_dim, **extra).eval()


def wan_scheduler(flow_shift: float = 3.0):
    """The scheduler Wan 2.1's released pipelines ship: UniPC on flow sigmas."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   num_train_timesteps=1000, flow_shift=flow_shift)


WAN_VARIANTS = ("2.1", "2.2-ti2v", "2.2-a14b")


def tiny_wan_pipeline(variant: str = "2.1", seed: int = 0):
    """A `WanPipeline` of tiny random components in one of Wan's layouts (`WAN_VARIANTS`)."""
    from diffusers import WanPipeline

    assert variant in WAN_VARIANTS, variant
    tokenizer = tiny_tokenizer()
    family = "wan2.2-ti2v" if variant == "2.2-ti2v" else "wan"
    transformer = tiny_model(family, seed)
    vae = tiny_wan_vae(transformer.config.in_channels, residual=variant == "2.2-ti2v", seed=seed)
    extra = {}
    if variant == "2.2-a14b":  # two experts: transformer for high noise, transformer_2 for low noise
        extra = dict(transformer_2=tiny_model("wan", seed + 1), boundary_ratio=0.875)
    if variant == "2.2-ti2v":
        extra = dict(expand_timesteps=True)
    return WanPipeline(tokenizer=tokenizer, text_encoder=tiny_umt5(len(tokenizer), seed), vae=vae,
                       transformer=transformer, scheduler=wan_scheduler(), **extra)


def save_tiny_wan_pipeline(path: str | Path, variant: str = "2.1", seed: int = 0,
                           max_shard_size: str | None = None) -> Path:
    """`save_pretrained` a tiny Wan pipeline into `path` (created); transformers sharded if asked."""
    path = Path(path)
    pipe = tiny_wan_pipeline(variant, seed)
    pipe.save_pretrained(path)
    if max_shard_size is not None:
        for name in ("transformer", "transformer_2"):
            model = getattr(pipe, name, None)
            if model is not None:
                for old in (path / name).glob("diffusion_pytorch_model*"):
                    old.unlink()
                model.save_pretrained(path / name, max_shard_size=max_shard_size)
    return path


def save_tiny_transformer(path: str | Path, family: str = "wan", seed: int = 0,
                          max_shard_size: str | None = None, **overrides) -> Path:
    """`save_pretrained` a bare tiny transformer folder (config.json + safetensors)."""
    path = Path(path)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    tiny_model(family, seed, **overrides).save_pretrained(path, **kwargs)
    return path


def read_json(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
