"""Text-to-video with our own models: text encoder -> flow sampler -> autoencoder decode.

    pipe = VideoPipeline.from_pretrained(None)        # the bundled model (or a checkpoint, export, run
    video = pipe.latents(prompt, seed=3)              # folder, or a diffusers folder: a FolderPipeline)
    out = pipe(prompt, num_inference_steps=30, generator=torch.Generator().manual_seed(3))  # diffusers' call
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch
from torch import Tensor

from slidefusion import memory, validate
from slidefusion.diffusion import sample
from slidefusion.errors import UserError
from slidefusion.io.checkpoint import first_nonfinite, load_checkpoint, write_checkpoint
from slidefusion.io.diffusers import is_pipeline_folder
from slidefusion.models import VideoDiT, build_model, preset
from slidefusion.pipeline.call import DiffusersCall, NoiseFn, check_finite, opener, refuse_existing
from slidefusion.pipeline.parallel import maybe_parallel
from slidefusion.run_config import SamplingConfig
from slidefusion.text import TextEncoder, build_text_encoder
from slidefusion.vae import Autoencoder, build_autoencoder, check_decoded

DEFAULT_PROMPT = "a red circle moving right quickly on a black background"
LEGACY_OPTIONS = {"frames", "height", "width", "steps", "guidance", "seed", "negative_prompt", "progress"}


def _load_weights(model: VideoDiT, weights: dict[str, Tensor], source: Path) -> None:
    """Load every weight, or one line saying how the checkpoint's weights and config disagree."""
    own = model.state_dict()
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    shapes = [k for k in own if k in weights and weights[k].shape != own[k].shape]
    if missing or unexpected or shapes:
        first = (missing or unexpected or shapes)[0]
        raise UserError(f"checkpoint {source}: its weights do not fit the model its config.json describes "
                        f"({len(missing)} missing, {len(unexpected)} unexpected, {len(shapes)} of another shape; "
                        f"first: {first}); was model.safetensors copied from another run?")
    bad = first_nonfinite(weights)
    if bad is not None:
        raise UserError(f"checkpoint {source}: weight {bad} holds NaN or infinity; sample from an earlier checkpoint")
    model.load_state_dict({k: v.float() for k, v in weights.items()})


def bundled_checkpoint() -> Path:
    """The small moving-shapes model that ships inside the package."""
    return Path(str(resources.files("slidefusion") / "assets" / "shapes-small"))


