"""Sampling a pipeline folder with its own scheduler: the one loop single-process generation
(`slidefusion generate --pretrained`, `VideoPipeline.from_pretrained`) and the parallel engine
(`generate --pretrained --parallel`, which parallelizes the transformers in place first) both run.

    parts = PretrainedParts.load(folder)
    latents = sample_latents(parts, Request("a cat", frames=33, height=480, width=832, seed=0))
    video = decode(parts, latents)                     # (B, 3, F, H, W) in [-1, 1]

What differs between families is on the family's record: how the pipeline sets its timesteps
(`timesteps`), whether guidance is classifier-free or embedded (`guidance`), and the layout its
initial noise is drawn in (`input_layout`: CogVideoX draws frames first), so that a seed gives the
pipeline's own noise and the same latents as `<Pipeline>(..., generator=torch.manual_seed(seed))`.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from slidefusion.core import hooks
from slidefusion.core.errors import check
from slidefusion.families import ModelAdapter, TextConditioning
from slidefusion.pretrained.prompts import encode_prompts


@dataclass(frozen=True)
class Request:
    """What to generate: sizes in pixels, sampling steps, guidance scale (1 = none), seed."""

    prompt: str
    frames: int = 5
    height: int = 48
    width: int = 80
    steps: int = 30
    guidance: float = 5.0
    seed: int = 0
    negative_prompt: str = ""

    def __post_init__(self):
        check(bool(self.prompt.strip()), "prompt must be a non-empty text")
        check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        check(self.guidance >= 0, f"guidance={self.guidance} must be >= 0 (1 = no guidance)")


def latent_shape(adapter: ModelAdapter, model: nn.Module, vae_config, frames: int, height: int,
                 width: int, vae_class: str | None = None) -> tuple[int, ...]:
    """(1, C, T, H, W) latents of `model` (meta is enough) for a video of `frames` x `height` x `width`
    pixels through a VAE of `vae_config` (a mapping or its attributes), or a UserError naming the rule."""
    from slidefusion.vae.base import is_image_vae_class, video_vae_factors

    config = vae_config if hasattr(vae_config, "get") else vars(vae_config)
    vae_class = vae_class or config.get("_class_name")
    time, space = video_vae_factors(config)
    time = 1 if is_image_vae_class(vae_class) else int(time or 1)
    check(space is not None, f"the VAE's config ({vae_class}) does not say its spatial compression")
    check(frames >= 1 and (frames - 1) % time == 0,
          f"frames={frames} is not allowed by this VAE; valid: 1 + {time}k (e.g. {1 + time}, {1 + 2 * time})")
    check(height % space == 0 and width % space == 0,
          f"height={height} and width={width} must be multiples of the VAE's {space}-pixel latent cell")
    shape = (1, adapter.latent_channels(model), (frames - 1) // time + 1, height // space, width // space)
    adapter.token_grid(model, shape)  # the patch and the family's rules, by name
    return shape


def check_generation(folder, frames: int, height: int, width: int) -> tuple[int, ...]:
    """`latent_shape` for a pipeline folder from its config files and shard headers alone (no weights
    are read), for every transformer it holds: bad sizes and missing shards fail in a second, before
    minutes of loading."""
    from slidefusion.pretrained.build import build_on_meta
    from slidefusion.pretrained.folder import PretrainedFolder, open_folder, read_json
    from slidefusion.pretrained.parts import require_pipeline

    folder = folder if isinstance(folder, PretrainedFolder) else open_folder(folder)
    require_pipeline(folder, "generating")
    vae = read_json(folder.component_dir("vae") / "config.json", "VAE config")
    for expert in folder.experts():
        folder.weight_entries(expert.name)
    shapes = {latent_shape(folder.adapter(e.name), build_on_meta(folder, e.name), vae, frames, height, width)
              for e in folder.experts()}
    return shapes.pop()


def parts_latent_shape(parts, request: Request) -> tuple[int, ...]:
    return latent_shape(parts.adapter, parts.transformer, parts.vae.config, request.frames, request.height,
                        request.width, type(parts.vae).__name__)


def initial_noise(adapter: ModelAdapter, shape: tuple[int, ...], generator: torch.Generator) -> Tensor:
    """The pipeline's initial noise (B, C, T, H, W) float32, drawn in the layout its pipeline draws
    it in (CogVideoX: frames first), so that one generator gives the pipeline's own noise."""
    if adapter.input_layout == "BTCHW":
        b, c, t, h, w = shape
        return torch.randn((b, t, c, h, w), generator=generator).transpose(1, 2).contiguous()
    return torch.randn(shape, generator=generator)


def set_schedule(adapter: ModelAdapter, scheduler, steps: int, shape: tuple[int, ...]) -> None:
    """Set the scheduler's timesteps as the family's pipeline does (`adapter.timesteps`)."""
    adapter.timesteps(scheduler, steps, shape)


def _join(cond: TextConditioning, uncond: TextConditioning) -> TextConditioning:
    """One CFG batch [cond, uncond]; the shorter states are zero-padded (masked) to the longer."""
    length = max(cond.states.shape[1], uncond.states.shape[1])

    def pad(x: Tensor) -> Tensor:
        return torch.nn.functional.pad(x, (0, 0, 0, length - x.shape[1])) if x.ndim == 3 else \
            torch.nn.functional.pad(x, (0, length - x.shape[1]))

    both = (lambda a, b: None if a is None else torch.cat([a, b]))  # noqa: E731
    return TextConditioning(torch.cat([pad(cond.states), pad(uncond.states)]),
                            torch.cat([pad(cond.bool_mask()), pad(uncond.bool_mask())]),
                            both(cond.pooled, uncond.pooled), cond.guidance, both(cond.image, uncond.image),
                            both(cond.video, uncond.video))


