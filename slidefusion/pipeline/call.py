"""The diffusers-style call shared by our pipelines (`VideoPipeline`, `FolderPipeline`).

    out = pipe("a cat", num_frames=33, height=480, width=832, num_inference_steps=30, guidance_scale=5.0,
               generator=torch.Generator().manual_seed(0), output_type="np")
    out.frames[0]                     # (F, H, W, 3) float in [0, 1], what diffusers' export_to_video takes

`prompt` may be a list; `generator` one generator (one draw for the whole batch, as diffusers'
`randn_tensor`) or one per prompt; `seed=S` is `generator=torch.Generator().manual_seed(S)`;
`parallel=ParallelConfig(...)` runs the call across the ranks of a process group (`pipeline.parallel`);
output_type "np" (B, F, H, W, 3) numpy, "pt" (B, F, 3, H, W) tensor, both in [0, 1], or "latent".
Our older names (`frames`, `steps`, `guidance`) are accepted too. A subclass provides
`sample_latents(prompts, negatives, noise_fn, frames, height, width, steps, guidance, progress, parallel)`,
`decode_batch(latents, parallel)`, `default_sizes()` and `to(device)`; `decode` and `seeded_noise` come with it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from slidefusion.core import validate
from slidefusion.core.errors import NonFiniteError, UserError, check
from slidefusion.io.files import atomic_file

OUTPUT_TYPES = ("np", "pt", "latent")
NoiseFn = Callable[[tuple[int, ...]], Tensor]  # latent shape (B, C, T, H, W) -> initial noise


@dataclass
class VideoPipelineOutput:
    """What a call returns: `frames` as `output_type` says (diffusers' field name)."""

    frames: object


def save_latents(path: str | Path, latents: Tensor) -> Path:
    """Write final latents as safetensors under the key `latents`, atomically (temp + rename)."""
    from safetensors.torch import save_file

    from slidefusion.io.diskfull import writing

    path = Path(path)
    with writing(f"the latents {path.name}", path.absolute().parent, latents.numel() * latents.element_size(),
                 "nothing was changed (the video was not written either)"), atomic_file(path) as tmp:
        save_file({"latents": latents.detach().cpu().contiguous()}, tmp)
    return path


def check_finite(latents: Tensor, guidance: float, steps: int) -> None:
    """A NaN video is never handed on as if it were one."""
    if not torch.isfinite(latents).all():
        raise NonFiniteError(f"sampling produced NaN or infinite latents (guidance={guidance:g}, steps={steps}); "
                             "nothing was written; check the checkpoint's weights or lower the guidance")


# How a path that is not one of our own checkpoints is opened: `FolderPipeline` registers its
# openers here when `slidefusion.pipeline` is imported, so `VideoPipeline.from_pretrained` can hand
# a diffusers folder (or a fine-tune of one) to it without the two modules importing each other.
OPENERS: dict[str, Callable] = {}  # "folder": (path, device) -> pipeline; "fine-tune": (ckpt, config, device)


def opener(kind: str) -> Callable:
    return OPENERS[kind]


def noise_from(generator, seed: int | None, batch: int, draw: Callable) -> NoiseFn:
    """The initial noise: one generator for the whole batch, one per prompt, a seed, or torch's own RNG.
    `draw(shape, generator)` draws in the family's layout."""
    if generator is None and seed is not None:
        generator = torch.Generator().manual_seed(validate.seed(seed, "seed"))
    if isinstance(generator, (list, tuple)):
        check(len(generator) == batch, f"generator: {len(generator)} generators for {batch} prompts; give one per prompt")
        return lambda shape: torch.cat([draw((1, *shape[1:]), g) for g in generator])
    check(generator is None or isinstance(generator, torch.Generator),
          f"generator must be a torch.Generator or a list of them, got {type(generator).__name__}")
    return lambda shape: draw(shape, generator)


def _prompts(prompt, negative_prompt) -> tuple[list[str], list[str]]:
    prompts = [prompt] if isinstance(prompt, str) else list(prompt or [])
    check(prompts and all(isinstance(p, str) and p.strip() for p in prompts),
          "prompt must be a non-empty text or a list of them")
    negatives = negative_prompt if isinstance(negative_prompt, (list, tuple)) else [negative_prompt or ""] * len(prompts)
    check(len(negatives) == len(prompts) and all(isinstance(n, str) for n in negatives),
          f"negative_prompt: {len(negatives)} texts for {len(prompts)} prompts")
    return prompts, list(negatives)


def _frames(video: Tensor, output_type: str):
    """Videos (B, 3, F, H, W) in [-1, 1] -> diffusers' "pt" (B, F, 3, H, W) or "np" (B, F, H, W, 3) in [0, 1]."""
    pt = (video.float().transpose(1, 2) / 2 + 0.5).clamp(0, 1)
    return pt if output_type == "pt" else pt.permute(0, 1, 3, 4, 2).numpy()


class DiffusersCall:
    """`__call__` with diffusers' argument names, over a subclass's `sample_latents` and `decode_batch`."""

    def default_sizes(self) -> dict:
        raise NotImplementedError

    @torch.no_grad()
    def __call__(self, prompt=None, negative_prompt=None, *, num_frames: int | None = None, height: int | None = None,
                 width: int | None = None, num_inference_steps: int | None = None, guidance_scale: float | None = None,
                 generator=None, output_type: str = "np", return_dict: bool = True, seed: int | None = None,
                 frames: int | None = None, steps: int | None = None, guidance: float | None = None,
                 progress: bool = False, parallel=None, image=None):
        """Sample videos; see the module docstring. Returns a `VideoPipelineOutput` (a tuple
        `(frames,)` with return_dict=False, as diffusers). `parallel`: a `ParallelConfig` to run across
        the ranks of the initialised process group (`slidefusion.pipeline.parallel`)."""
        check(output_type in OUTPUT_TYPES, f"output_type={output_type!r} is unknown; valid: {', '.join(OUTPUT_TYPES)}")
        prompts, negatives = _prompts(prompt, negative_prompt)
        sizes = {**self.default_sizes(), **{k: v for k, v in dict(frames=num_frames or frames, height=height,
                                                                   width=width).items() if v is not None}}
        steps = num_inference_steps or steps or sizes.pop("steps", 30)
        scale = guidance_scale if guidance_scale is not None else guidance
        scale = sizes.pop("guidance", 5.0) if scale is None else scale
        sizes.pop("steps", None), sizes.pop("guidance", None)
        validate.finite(scale, "guidance_scale", 0)
        check(isinstance(steps, int) and steps >= 1, f"num_inference_steps={steps!r} must be an int >= 1")
        noise = noise_from(generator, seed, len(prompts), self.draw_noise)
        extra = {} if image is None else {"image": image}  # the first frame of an image-to-video folder
        latents = self.sample_latents(prompts, negatives, noise, steps=steps, guidance=float(scale), progress=progress,
                                      parallel=parallel, **sizes, **extra)
        result = latents if output_type == "latent" else _frames(self.decode_batch(latents, parallel), output_type)
        return VideoPipelineOutput(result) if return_dict else (result,)

    def draw_noise(self, shape: tuple[int, ...], generator: torch.Generator | None) -> Tensor:
        """Initial noise of `shape` (B, C, T, H, W), float32 on the CPU."""
        return torch.randn(shape, generator=generator)

    def seeded_noise(self, prompts: list[str], seeds: list[int]) -> NoiseFn:
        """The noise of `latents_batch`: video i starts from the noise of seed `seeds[i]` alone."""
        check(len(prompts) == len(seeds) and len(prompts) > 0,
              f"prompts ({len(prompts)}) and seeds ({len(seeds)}) must be equally many, at least one")
        generators = [torch.Generator().manual_seed(validate.seed(s, "seed")) for s in seeds]
        return noise_from(generators, None, len(seeds), self.draw_noise)

    @torch.no_grad()
    def decode(self, latents: Tensor, parallel=None) -> Tensor:
        """Latents (1, C, T', H', W') -> the video (3, F, H, W) in [-1, 1], on the CPU (`parallel`: split
        over the ranks where the autoencoder allows it)."""
        return self.decode_batch(latents, parallel)[0]


def refuse_existing(path: str | Path, force: bool) -> Path:
    """`save_pretrained`'s destination: a new path, or an existing folder with `force`."""
    path = Path(path)
    if path.exists() and not (force and path.is_dir()):
        raise UserError(f"save_pretrained: {path} already exists; pass force=True to replace a folder, or a new path")
    return path
