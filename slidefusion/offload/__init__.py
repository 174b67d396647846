"""Memory-centric offload training: host-resident state, block streaming, CPU AdamW, planner."""

from slidefusion.offload.engine import OffloadEngine
from slidefusion.offload.planner import Plan, Workload, engine_footprint, engine_plan, plan_training, require_fit
from slidefusion.offload.policy import OffloadPolicy
from slidefusion.offload.stats import EngineStats

__all__ = ["OffloadEngine", "OffloadPolicy", "EngineStats", "Plan", "Workload", "engine_footprint", "engine_plan",
           "plan_training", "require_fit"]
