"""Parallel generation from a plain Python script: spawn gloo ranks on this machine, each building the
pipeline and sampling with `parallel=config`; rank 0 writes the files. (Under torchrun the CLI's
`generate --parallel` does the same on the launcher's ranks.)

    latents, video = generate_pretrained("Wan2.1-T2V-1.3B-Diffusers", "a cat", world=4,
                                         config=ParallelConfig("ulysses", "auto"), frames=81, ...)
    latents = generate("stdit-tiny", "a red circle", world=2, config=ParallelConfig("dsp"))
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from slidefusion.errors import check
from slidefusion.parallel import ParallelConfig, spawn
from slidefusion.pipeline.call import save_latents as write_latents
from slidefusion.pipeline.folder import FolderPipeline
from slidefusion.pipeline.ours import VideoPipeline
from slidefusion.pipeline.parallel import check_folder


def _preset_rank(rank: int, world: int, preset: str, seed: int, prompt: str, config: ParallelConfig,
                 options: dict) -> Tensor | None:
    pipe = VideoPipeline.from_preset(preset, seed=seed)
    latents = pipe.latents(prompt, parallel=config, **{"progress": False, **options})
    return latents if rank == 0 else None


def generate(preset: str, prompt: str, world: int, config: ParallelConfig, seed: int = 0, **options) -> Tensor:
    """Spawn `world` gloo ranks; each builds the random `preset` model (seeded, so all agree) and
    samples `prompt` with `VideoPipeline.latents(**options, parallel=config)`. Returns the final
    latents (1, C, T, H, W)."""
    return spawn(_preset_rank, world, preset, seed, prompt, config, options, timeout_s=config.timeout_s)[0]


def _folder_rank(rank: int, world: int, folder: str, prompt: str, config: ParallelConfig, out: str | None,
                 latents_path: str | None, decode: bool, request: dict):
    pipe = FolderPipeline.from_pretrained(folder)
    latents = pipe.latents(prompt, parallel=config, progress=False, **request)
    video = pipe.decode(latents, parallel=config) if decode or out is not None else None
    if rank != 0:
        return None
    if latents_path:
        write_latents(latents_path, latents)
    if out:
        from slidefusion.data.video_io import write_video

        write_video(Path(out), video, fps=pipe.fps)
    return latents, video


def generate_pretrained(folder: str | Path, prompt: str, world: int, config: ParallelConfig, *,
                        out: str | Path | None = None, save_latents: str | Path | None = None,
                        decode: bool = True, **request) -> tuple[Tensor, Tensor | None]:
    """Spawn `world` gloo ranks on this machine, each loading `folder`; sample `prompt` under `config`
    and decode split over the ranks. Rank 0 writes `out` (.mp4/.gif) and `save_latents` if given.
    Returns (latents (1, C, T, H, W), video (3, F, H, W) or None). `request`: `FolderPipeline.latents`'s
    frames, height, width (required), steps, guidance, seed, negative_prompt. Every check that needs
    no weights runs first, here, so bad input is one UserError before any rank starts."""
    from slidefusion import validate
    from slidefusion.data.video_io import check_video_path

    check(bool(str(prompt).strip()), "prompt must be a non-empty text")
    validate.integer(request.get("steps", 30), "steps", 1)
    validate.finite(request.get("guidance", 5.0), "guidance", 0)
    sizes = [request.get(key) for key in ("frames", "height", "width")]
    if out is not None:
        check_video_path(Path(out))
    check_folder(folder, config, world, *sizes)
    result = spawn(_folder_rank, world, str(folder), prompt, config, None if out is None else str(out),
                   None if save_latents is None else str(save_latents), decode, request, timeout_s=config.timeout_s)
    return result[0]


__all__ = ["generate", "generate_pretrained"]
