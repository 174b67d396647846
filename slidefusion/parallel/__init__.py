"""Sequence-parallel inference of video DiTs (DSP, Ulysses, sliced Ulysses, ScaleFusion) on torch.distributed.

Applied from outside to an unchanged model: `parallelize(model, ParallelConfig(...))` reads the
model's adapter and parallel record (`records.record_for`, `records.model_access`) and the schedule
(`plan.SCHEDULES`), and attaches in-place hooks, so the model's own forward runs on every rank.
Our DiT3D / STDiT and diffusers' WanTransformer3DModel / LatteTransformer3DModel have plans.
See README.md in this folder for the layouts, the schedules and the simulator.
"""

from slidefusion.parallel.api import generate, parallel_latents
from slidefusion.parallel.comm import LinkDelay, ParallelError
from slidefusion.parallel.engine import ParallelDiT, parallelize
from slidefusion.parallel.launch import init_distributed, spawn
from slidefusion.parallel.plan import SCHEDULES, ParallelConfig
from slidefusion.parallel.pretrained import PretrainedParts, Request, generate_pretrained, pretrained_video
from slidefusion.parallel.trace import Tracer, write_chrome_trace

__all__ = ["SCHEDULES", "LinkDelay", "ParallelConfig", "ParallelDiT", "ParallelError", "PretrainedParts", "Request",
           "Tracer", "generate", "generate_pretrained", "init_distributed", "parallel_latents", "parallelize",
           "pretrained_video", "spawn", "write_chrome_trace"]