def _to(text: TextConditioning, dtype: torch.dtype, device) -> TextConditioning:
    cast = (lambda x: None if x is None else x.to(device=device, dtype=dtype))
    return TextConditioning(cast(text.states), None if text.mask is None else text.mask.to(device), cast(text.pooled),
                            text.guidance, cast(text.image), cast(text.video))


@torch.no_grad()
def denoise(parts, noise: Tensor, cond: TextConditioning, uncond: TextConditioning | None, steps: int,
            guidance: float, progress: bool = False) -> Tensor:
    """The family's denoising loop: latents (B, C, T, H, W) float32 from `noise` (1 = no guidance).

    Where the family's record has one (`ModelAdapter.sample`), the family's own diffusers pipeline
    runs it, with `output_type="latent"`: the pipeline calls the transformer, so hooks on it (a
    parallel plan, the slide swap) run unchanged. `denoise_loop` runs it where the pipeline cannot
    take the call: see `_pipeline_takes` and the families' own refusals (CFG-parallel on a pipeline
    that predicts conditional and unconditional apart, sizes its checks refuse)."""
    sample = parts.adapter.sample
    if sample is not None and _pipeline_takes(cond, uncond, guidance):
        latents = sample(parts, noise, cond, uncond, steps, guidance, progress, cfg_batch=_cfg_batch(parts))
        if latents is not None:
            return latents
    return denoise_loop(parts, noise, cond, uncond, steps, guidance, progress)


def _pipeline_takes(cond: TextConditioning, uncond: TextConditioning | None, guidance: float) -> bool:
    """The pipelines treat a guidance scale below 1 as no guidance, where this loop blends towards
    the unconditional prediction; and their text-to-video calls take no image (states or latents)."""
    return not (uncond is not None and guidance < 1.0) and cond.image is None and cond.video is None


def _cfg_batch(parts) -> bool:
    """A hook on a transformer needs the conditional and unconditional predictions in one batch
    (CFG-parallel splits that batch between two rank groups)."""
    return any(getattr(hooks.get_hook(model, name), "cfg_batch", False)
               for model, _ in parts.experts for name in hooks.hook_names(model))


@torch.no_grad()
def denoise_loop(parts, noise: Tensor, cond: TextConditioning, uncond: TextConditioning | None, steps: int,
                 guidance: float, progress: bool = False) -> Tensor:
    """The generic scheduler loop, equal to the families' pipelines: latents (B, C, T, H, W) float32
    from `noise`. With classifier-free guidance the conditional and unconditional predictions are one
    batch of 2B (what CFG-parallel splits); an embedded-guidance model (HunyuanVideo) gets the scale as
    an input instead. The transformer runs in its own dtype, the scheduler in float32, as the
    pipelines do."""
    scheduler, adapter = parts.scheduler, parts.adapter
    set_schedule(adapter, scheduler, steps, tuple(noise.shape))
    model = parts.transformer
    device, dtype = noise.device, next(model.parameters()).dtype
    x = noise.float() * getattr(scheduler, "init_noise_sigma", 1.0)  # flow-matching schedulers: 1
    cfg = uncond is not None and adapter.guidance == "cfg"
    text = _join(cond, uncond) if cfg else cond
    if adapter.guidance == "embedded":
        text = TextConditioning(text.states, text.mask, text.pooled, guidance=guidance)
    text, old = _to(text, dtype, device), None
    timesteps = scheduler.timesteps
    multistep = "old_pred_original_sample" in inspect.signature(scheduler.step).parameters
    for i, t in enumerate(tqdm(timesteps, desc="sampling", disable=not progress, leave=False)):
        model = parts.expert_for(t)
        batch = torch.cat([x, x]) if cfg else x
        if hasattr(scheduler, "scale_model_input"):  # DDIM, UniPC (flow-matching schedulers have none)
            batch = scheduler.scale_model_input(batch, t)
        batch = batch.to(dtype)
        pred = adapter.predict(model, batch, t.expand(batch.shape[0]).to(device), text).float()
        if cfg:
            c, u = pred.chunk(2)
            pred = u + guidance * (c - u)
        if multistep:  # a DPM step (CogVideoX's) that also takes the previous x0 estimate
            x, old = scheduler.step(pred, old, t, timesteps[i - 1] if i > 0 else None, x, return_dict=False)
        else:
            x = scheduler.step(pred, t, x, return_dict=False)[0]
    from slidefusion.pretrained.image import finish

    return finish(adapter, x, cond.video)


def sample_latents(parts, request: Request, generator: torch.Generator | None = None,
                   progress: bool = False) -> Tensor:
    """One process or every rank alike: the request's latents (1, C, T, H, W) float32 (noise from
    `generator`, default `torch.Generator().manual_seed(request.seed)`)."""
    shape = parts_latent_shape(parts, request)
    generator = generator or torch.Generator().manual_seed(request.seed)
    noise = initial_noise(parts.adapter, shape, generator)
    cond = encode_prompts(parts, [request.prompt])
    guided = request.guidance != 1.0 and parts.adapter.guidance == "cfg"
    uncond = encode_prompts(parts, [request.negative_prompt]) if guided else None
    return denoise(parts, noise, cond, uncond, request.steps, request.guidance, progress)


@torch.no_grad()
def decode(parts, latents: Tensor) -> Tensor:
    """Latents (B, C, T, H, W) from `denoise` -> videos (B, 3, F, H, W) in [-1, 1], float32, on the
    CPU, as the family's pipeline decodes them (`DiffusersVideoAutoencoder`)."""
    from slidefusion.vae import DiffusersVideoAutoencoder

    return DiffusersVideoAutoencoder(parts.vae).decode(latents).cpu()
