"""Memory-centric offload training: host-resident state, block streaming, CPU AdamW, planner."""

from slidefusion.offload.engine import OffloadEngine
from slidefusion.offload.planner import Plan, Workload, engine_footprint, plan_training

__all__ = ["OffloadEngine", "Plan", "Workload", "engine_footprint", "plan_training"]
