"""Memory-centric offload training: host-resident state, block streaming, CPU AdamW, planner.

    policy.py   `OffloadPolicy`, the one config (the YAML `offload:` section, the planner's input)
    engine/     `OffloadEngine`: host buffers, block streaming, gradient shipping, the step
    optim/      the host AdamW in each storage format, its C kernels, when updates run
    tiling/     blocks tile by tile, the block-checkpoint store and its spill file, activation sizes
    plan/       `Sizing`, `resolve` (auto -> numbers), the footprint and the `plan` command's planner
"""

from slidefusion.offload.engine.engine import OffloadEngine, engine_blocks
from slidefusion.offload.engine.stats import EngineStats
from slidefusion.offload.plan.footprint import engine_footprint, engine_plan, require_fit
from slidefusion.offload.plan.plan import Plan
from slidefusion.offload.plan.planner import Machine, plan_policy, plan_training
from slidefusion.offload.plan.resolve import fitting_policy, resolve
from slidefusion.offload.plan.sizing import Sizing
from slidefusion.offload.policy import OffloadPolicy
from slidefusion.offload.tiling.activations import Workload

__all__ = ["EngineStats", "Machine", "OffloadEngine", "OffloadPolicy", "Plan", "Sizing", "Workload", "engine_blocks",
           "engine_footprint", "engine_plan", "fitting_policy", "plan_policy", "plan_training", "require_fit", "resolve"]
