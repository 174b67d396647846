"""The Python API: run a pipeline's sampling across ranks, from torchrun or from a plain script."""

import dataclasses

import torch.distributed as dist
from torch import Tensor

from slidefusion.parallel.engine import parallelize
from slidefusion.parallel.launch import init_distributed, spawn
from slidefusion.parallel.plan import ParallelConfig
from slidefusion.parallel.trace import Tracer


def parallel_latents(pipe, prompt: str, config: ParallelConfig, tracer: Tracer | None = None, **options) -> Tensor:
    """`pipe.latents(prompt, **options)` with the model run across the initialised process group.

    Every rank must call it with the same arguments; every rank returns the same latents."""
    model = parallelize(pipe.model, config, tracer=tracer)
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


__all__ = ["parallel_latents", "generate", "init_distributed"]
