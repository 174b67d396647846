"""Parallel generation from a local diffusers folder: the text encoder, the transformer(s), the VAE
and the scheduler all come from the folder.

    latents, video = generate_pretrained("Wan2.1-T2V-1.3B-Diffusers", "a cat", world=4,
                                         config=ParallelConfig("ulysses", "auto"), frames=81, ...)

spawns gloo ranks on this machine (torchrun goes through the CLI instead); inside a process group
`pretrained_video(parts, prompt, config, ...)` is the same on every rank: the transformers are
parallelized in place, `denoise` runs the folder's scheduler loop unchanged on every rank, and the
VAE decode is split over the ranks (`decode.py`). Only rank 0 writes files.

`denoise` is the one sampling loop here, kept small so that it can give way to the single-process
diffusers-folder pipeline of issue 10 (phase B) when that lands: `generate --pretrained --parallel`
must reuse that pipeline's loop, so that the single-process `--save-latents` gives the same latents.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from slidefusion.adapters import ModelAdapter, TextConditioning
from slidefusion.errors import check
from slidefusion.parallel.comm import Comm
from slidefusion.parallel.decode import decode_video
from slidefusion.parallel.launch import spawn
from slidefusion.parallel.plan import ParallelConfig, check_fit
from slidefusion.parallel.trace import Tracer


@dataclass
class PretrainedParts:
    """A folder's components, loaded on the CPU. `experts`: (transformer, lowest timestep it
    denoises) from high noise to low (one entry, or Wan 2.2 A14B's two)."""

    folder: object
    adapter: ModelAdapter
    experts: list[tuple[nn.Module, float]]
    tokenizer: object
    text_encoder: nn.Module
    vae: nn.Module
    scheduler: object

    @classmethod
    def load(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> PretrainedParts:
        from slidefusion.pretrained import load_scheduler, load_text_encoders, load_transformer, load_vae, open_folder

        folder = open_folder(path)
        check(folder.is_pipeline, f"pretrained={path} is a bare transformer folder; generating needs a pipeline "
                                  "folder (model_index.json with text_encoder/, tokenizer/, vae/, scheduler/)")
        adapter = folder.adapter()
        encoders = load_text_encoders(folder)
        check(len(encoders) == 1, f"pretrained={path}: {adapter.class_name} takes {len(encoders)} text encoders; "
                                  "this generator supports one-encoder families (Wan, Latte)")
        experts = [(load_transformer(folder, e.name, dtype).eval(), e.low) for e in folder.experts()]
        return cls(folder, adapter, experts, *encoders[0], load_vae(folder), load_scheduler(folder))

    @property
    def transformer(self) -> nn.Module:
        return self.experts[0][0]


def encode_prompts(parts: PretrainedParts, prompts: list[str]) -> TextConditioning:
    """Text states as the family's pipeline computes them: padded to the family's length with a
    mask; the adapter zeroes (Wan) or cuts (Latte) past the prompt as the pipeline does."""
    spec = parts.adapter.text
    tokens = parts.tokenizer([" ".join(p.split()) for p in prompts], padding="max_length",
                             max_length=spec.max_length, truncation=True, return_tensors="pt")
    mask = tokens.attention_mask.bool()
    with torch.no_grad():
        states = parts.text_encoder(tokens.input_ids, attention_mask=tokens.attention_mask).last_hidden_state
    return TextConditioning(states.float(), mask)


def latent_shape(adapter: ModelAdapter, model: nn.Module, vae_config, frames: int, height: int,
                 width: int) -> tuple[int, ...]:
    """(1, C, T, H, W) latents of `model` (meta is enough) for a video of `frames` x `height` x `width`
    pixels through a VAE of `vae_config` (its config attributes), or a UserError."""
    config = vae_config
    time = int(getattr(config, "scale_factor_temporal", 1) or 1)
    space = int(getattr(config, "scale_factor_spatial", 0) or 2 ** (len(getattr(config, "block_out_channels", [0])) - 1))
    check(frames >= 1 and (frames - 1) % time == 0,
          f"frames={frames} is not allowed by this VAE; valid: 1 + {time}k (e.g. {1 + 4 * time})")
    check(height % space == 0 and width % space == 0,
          f"height={height} and width={width} must be multiples of the VAE's {space}-pixel latent cell")
    shape = (1, adapter.latent_channels(model), (frames - 1) // time + 1, height // space, width // space)
    adapter.token_grid(model, shape)  # the patch and the family's rules, by name
    return shape


def _latent_shape(parts: PretrainedParts, request: Request) -> tuple[int, ...]:
    return latent_shape(parts.adapter, parts.transformer, parts.vae.config, request.frames, request.height,
                        request.width)


def _join(cond: TextConditioning, uncond: TextConditioning) -> TextConditioning:
    return TextConditioning(torch.cat([cond.states, uncond.states]), torch.cat([cond.bool_mask(), uncond.bool_mask()]))


@torch.no_grad()
def denoise(parts: PretrainedParts, noise: Tensor, cond: TextConditioning, uncond: TextConditioning | None,
            steps: int, guidance: float) -> Tensor:
    """The folder's scheduler loop: latents (1, C, T, H, W) from `noise`. With guidance the
    conditional and unconditional predictions are one batch of 2 (what CFG-parallel splits)."""
    scheduler = parts.scheduler
    scheduler.set_timesteps(steps)
    x = noise * scheduler.init_noise_sigma
    text = cond if uncond is None else _join(cond, uncond)
    for t in scheduler.timesteps:
        model = next(m for m, low in parts.experts if float(t) >= low)
        batch = x if uncond is None else torch.cat([x, x])
        batch = scheduler.scale_model_input(batch, t)
        pred = parts.adapter.predict(model, batch, t.expand(batch.shape[0]), text)
        if uncond is not None:
            c, u = pred.chunk(2)
            pred = u + guidance * (c - u)
        x = scheduler.step(pred, t, x, return_dict=False)[0]
    return x


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


def sample_latents(parts: PretrainedParts, request: Request) -> Tensor:
    """One process or every rank alike: the request's latents (1, C, T, H, W)."""
    shape = _latent_shape(parts, request)
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(request.seed))
    cond = encode_prompts(parts, [request.prompt])
    uncond = None if request.guidance == 1.0 else encode_prompts(parts, [request.negative_prompt])
    return denoise(parts, noise, cond, uncond, request.steps, request.guidance)


def pretrained_video(parts: PretrainedParts, request: Request, config: ParallelConfig,
                     tracer: Tracer | None = None, decode: bool = True) -> tuple[Tensor, Tensor | None]:
    """Inside an initialised process group: (latents (1, C, T, H, W), video (3, F, H, W) in [-1, 1]
    or None), the same on every rank. Parallelizes the folder's transformers in place."""
    from slidefusion.parallel.engine import parallelize

    shape = _latent_shape(parts, request)
    batch = 1 if request.guidance == 1.0 or config.cfg_parallel else 2
    for model, _ in parts.experts:
        parallelize(model, config, tracer=tracer, latent_shape=(batch, *shape[1:]))
    latents = sample_latents(parts, request)
    video = decode_video(parts.vae, latents, Comm(tracer=tracer))[0] if decode else None
    return latents, video


def _generate_rank(rank: int, world: int, folder: str, request: Request, config: ParallelConfig,
                   out: str | None, save_latents: str | None, decode: bool):
    parts = PretrainedParts.load(folder)
    latents, video = pretrained_video(parts, request, config, decode=decode or out is not None)
    if rank == 0:
        _write(latents, video, out, save_latents, fps=16)
    return (latents, video) if rank == 0 else None


def _write(latents: Tensor, video: Tensor | None, out: str | None, save_latents: str | None, fps: int) -> None:
    from slidefusion.data.video_io import write_video
    from slidefusion.pipeline import save_latents as write_latents

    if save_latents:
        write_latents(save_latents, latents)
    if out:
        write_video(Path(out), video, fps=fps)


def check_request(folder: str | Path, request: Request, config: ParallelConfig, world: int | None,
                  out: str | Path | None = None) -> None:
    """Every check that needs no process group and no weights: the output path, the folder, the
    schedule against the model (and `world` ranks), the sizes against the VAE and the patch."""
    import types

    from slidefusion.data.video_io import check_video_path
    from slidefusion.pretrained import build_on_meta, open_folder
    from slidefusion.pretrained.folder import read_json

    if out is not None:
        check_video_path(Path(out))
    opened = open_folder(folder)
    check(opened.is_pipeline, f"pretrained={folder} is a bare transformer folder; generating needs a pipeline "
                              "folder (model_index.json with text_encoder/, tokenizer/, vae/, scheduler/)")
    vae = types.SimpleNamespace(**read_json(opened.component_dir("vae") / "config.json", "VAE config"))
    for expert in opened.experts():
        meta = build_on_meta(opened, expert.name)
        check_fit(meta, config, world)
        latent_shape(opened.adapter(expert.name), meta, vae, request.frames, request.height, request.width)


def generate_pretrained(folder: str | Path, prompt: str, world: int, config: ParallelConfig, *,
                        out: str | Path | None = None, save_latents: str | Path | None = None,
                        decode: bool = True, **request) -> tuple[Tensor, Tensor | None]:
    """Spawn `world` gloo ranks on this machine, each loading `folder`; sample `prompt` under `config`
    and decode split over the ranks. Rank 0 writes `out` (.mp4/.gif) and `save_latents` if given.
    Returns (latents (1, C, T, H, W), video (3, F, H, W) or None). `request`: see `Request`."""
    req = Request(prompt, **request)
    check_request(folder, req, config, world, out)
    result = spawn(_generate_rank, world, str(folder), req, config, None if out is None else str(out),
                   None if save_latents is None else str(save_latents), decode, timeout_s=config.timeout_s)
    return result[0]


__all__ = ["PretrainedParts", "Request", "decode_video", "denoise", "encode_prompts", "generate_pretrained",
           "latent_shape", "pretrained_video", "sample_latents"]
