"""Tiny random Wan image-to-video pipelines, built offline: Wan 2.1 I2V's layout (a CLIP vision
encoder and its image processor, a transformer with an image projection and image keys and values,
latents + mask + first-frame latents in) and Wan 2.2 TI2V's (the text-to-video folder, whose image
mode `WanImageToVideoPipeline` runs with `expand_timesteps`).

    save_tiny_wan_i2v_pipeline(path)                      # a WanImageToVideoPipeline folder
    tiny_image(seed)                                      # a 40 x 56 RGB PIL image
"""

from __future__ import annotations

from pathlib import Path

import torch

from slidefusion.testing.tiny import tiny_model, tiny_tokenizer, tiny_umt5, tiny_wan_vae, wan_scheduler

CLIP_WIDTH = 8  # the CLIP vision states' width: the transformer's image_dim
Z = 4  # the tiny Wan VAE's latent channels


def tiny_clip_vision(seed: int = 0):
    """A two-layer CLIP vision tower on 32 x 32 images (patch 8), width CLIP_WIDTH."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    config = CLIPVisionConfig(hidden_size=CLIP_WIDTH, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=CLIP_WIDTH)
    return CLIPVisionModel(config).eval()


def tiny_clip_processor():
    import transformers

    # the PIL one where this transformers has it: the default asks for torchvision
    cls = getattr(transformers, "CLIPImageProcessorPil", None) or transformers.CLIPImageProcessor
    return cls(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def tiny_wan_i2v_pipeline(seed: int = 0):
    """`WanImageToVideoPipeline` of tiny random components in Wan 2.1 I2V's layout: the transformer
    takes Z latent + 4 mask + Z condition channels and CLIP states of width CLIP_WIDTH."""
    from diffusers import WanImageToVideoPipeline

    tokenizer = tiny_tokenizer()
    transformer = tiny_model("wan", seed, in_channels=2 * Z + 4, out_channels=Z, image_dim=CLIP_WIDTH,
                             added_kv_proj_dim=16)
    return WanImageToVideoPipeline(tokenizer=tokenizer, text_encoder=tiny_umt5(len(tokenizer), seed),
                                   vae=tiny_wan_vae(Z, seed=seed), scheduler=wan_scheduler(),
                                   image_processor=tiny_clip_processor(), image_encoder=tiny_clip_vision(seed),
                                   transformer=transformer)


def save_tiny_wan_i2v_pipeline(path: str | Path, seed: int = 0) -> Path:
    path = Path(path)
    tiny_wan_i2v_pipeline(seed).save_pretrained(path)
    return path


def tiny_image(seed: int = 0, size: tuple[int, int] = (40, 56)):
    """A random RGB PIL image of (height, width) `size`."""
    from PIL import Image

    pixels = torch.randint(0, 256, (*size, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())
