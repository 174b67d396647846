"""Sampling across ranks: a pipeline called with `parallel=ParallelConfig(...)` inside a process group
runs its transformer(s) sequence-parallel (and CFG-parallel) for that call, then single-process again.

    # every rank, under `torchrun --nproc-per-node P` (or `spawn`):
    init_distributed(config.timeout_s)
    latents = pipe.latents("a cat", frames=33, height=480, width=832, parallel=config)   # the same on every rank
    video = pipe.decode(latents, parallel=config)   # a diffusers folder's VAE: split over the ranks

The hooks of `slidefusion.parallel.parallelize` sit on the transformer, so the pipeline's own
sampling loop (our Euler sampler, the folder's scheduler) runs unchanged on every rank; they come off
when the call returns. The checks here need no process group and no weights, so bad input fails once,
before any rank joins or loads anything.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING

from torch import nn

from slidefusion.errors import check

if TYPE_CHECKING:
    from slidefusion.parallel import ParallelConfig, Tracer


def sequence_batch(config: ParallelConfig, guidance: float) -> int:
    """The batch one sequence group's model call sees: classifier-free guidance doubles it, and
    CFG-parallel gives each half to one group."""
    return 1 if guidance == 1.0 or config.cfg_parallel else 2


@contextmanager
def running_parallel(models: Sequence[nn.Module], config: ParallelConfig, latent_shape: tuple[int, ...],
                     guidance: float, tracer: Tracer | None = None) -> Iterator[None]:
    """Each of `models` parallel under `config` inside the block (hooks attached; `slices="auto"`
    measured for latents of `latent_shape` (B, C, T, H, W)), single-process again after it."""
    from slidefusion.parallel import parallelize  # torch.distributed and the plans: only when asked for

    batch_shape = (sequence_batch(config, guidance), *latent_shape[1:])
    handles = []
    try:
        for model in models:
            handles.append(parallelize(model, config, tracer=tracer, latent_shape=batch_shape))
        yield
    finally:
        for handle in handles:
            handle.detach()


def check_models(models: Sequence[nn.Module], config: ParallelConfig, world: int | None) -> None:
    """`config` against each model (meta is enough): the schedule, the slices, and `world` ranks."""
    from slidefusion.parallel import check_fit

    for model in models:
        check_fit(model, config, None)
        if world is not None:
            check_fit(model, config, world)


def check_folder(folder, config: ParallelConfig, world: int | None, frames: int, height: int, width: int) -> None:
    """A diffusers pipeline folder's sizes and `config` against each of its transformers, from its
    config files and shard headers alone (no weight is read)."""
    from slidefusion.pretrained import build_on_meta, check_generation, open_folder

    check(all(isinstance(v, int) and not isinstance(v, bool) for v in (frames, height, width)),
          f"frames, height and width are required for a diffusers folder (ints), got {frames!r}, {height!r}, {width!r}")
    opened = open_folder(folder)
    check_generation(opened, frames, height, width)
    check_models([build_on_meta(opened, expert.name) for expert in opened.experts()], config, world)


def maybe_parallel(models: Sequence[nn.Module], config: ParallelConfig | None, latent_shape: tuple[int, ...],
                   guidance: float, tracer: Tracer | None = None):
    """`running_parallel` under a config; nothing (one process) without one."""
    return nullcontext() if config is None else running_parallel(models, config, latent_shape, guidance, tracer)
