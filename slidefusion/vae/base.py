"""Video autoencoders behind one small interface: pixels (B, 3, T, H, W) <-> latents (B, C, T', H', W').

The DiT only ever sees latents that are already normalised for diffusion (roughly zero mean, unit
variance per channel), so the scaling conventions of each VAE family stay inside its adapter.

Time is compressed causally, as in every current video VAE (Wan, HunyuanVideo, CogVideoX, LTX):
the first frame gets a latent frame of its own and every further `temporal_factor` frames share one,
so T' = 1 + (T - 1) / temporal_factor, and T must be 1 more than a multiple of the factor.
"""

from __future__ import annotations

import math
import warnings
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from slidefusion.errors import UserError, check

_VALID_VAES = "valid: 'identity' or a local diffusers video VAE folder (a VAE saved with save_pretrained)"


def check_decoded(video: Tensor) -> Tensor:
    """`video` (decoded pixels), or NonFiniteError: finite latents can still decode to NaN (a damaged
    VAE weight), and a NaN pixel would be written as mid-grey, a video that looks like a result."""
    from slidefusion.core.errors import NonFiniteError

    if not torch.isfinite(video).all():
        raise NonFiniteError("decoding produced NaN or infinite pixels although the latents were finite; nothing "
                             "was written; the VAE's weights are damaged (fetch vae/ again)")
    return video


