"""Sequence-parallel inference of video DiTs (DSP, Ulysses, sliced Ulysses, ScaleFusion) on torch.distributed.

Applied from outside to an unchanged model: `parallelize(model, ParallelConfig(...))` reads the
model's adapter and parallel record (`records.record_for`, `records.model_access`) and the schedule
(`plan.SCHEDULES`), and attaches in-place hooks, so the model's own forward runs on every rank.
Our DiT3D / STDiT and diffusers' WanTransformer3DModel / LatteTransformer3DModel have plans.
The engine reads no files and knows no pipeline: a pipeline takes `parallel=ParallelConfig(...)`
(`slidefusion.pipeline.parallel`). See README.md in this folder for the layouts, the schedules and
the simulator.
"""

from slidefusion.parallel.comm import Comm, LinkDelay, ParallelError
from slidefusion.parallel.decode import decode_video
from slidefusion.parallel.engine import ParallelDiT, parallelize
from slidefusion.parallel.launch import init_distributed, launcher_world, spawn
from slidefusion.parallel.plan import DEFAULT_TIMEOUT_S, SCHEDULES, ParallelConfig, check_fit
from slidefusion.parallel.trace import Tracer, chrome_trace

__all__ = ["DEFAULT_TIMEOUT_S", "SCHEDULES", "Comm", "LinkDelay", "ParallelConfig", "ParallelDiT", "ParallelError",
           "Tracer", "check_fit", "chrome_trace", "decode_video", "init_distributed", "launcher_world", "parallelize",
           "spawn"]
