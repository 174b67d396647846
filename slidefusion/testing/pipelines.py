"""Tiny random diffusers *pipelines* of every supported family, built offline and saved as folders.

`tiny_pipeline(family)` gives the family's own diffusers pipeline class around the tiny transformer
of `slidefusion.testing.tiny.TINY`, a word-level tokenizer, a one-layer text encoder of the class
the released checkpoints ship (UMT5 for Wan, T5 for CogVideoX / LTX / Mochi / Latte, Llama + CLIP
for HunyuanVideo), a tiny VAE of the family's class and the scheduler its released folders name.
`save_tiny_pipeline(path, family)` writes it with `save_pretrained`, so `<Pipeline>.from_pretrained`
and slidefusion's loaders read it exactly as they read a released folder.

The pixel sizes each VAE allows are in `PIXELS` (frames, height, width): the smallest video whose
latents fit the tiny transformer, with the family's frame rule (Wan, CogVideoX, LTX, Hunyuan: 1 + 4k;
Mochi: 1 + 6k; Latte: the transformer's video_length, no temporal compression).
"""

from __future__ import annotations

from pathlib import Path

import torch

from slidefusion.testing.tiny import TEXT_DIM, tiny_model, tiny_tokenizer, tiny_wan_pipeline

FAMILIES = ("wan", "cogvideox", "hunyuanvideo", "ltx", "mochi", "latte")
PIXELS = {"wan": (5, 48, 80), "cogvideox": (9, 32, 48), "hunyuanvideo": (5, 32, 48), "ltx": (5, 32, 64),
          "mochi": (7, 32, 48), "latte": (3, 16, 16)}


def tiny_t5(vocab_size: int, seed: int = 0, width: int = TEXT_DIM):
    """A one-layer T5 encoder of `width`."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(vocab_size=vocab_size, d_model=width, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16, pad_token_id=0,
                      eos_token_id=1, decoder_start_token_id=0)
    return T5EncoderModel(config).eval()


def tiny_llama(vocab_size: int, seed: int = 0):
    """A three-layer Llama (HunyuanVideo reads the third state from the end) of width TEXT_DIM."""
    from transformers import LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512, pad_token_id=0,
                         bos_token_id=2, eos_token_id=1)
    return LlamaModel(config).eval()


def tiny_clip(vocab_size: int, width: int, seed: int = 0):
    """A one-layer CLIP text model whose pooled output has `width` (the transformer's pooled_projection_dim)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    config = CLIPTextConfig(vocab_size=vocab_size, hidden_size=width, intermediate_size=16, num_hidden_layers=1,
                            num_attention_heads=2, max_position_embeddings=77, pad_token_id=0, bos_token_id=2,
                            eos_token_id=1)
    return CLIPTextModel(config).eval()


def _vae(family: str, channels: int, seed: int):
    import diffusers

    torch.manual_seed(seed)
    if family == "cogvideox":
        return diffusers.AutoencoderKLCogVideoX(block_out_channels=(8, 8, 8, 8), latent_channels=channels,
                                                layers_per_block=1, norm_num_groups=2, temporal_compression_ratio=4)
    if family == "hunyuanvideo":
        return diffusers.AutoencoderKLHunyuanVideo(block_out_channels=(8, 8, 8, 8), latent_channels=channels,
                                                   layers_per_block=1, norm_num_groups=4)
    if family == "ltx":
        return diffusers.AutoencoderKLLTXVideo(
            latent_channels=channels, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
            spatio_temporal_scaling=(True, True, False, False), decoder_spatio_temporal_scaling=(True, True, False, False),
            decoder_inject_noise=(False,) * 5, upsample_residual=(False,) * 4, upsample_factor=(1, 1, 1, 1),
            timestep_conditioning=False, patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False)
    if family == "mochi":
        return diffusers.AutoencoderKLMochi(
            latent_channels=channels, encoder_block_out_channels=(32, 32, 32, 32), decoder_block_out_channels=(32, 32, 32, 32),
            layers_per_block=(1, 1, 1, 1, 1), add_attention_block=(False,) * 5, latents_mean=(0.1,) * channels,
            latents_std=(0.9,) * channels)
    assert family == "latte", family
    return diffusers.AutoencoderKL(block_out_channels=(8, 8), down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, latent_channels=channels,
                                   norm_num_groups=2, sample_size=16)


def _scheduler(family: str):
    """The scheduler class and settings the family's released pipeline folders ship."""
    import diffusers

    if family == "cogvideox":  # THUDM/CogVideoX-2b
        return diffusers.CogVideoXDDIMScheduler(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
                                                clip_sample=False, prediction_type="v_prediction",
                                                rescale_betas_zero_snr=True, snr_shift_scale=3.0,
                                                timestep_spacing="trailing", set_alpha_to_one=True)
    if family == "hunyuanvideo":
        return diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0)
    if family == "ltx":  # dynamic shifting on the video's token count
        return diffusers.FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05,
                                                         base_image_seq_len=1024, max_image_seq_len=4096,
                                                         shift_terminal=0.1)
    if family == "mochi":
        return diffusers.FlowMatchEulerDiscreteScheduler(invert_sigmas=True)
    assert family == "latte", family  # maxin-cn/Latte-1: DDIM on the linear DDPM betas
    return diffusers.DDIMScheduler(beta_schedule="linear", beta_start=0.0001, beta_end=0.02, clip_sample=False)


def tiny_pipeline(family: str = "wan", seed: int = 0):
    """The family's diffusers pipeline of tiny random components (see the module docstring)."""
    import diffusers

    if family == "wan":
        return tiny_wan_pipeline("2.1", seed)
    check_family(family)
    tokenizer = tiny_tokenizer(max_length=512)
    # MochiPipeline decodes with 12 latent channels whatever its VAE says, as the released VAE has
    transformer = tiny_model(family, seed, **({"in_channels": 12} if family == "mochi" else {}))
    vae = _vae(family, transformer.config.in_channels, seed)
    parts = dict(tokenizer=tokenizer, vae=vae, transformer=transformer, scheduler=_scheduler(family))
    if family == "hunyuanvideo":
        clip = tiny_clip(len(tokenizer), transformer.config.pooled_projection_dim, seed)
        return diffusers.HunyuanVideoPipeline(text_encoder=tiny_llama(len(tokenizer), seed), text_encoder_2=clip,
                                              tokenizer_2=tiny_tokenizer(max_length=77), **parts)
    cls = {"cogvideox": diffusers.CogVideoXPipeline, "ltx": diffusers.LTXPipeline, "mochi": diffusers.MochiPipeline,
           "latte": diffusers.LattePipeline}[family]
    return cls(text_encoder=tiny_t5(len(tokenizer), seed), **parts)


def check_family(family: str) -> None:
    assert family in FAMILIES, f"{family!r}: valid {FAMILIES}"


def save_tiny_pipeline(path: str | Path, family: str = "wan", seed: int = 0) -> Path:
    """`save_pretrained` the family's tiny pipeline into `path` (created)."""
    path = Path(path)
    tiny_pipeline(family, seed).save_pretrained(path)
    return path