class Autoencoder(nn.Module, ABC):
    """Interface. Attributes: latent_channels C, temporal_factor, spatial_factor (pixels per latent)."""

    latent_channels: int
    temporal_factor: int
    spatial_factor: int

    @abstractmethod
    def encode(self, video: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Video (B, 3, T, H, W) float in [-1, 1] -> normalised latents (B, C, T', H', W') float32.

        With a `generator`, a stochastic autoencoder samples its posterior; otherwise it is deterministic.
        """

    @abstractmethod
    def decode(self, latents: Tensor) -> Tensor:
        """Normalised latents (B, C, T', H', W') -> video (B, 3, T, H, W) float32 clamped to [-1, 1]."""

    def latent_shape(self, frames: int, height: int, width: int) -> tuple[int, int, int, int]:
        """(C, T', H', W') for a `frames` x `height` x `width` video; UserError if it does not fit."""
        tf, sf = self.temporal_factor, self.spatial_factor
        for key, value in (("frames", frames), ("height", height), ("width", width)):
            check(isinstance(value, int) and value >= 1, f"{key}={value!r} is invalid; valid: a positive int")
        check((frames - 1) % tf == 0,
              f"frames={frames} does not fit temporal factor {tf}; "
              f"valid: 1 + {tf}k, e.g. {1 + tf}, {1 + 2 * tf}")
        for key, value in (("height", height), ("width", width)):
            check(value % sf == 0, f"{key}={value} is not a multiple of the spatial factor; "
                                   f"valid: multiples of {sf}, e.g. {sf * 4}, {sf * 8}")
        return self.latent_channels, 1 + (frames - 1) // tf, height // sf, width // sf

    def check_video(self, video: Tensor) -> tuple[int, int, int, int]:
        """Validate a (B, 3, T, H, W) video against this autoencoder; returns its `latent_shape`."""
        check(video.ndim == 5 and video.shape[1] == 3,
              f"video shape {tuple(video.shape)} is invalid; valid: (B, 3, T, H, W)")
        return self.latent_shape(*(int(s) for s in video.shape[2:]))

    def train(self, mode: bool = True) -> Autoencoder:
        """Stay in eval mode: the autoencoder is frozen, whatever a parent module's mode is."""
        return super().train(False)


class IdentityAutoencoder(Autoencoder):
    """Pixel-space diffusion: latents are the pixels themselves (C = 3, no compression)."""

    latent_channels, temporal_factor, spatial_factor = 3, 1, 1

    def encode(self, video: Tensor, generator: torch.Generator | None = None) -> Tensor:
        self.check_video(video)
        return video.float()

    def decode(self, latents: Tensor) -> Tensor:
        return latents.float().clamp(-1.0, 1.0)


class DiffusersVideoAutoencoder(Autoencoder):
    """Adapter around a diffusers video VAE whose `encode(x).latent_dist` is a diagonal Gaussian.

    Normalisation: z_norm = (z - shift) * scale, per channel. Wan configs carry per-channel
    `latents_mean`/`latents_std` (shift = mean, scale = 1 / std); other families carry one
    `scaling_factor` (and maybe `shift_factor`). The VAE is frozen; encode/decode build no graph.
    """

    def __init__(self, vae: nn.Module, temporal_factor: int | None = None, spatial_factor: int | None = None):
        super().__init__()
        self.vae = vae.requires_grad_(False)
        self.eval()
        config = vae.config
        self.latent_channels = int(config.get("z_dim") or config["latent_channels"])
        self.image = is_image_vae(vae)  # a 2-D VAE (Latte's): each frame on its own, no temporal compression
        derived_t, derived_s = vae_factors(vae)
        self.temporal_factor = int(temporal_factor or derived_t or 0)
        self.spatial_factor = int(spatial_factor or derived_s or 0)
        check(self.temporal_factor >= 1 and self.spatial_factor >= 1,
              f"vae {type(vae).__name__}: compression factors unknown from its config; "
              "valid: pass temporal_factor= and spatial_factor=")
        shift, scale = latent_normalisation(config, self.latent_channels, vae)
        self.register_buffer("latent_shift", shift.view(1, -1, 1, 1, 1), persistent=False)  # (1, C, 1, 1, 1)
        self.register_buffer("latent_scale", scale.view(1, -1, 1, 1, 1), persistent=False)  # (1, C, 1, 1, 1)

    @classmethod
    def from_pretrained(cls, path: str | Path, subfolder: str | None = None) -> DiffusersVideoAutoencoder:
        """Load a diffusers VAE from disk only (config.json names its class); UserError if it is not there."""
        from diffusers import AutoModel

        try:
            with warnings.catch_warnings():  # huggingface_hub's deprecation notice is noise before our error
                warnings.filterwarnings("ignore", message=".*local_dir_use_symlinks.*")
                vae = AutoModel.from_pretrained(str(path), subfolder=subfolder, local_files_only=True)
        except (OSError, ValueError) as err:  # diffusers reports "not on disk" as either
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise UserError(f"vae={path} is not available offline: {reason}; {_VALID_VAES}") from None
        check(hasattr(vae, "encode") and hasattr(vae, "decode") and hasattr(vae, "config"),
              f"vae={path} loads a {type(vae).__name__}, not an autoencoder; {_VALID_VAES}")
        return cls(vae)

    @torch.no_grad()
    def encode(self, video: Tensor, generator: torch.Generator | None = None) -> Tensor:
        self.check_video(video)
        param = next(self.vae.parameters())
        x = video.to(param.device, param.dtype)
        posterior = self.vae.encode(_frames(x) if self.image else x).latent_dist
        # (B, C, T', H', W') (image VAEs: (B T, C, H', W')), before normalisation
        z = posterior.mean if generator is None else posterior.sample(generator=generator)
        z = _unframes(z, video.shape[0]) if self.image else z
        return (z.float() - self.latent_shift) * self.latent_scale

    @torch.no_grad()
    def decode(self, latents: Tensor) -> Tensor:
        check(latents.ndim == 5 and latents.shape[1] == self.latent_channels,
              f"latents shape {tuple(latents.shape)} is invalid; "
              f"valid: (B, {self.latent_channels}, T', H', W')")
        return self.decode_raw(self.denormalise(latents)).float().clamp(-1.0, 1.0)

    def denormalise(self, latents: Tensor) -> Tensor:
        """Normalised latents -> the VAE's own latents, in the VAE's dtype (what its pipeline decodes)."""
        param = next(self.vae.parameters())
        return (latents.float() / self.latent_scale + self.latent_shift).to(param.dtype)

    def decode_raw(self, z: Tensor) -> Tensor:
        """The VAE's own latents (B, C, T', H', W') -> its video output (B, 3, T, H, W), as its pipeline
        calls the decoder (LTX's timestep-conditioned decoder at timestep 0, LTXPipeline's default)."""
        if self.image:
            return _unframes(self.vae.decode(_frames(z)).sample, z.shape[0])
        if self.vae.config.get("timestep_conditioning"):
            return self.vae.decode(z, torch.zeros(z.shape[0], device=z.device, dtype=z.dtype)).sample
        return self.vae.decode(z).sample  # (B, 3, T, H, W)


def is_image_vae(vae) -> bool:
    """A 2-D image VAE that a family's pipeline runs frame by frame (`VaeFacts.image`)."""
    return is_image_vae_class(type(vae).__name__)


def is_image_vae_class(name: str) -> bool:
    from slidefusion.families import vae_facts

    return vae_facts(name)[0]


def _frames(x: Tensor) -> Tensor:
    """(B, C, T, H, W) -> (B T, C, H, W)."""
    return x.transpose(1, 2).flatten(0, 1)


def _unframes(x: Tensor, batch: int) -> Tensor:
    """(B T, C, H, W) -> (B, C, T, H, W)."""
    return x.unflatten(0, (batch, -1)).transpose(1, 2)


def vae_factors(vae) -> tuple[int | None, int | None]:
    """(temporal, spatial) compression of a loaded diffusers VAE: image VAEs compress no time."""
    temporal, spatial = video_vae_factors(vae.config)
    return (1 if is_image_vae(vae) else temporal), spatial


def video_vae_factors(config: Mapping) -> tuple[int | None, int | None]:
    """(temporal, spatial) compression read from a diffusers video VAE config; None where unknown.

    For Wan the architecture fields win over `scale_factor_*`: those are constructor defaults
    (4, 8) that a custom or tiny config does not update, while the layers do what `dim_mult` says.
    """
    if config.get("dim_mult") and config.get("temperal_downsample") is not None:  # Wan 2.1 / 2.2
        levels = len(config["dim_mult"]) - 1  # the last level never downsamples
        temporal = 2 ** sum(bool(t) for t in config["temperal_downsample"][:levels])
        return temporal, 2**levels * (config.get("patch_size") or 1)
    temporal = config.get("scale_factor_temporal") or config.get("temporal_compression_ratio")
    spatial = config.get("scale_factor_spatial") or config.get("spatial_compression_ratio")
    if config.get("spatio_temporal_scaling") is not None:  # LTX: a 2x in time and space per scaling level
        levels = 2 ** sum(bool(s) for s in config["spatio_temporal_scaling"])
        temporal = temporal or (config.get("patch_size_t") or 1) * levels
        spatial = spatial or (config.get("patch_size") or 1) * levels
    if config.get("temporal_expansions") is not None:  # Mochi: the product of its expansions
        temporal = temporal or math.prod(config["temporal_expansions"])
        spatial = spatial or math.prod(config["spatial_expansions"])
    if spatial is None and config.get("block_out_channels"):  # CogVideoX, AutoencoderKL: one 2x per extra level
        spatial = 2 ** (len(config["block_out_channels"]) - 1)
    return temporal and int(temporal), spatial and int(spatial)


def latent_normalisation(config: Mapping, channels: int, vae: nn.Module | None = None) -> tuple[Tensor, Tensor]:
    """Per-channel (shift, scale) float32 (C,) such that z_norm = (z - shift) * scale.

    Every family's pipeline uses z_norm = (z - mean) * scaling_factor / std: per-channel mean and std
    from the config (Wan, Mochi) or from the VAE's buffers (LTX), else the config's shift_factor and
    1, and scaling_factor (default 1)."""
    mean, std = config.get("latents_mean"), config.get("latents_std")
    buffers = {} if vae is None else dict(vae.named_buffers(recurse=False))
    if mean is None and "latents_mean" in buffers:  # LTX keeps them as buffers
        mean, std = buffers["latents_mean"].tolist(), buffers["latents_std"].tolist()
    scaling = float(config.get("scaling_factor") or 1.0)
    if mean is not None and std is not None:
        check(len(mean) == channels and len(std) == channels,
              f"vae config latents_mean/latents_std have {len(mean)}/{len(std)} entries; "
              f"valid: one per latent channel ({channels})")
        return torch.tensor(mean, dtype=torch.float32), scaling / torch.tensor(std, dtype=torch.float32)
    # A config with neither convention is taken as already normalised (scale 1, shift 0).
    shift = float(config.get("shift_factor") or 0.0)
    return torch.full((channels,), shift), torch.full((channels,), scaling)


def build_autoencoder(name: str) -> Autoencoder:
    """'identity', or a local diffusers VAE folder (a pipeline folder with a vae/ subfolder works too)."""
    check(isinstance(name, str) and name.strip() != "", f"vae={name!r} is invalid; {_VALID_VAES}")
    if name.strip().lower() == "identity":
        return IdentityAutoencoder()
    from slidefusion.io.diffusers import model_dir

    path = Path(name).expanduser()
    return DiffusersVideoAutoencoder.from_pretrained(model_dir(path, "vae") or (path if path.exists() else name))
