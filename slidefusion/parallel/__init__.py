"""Sequence-parallel inference of spatial-temporal DiTs (DSP, Ulysses, ScaleFusion) on torch.distributed.

Applied from outside to an unchanged model: `parallelize(model, ParallelConfig(...))` reads the
model's record (`records.record_for`) and the schedule (`plan.SCHEDULES`).
See README.md in this folder for the layouts, the schedules and the simulator.
"""

from slidefusion.parallel.api import generate, parallel_latents
from slidefusion.parallel.comm import LinkDelay, ParallelError
from slidefusion.parallel.engine import ParallelDiT, parallelize
from slidefusion.parallel.launch import init_distributed, spawn
from slidefusion.parallel.plan import SCHEDULES, ParallelConfig
from slidefusion.parallel.trace import Tracer, write_chrome_trace

__all__ = ["SCHEDULES", "LinkDelay", "ParallelConfig", "ParallelDiT", "ParallelError", "Tracer",
           "generate", "init_distributed", "parallel_latents", "parallelize", "spawn", "write_chrome_trace"]