@dataclass
class VideoPipeline(DiffusersCall):
    model: VideoDiT
    text_encoder: TextEncoder
    autoencoder: Autoencoder
    config: SamplingConfig  # (a TrainConfig is one too)
    device: torch.device

    @classmethod
    def from_pretrained(cls, path: str | Path | None = None, device: str = "cpu"):
        """A diffusers pipeline folder (a `FolderPipeline`), or one of ours: a checkpoint, an export
        or a run folder (its latest); None is the bundled model."""
        if path is not None and is_pipeline_folder(path):
            return opener("folder")(path, device=device)
        return cls.from_checkpoint(path, device=device)

    @classmethod
    def from_checkpoint(cls, path: str | Path | None = None, device: str = "cpu"):
        """Load a checkpoint folder (a run folder means its latest); None means the bundled model. A
        checkpoint of a diffusers fine-tune gives a `FolderPipeline` with the fine-tuned weights."""
        ckpt = load_checkpoint(path or bundled_checkpoint())
        config = SamplingConfig.of_checkpoint(ckpt)
        if config.pretrained:
            return opener("fine-tune")(ckpt, config, device=device)
        device = validate.device(device, "device")
        memory.check_fits({"weights": memory.parameter_count(config.model) * memory.FP32}, device,
                          f"the model of {ckpt.path}", "use a machine with more memory")
        model = build_model(config.model, device)
        _load_weights(model, ckpt.sampling_weights, ckpt.path)
        return cls.assemble(model, config, device)

    @classmethod
    def from_preset(cls, name: str, seed: int = 0, device: str = "cpu") -> VideoPipeline:
        """An untrained model with every weight random (zero-initialised layers included), so its
        output depends on every layer: for tests and benchmarks that need no checkpoint."""
        config = SamplingConfig(model=preset(name))
        device = validate.device(device, "device")
        memory.check_fits({"weights": memory.parameter_count(config.model) * memory.FP32}, device,
                          f"model preset {name}", "choose a smaller --model")
        torch.manual_seed(validate.seed(seed, "seed"))
        model = build_model(config.model, device)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.02 * torch.randn_like(param))
        return cls.assemble(model, config, device)

    @classmethod
    def assemble(cls, model: VideoDiT, config: SamplingConfig, device: torch.device) -> VideoPipeline:
        encoder = build_text_encoder(config.text_encoder, config.text_max_length, width=config.model.text_dim)
        return cls(model.eval(), encoder, build_autoencoder(config.autoencoder).to(device), config, device)

    def save_pretrained(self, path: str | Path, force: bool = False) -> Path:
        """Write config.json + model.safetensors (what `from_pretrained` and `generate --checkpoint` read)."""
        return write_checkpoint(refuse_existing(path, force), self.config.to_dict(), self.model)

    def to(self, device) -> VideoPipeline:
        """Move the model and the autoencoder (the text encoder is shared and stays); returns self."""
        self.device = validate.device(str(device), "device")
        self.model.to(self.device)
        self.autoencoder.to(self.device)
        return self

    @property
    def fps(self) -> int:
        return self.config.data.fps

    @torch.no_grad()
    def __call__(self, prompt=None, *args, **options):
        """diffusers' call (see `slidefusion.pipeline.call`): a `VideoPipelineOutput`. Called with a
        single prompt and only this class's older options (`frames`, `height`, `width`, `steps`,
        `guidance`, `seed`, `negative_prompt`, `progress`), it returns what it always did: the video
        (3, T, H, W) in [-1, 1]."""
        if isinstance(prompt, str) and not args and set(options) <= LEGACY_OPTIONS:
            return self.decode(self.latents(prompt, **options))
        return super().__call__(prompt, *args, **options)

    def default_sizes(self) -> dict:
        data = self.config.data
        return dict(frames=data.frames, height=data.height, width=data.width, steps=30, guidance=4.0)

    @torch.no_grad()
    def decode_batch(self, latents: Tensor, parallel=None) -> Tensor:
        """Latents (B, C, T', H', W') -> videos (B, 3, T, H, W) in [-1, 1], on the CPU. Every rank
        decodes alike under `parallel` (our autoencoders are cheap next to sampling)."""
        return check_decoded(self.autoencoder.decode(latents)).clamp(-1, 1).cpu()

    @torch.no_grad()
    def latents(self, prompt: str, *, frames: int | None = None, height: int | None = None, width: int | None = None,
                steps: int = 30, guidance: float = 4.0, seed: int = 0, negative_prompt: str = "",
                progress: bool = True, parallel=None, tracer=None) -> Tensor:
        """Final latents (1, C, T', H', W'); sizes in pixels default to those the model was trained on.
        `parallel`: a `ParallelConfig` (every rank of the process group calls alike and gets the same
        latents); `tracer` records its compute and transfers."""
        return self.latents_batch([prompt], [seed], frames=frames, height=height, width=width, steps=steps,
                                  guidance=guidance, negative_prompt=negative_prompt, progress=progress,
                                  parallel=parallel, tracer=tracer)

    @torch.no_grad()
    def latents_batch(self, prompts: list[str], seeds: list[int], *, frames: int | None = None,
                      height: int | None = None, width: int | None = None, steps: int = 30, guidance: float = 4.0,
                      negative_prompt: str = "", progress: bool = False, parallel=None, tracer=None) -> Tensor:
        """Latents (B, C, T', H', W') of several prompts sampled together. Video i starts from the
        noise of seed `seeds[i]` alone, as `latents(prompts[i], seed=seeds[i])` does, so batching
        changes only rounding."""
        noise = self.seeded_noise(prompts, seeds)
        data = self.config.data
        return self.sample_latents(list(prompts), [negative_prompt] * len(prompts), noise, frames=frames or data.frames,
                                   height=height or data.height, width=width or data.width, steps=steps,
                                   guidance=guidance, progress=progress, parallel=parallel, tracer=tracer)

    @torch.no_grad()
    def sample_latents(self, prompts: list[str], negatives: list[str], noise: NoiseFn, *, frames: int, height: int,
                       width: int, steps: int, guidance: float, progress: bool = False, parallel=None,
                       tracer=None) -> Tensor:
        """Latents (B, C, T', H', W') from `noise(shape)`; the rectified-flow Euler sampler with CFG,
        across the ranks under `parallel`."""
        if any(not p.strip() for p in prompts):
            raise UserError("prompt must be a non-empty text")
        validate.finite(guidance, "guidance", 0)
        pixels = (frames, height, width)
        latent = self.autoencoder.latent_shape(*pixels)
        self.model.token_grid((1, *latent))  # a size the patch does not divide fails here, by name
        params = sum(p.numel() for p in self.model.parameters())
        memory.check_fits(memory.sampling_parts(self.config.model, latent, pixels, len(prompts), params), self.device,
                          f"sampling {len(prompts)} x {pixels[0]} frames of {pixels[2]}x{pixels[1]}",
                          "use fewer frames, a smaller size or a smaller batch")
        initial = noise((len(prompts), *latent))
        cond = self.text_encoder.encode(list(prompts))
        uncond = self.text_encoder.encode(list(negatives))
        with maybe_parallel([self.model], parallel, tuple(initial.shape), guidance, tracer):
            latents = sample(self.model, tuple(initial.shape), cond, uncond, steps=steps, guidance=guidance,
                             device=self.device, progress=progress, noise=initial)
        check_finite(latents, guidance, steps)
        return latents

