"""Parallel generation from a local diffusers folder: the text encoder, the transformer(s), the VAE
and the scheduler all come from the folder.

    latents, video = generate_pretrained("Wan2.1-T2V-1.3B-Diffusers", "a cat", world=4,
                                         config=ParallelConfig("ulysses", "auto"), frames=81, ...)

spawns gloo ranks on this machine (torchrun goes through the CLI instead); inside a process group
`pretrained_video(parts, prompt, config, ...)` is the same on every rank: the transformers are
parallelized in place, `denoise` runs the folder's scheduler loop unchanged on every rank, and the
VAE decode is split over the ranks (`decode.py`). Only rank 0 writes files.

The components, the prompt encoding, the scheduler loop (`denoise`) and the request are
`slidefusion.pretrained`'s, the same the single-process `generate --pretrained` runs, so that
`--parallel` gives the single-process latents.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from slidefusion.parallel.comm import Comm
from slidefusion.parallel.decode import decode_video
from slidefusion.parallel.launch import spawn
from slidefusion.parallel.plan import ParallelConfig, check_fit
from slidefusion.parallel.trace import Tracer
from slidefusion.vae import check_decoded
from slidefusion.pretrained import (
    PretrainedParts,
    Request,
    denoise,
    encode_prompts,
    latent_shape,
    parts_latent_shape,
    require_pipeline,
    sample_latents,
)


def pretrained_video(parts: PretrainedParts, request: Request, config: ParallelConfig,
                     tracer: Tracer | None = None, decode: bool = True) -> tuple[Tensor, Tensor | None]:
    """Inside an initialised process group: (latents (1, C, T, H, W), video (3, F, H, W) in [-1, 1]
    or None), the same on every rank. Parallelizes the folder's transformers in place."""
    from slidefusion.parallel.engine import parallelize

    shape = parts_latent_shape(parts, request)
    batch = 1 if request.guidance == 1.0 or config.cfg_parallel else 2
    for model, _ in parts.experts:
        parallelize(model, config, tracer=tracer, latent_shape=(batch, *shape[1:]))
    latents = sample_latents(parts, request)
    video = decode_video(parts.vae, latents, Comm(tracer=tracer))[0] if decode else None
    return latents, None if video is None else check_decoded(video)


def _generate_rank(rank: int, world: int, folder: str, request: Request, config: ParallelConfig,
                   out: str | None, save_latents: str | None, decode: bool):
    parts = PretrainedParts.load(folder)
    latents, video = pretrained_video(parts, request, config, decode=decode or out is not None)
    if rank == 0:
        _write(latents, video, out, save_latents, fps=parts.adapter.fps)
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
    from slidefusion.data.video_io import check_video_path
    from slidefusion.pretrained import build_on_meta, open_folder
    from slidefusion.pretrained.folder import read_json

    if out is not None:
        check_video_path(Path(out))
    opened = open_folder(folder)
    require_pipeline(opened, "generating")
    vae = read_json(opened.component_dir("vae") / "config.json", "VAE config")
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
