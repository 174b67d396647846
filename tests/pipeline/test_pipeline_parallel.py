"""`pipe.latents(..., parallel=ParallelConfig(...))` across spawned gloo ranks equals one process, and the
parallel hooks come off when the call returns (the same pipeline samples single-process again)."""

import datetime

import torch
import torch.distributed as dist

from slidefusion.parallel import ParallelConfig, Tracer, spawn
from slidefusion.parallel.launch import free_port
from slidefusion.pipeline import VideoPipeline, generate

OPTIONS = dict(frames=3, height=6, width=10, steps=2, progress=False)
PROMPT = "a blue square moving left"


def test_two_ranks_equal_one_process():
    single = VideoPipeline.from_preset("stdit-tiny", seed=1).latents(PROMPT, **OPTIONS)
    spawned = generate("stdit-tiny", PROMPT, 2, ParallelConfig("scalefusion", 2, timeout_s=60), seed=1, **OPTIONS)
    assert single.abs().max() > 0.1 and (spawned - single).abs().max() <= 1e-5


def test_the_hooks_come_off_after_the_call():
    pipe = VideoPipeline.from_preset("stdit-tiny", seed=1)
    single = pipe.latents(PROMPT, **OPTIONS)
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{free_port()}",
                            timeout=datetime.timedelta(seconds=60))
    try:
        parallel = pipe.latents(PROMPT, **OPTIONS, parallel=ParallelConfig("dsp", timeout_s=60))
    finally:
        dist.destroy_process_group()
    assert (parallel - single).abs().max() <= 1e-5
    assert torch.equal(pipe.latents(PROMPT, **OPTIONS), single)  # no process group now: hooks left on would fail


def _usp_rank(rank: int, world: int):
    """`latents(parallel=usp)` on one rank: the latents and whether ring hops were traced."""
    pipe = VideoPipeline.from_preset("dit3d-tiny", seed=1)
    tracer = Tracer(rank=rank, enabled=True)
    latents = pipe.latents(PROMPT, **OPTIONS, parallel=ParallelConfig("usp", 2, ring=2, timeout_s=60), tracer=tracer)
    return latents, any(" ring " in name for name, *_ in tracer.spans)


def test_the_ring_schedules_go_through_the_pipelines_parallel_argument():
    """usp (--ring 2 on 2 ranks: a ring of 2, chunks of 2) chosen by the config the pipeline takes."""
    single = VideoPipeline.from_preset("dit3d-tiny", seed=1).latents(PROMPT, **OPTIONS)
    for latents, hopped in spawn(_usp_rank, 2, timeout_s=60):
        assert hopped and (latents - single).abs().max() <= 1e-5
