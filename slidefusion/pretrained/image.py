"""Image-to-video conditioning, built as the family's own image-to-video pipeline builds it.

The family's record says which pipeline and which mode (`ModelAdapter.image_to_video`); two modes:
  "channels"     Wan 2.1 I2V (the transformer has an image projection, `image_dim`): the image's CLIP
                 vision states (penultimate layer) feed the cross-attention's image keys, and the VAE
                 latents of [image, zero frames] behind a 4-channel mask (1 on the first frame) are
                 stacked beside the noisy latents on every call.
  "first-frame"  Wan 2.2 TI2V (`expand_timesteps`): the image's latents stand in for the first latent
                 frame, whose tokens get timestep 0; the sampled first frame is the condition's.
The image-to-video pipeline's own `encode_image` and `prepare_latents` build both, so a seed samples
what that pipeline samples.

    mode = image_mode(folder)                            # None for a text-to-video model
    image = open_image("first.png")                      # one line for a file that is not an image
    states, video = image_condition(parts, image, noise, frames, height, width)
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from slidefusion.core.errors import UserError, check

MODES = ("channels", "first-frame")


def image_mode(folder, name: str = "transformer") -> str | None:
    """How the folder's transformer takes an image (see the module docstring), or None (text only);
    from its config files alone."""
    adapter = folder.adapter(name)
    if adapter.image_to_video is None:
        return None
    return adapter.image_to_video.mode(folder.transformer_config(name), adapter.options)


def check_image_use(folder, given: bool, what: str = "--image") -> str | None:
    """The folder's image mode, after a one-line UserError for an image given to a text-to-video
    model or none given to an image-to-video one that needs it."""
    mode = image_mode(folder)
    name = folder.transformer_config().get("_class_name")
    check(not given or mode is not None, f"{what}: {folder.root} holds a text-to-video {name}; an image conditions "
                                         "Wan 2.1 I2V folders and Wan 2.2 TI2V folders only")
    check(given or mode != "channels", f"{folder.root} is an image-to-video model (Wan 2.1 I2V): give {what} PATH, "
                                       "the first frame")
    if mode == "channels":
        for component in ("image_encoder", "image_processor"):
            check(component in folder.components(), f"{folder.root} is a Wan 2.1 I2V model without its {component}/; "
                                                    f"valid: a {folder.adapter().image_to_video.pipeline} folder")
    return mode


def open_image(path: str | Path, what: str = "--image"):
    """An RGB PIL image from `path`, or a one-line UserError."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise UserError(f"{what}={path} is not an image this program can read ({reason}); valid: a PNG, JPEG or "
                        "WebP file") from None


def image_pipeline(parts):
    """The family's image-to-video pipeline around the folder's components (no transformer): its own
    code encodes the image and prepares the condition latents."""
    import diffusers

    cls = getattr(diffusers, parts.adapter.image_to_video.pipeline)
    pipe = cls(tokenizer=parts.tokenizer, text_encoder=parts.text_encoder, vae=parts.vae, scheduler=parts.scheduler,
               image_processor=parts.image_processor, image_encoder=parts.image_encoder, transformer=None,
               expand_timesteps=bool(parts.adapter.options["expand_timesteps"]))
    pipe.set_progress_bar_config(disable=True)
    return pipe


@torch.no_grad()
def image_condition(parts, image, noise: Tensor, frames: int, height: int, width: int
                    ) -> tuple[Tensor | None, Tensor]:
    """(CLIP states (B, L, D) or None, latent conditioning: (B, 4 + C, T, H, W) in "channels" mode,
    (B, C, 1, H, W) in "first-frame" mode) of `image` for noise (B, C, T, H, W), float32 on the VAE's
    device, as the image-to-video pipeline's `__call__` builds them for one image."""
    mode = image_mode(parts.folder)
    check(mode is not None, f"{parts.folder.root} takes no image")
    pipe = image_pipeline(parts)
    device = next(parts.vae.parameters()).device
    batch = noise.shape[0]
    states = None
    if mode == "channels":
        states = pipe.encode_image(image, device).float().repeat(batch, 1, 1)
    pixels = pipe.video_processor.preprocess(image, height=height, width=width).to(device, torch.float32)
    prepared = pipe.prepare_latents(pixels, batch, noise.shape[1], height, width, frames, torch.float32, device,
                                    None, noise.to(device))
    return states, prepared[1]


def finish(adapter, latents: Tensor, video: Tensor | None) -> Tensor:
    """The sampled latents as the pipeline returns them: in "first-frame" mode the first latent frame
    is the condition's."""
    if video is None or not adapter.options["expand_timesteps"]:
        return latents
    return torch.cat([video.to(latents), latents[:, :, 1:]], dim=2)
