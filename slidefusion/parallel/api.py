"""The Python API: run a pipeline's sampling across ranks, from torchrun or from a plain script."""

import dataclasses

import torch.distributed as dist
from torch import Tensor

from slidefusion.parallel.engine import parallelize
from slidefusion.parallel.launch import init_distributed, spawn
from slidefusion.parallel.plan import ParallelConfig
from slidefusion.parallel.trace import Tracer


def model_batch_shape(pipe, config: ParallelConfig, frames=None, height=None, width=None, guidance=4.0):
    """The latents (B, C, T, H, W) each sequence group's model call sees: CFG doubles the batch,
    CFG-parallel gives each half to one group."""
    data = pipe.config.data
    latent = pipe.autoencoder.latent_shape(frames or data.frames, height or data.height, width or data.width)
    batch = 1 if guidance == 1.0 or config.cfg_parallel else 2
    return (batch, *latent)


def parallel_latents(pipe, prompt: str, config: ParallelConfig, tracer: Tracer | None = None, **options) -> Tensor:
    """`pipe.latents(prompt, **options)` with the model run across the initialised process group.

    Every rank must call it with the same arguments; every rank returns the same latents."""
    sizes = {k: options.get(k) for k in ("frames", "height", "width")}
    shape = model_batch_shape(pipe, config, guidance=options.get("guidance", 4.0), **sizes)
    model = parallelize(pipe.model, config, tracer=tracer, latent_shape=shape)
    options.setdefault("progress", dist.get_rank() == 0)
    return dataclasses.replace(pipe, model=model).latents(prompt, **options)


def _generate_rank(rank: int, world: int, preset: str, seed: int, prompt: str, config: ParallelConfig,
                   options: dict) -> Tensor | None:
    from slidefusion.pipeline import VideoPipeline

    pipe = VideoPipeline.from_preset(preset, seed=seed)
    latents = parallel_latents(pipe, prompt, config, progress=False, **options)
    return latents if rank == 0 else None


def generate(preset: str, prompt: str, world: int, config: ParallelConfig, seed: int = 0, **options) -> Tensor:
    """Spawn `world` gloo ranks on this machine; each builds the random `preset` model (seeded, so all
    agree) and samples. Returns the final latents (1, C, T, H, W). The torchrun path is the CLI's."""
    return spawn(_generate_rank, world, preset, seed, prompt, config, options, timeout_s=config.timeout_s)[0]


__all__ = ["generate", "init_distributed", "model_batch_shape", "parallel_latents"]
