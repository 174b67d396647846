"""Memory-centric offload training: host-resident state, block streaming, CPU AdamW, planner."""

from slidefusion.offload.engine.engine import OffloadEngine
from slidefusion.offload.engine.stats import EngineStats
from slidefusion.offload.plan.planner import Plan, Workload, engine_footprint, engine_plan, plan_training, require_fit
from slidefusion.offload.policy import OffloadPolicy

__all__ = ["OffloadEngine", "OffloadPolicy", "EngineStats", "Plan", "Workload", "engine_footprint", "engine_plan",
           "plan_training", "require_fit"]
