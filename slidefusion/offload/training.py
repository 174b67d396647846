"""The engine behind the trainer's optimizer seam (`Trainer` with `offload.enabled`)."""

import dataclasses

from torch import nn

from slidefusion.adapters import adapter_for
from slidefusion.offload.config import DTYPES
from slidefusion.offload.engine import OffloadEngine
from slidefusion.offload.planner import Workload, activation_parts, auto_resident_blocks, engine_plan, require_fit
from slidefusion.offload.shapes import ModelShape, shape_of_config
from slidefusion.offload.policy import OffloadPolicy


def offload_policy(config) -> OffloadPolicy:
    """The typed policy of a `TrainConfig`'s offload and optim sections ('auto' residency: 0 here)."""
    off = config.offload
    return OffloadPolicy(device=config.run.device, compute_dtype=DTYPES[off.compute_dtype], master=off.master,
                         moments=off.moments, rounding=off.rounding, optim=config.optim, prefetch=off.prefetch,
                         checkpoint=off.checkpoint, resident_blocks=0 if off.resident_blocks == "auto" else off.resident_blocks,
                         pin_budget=off.pin_budget_bytes)


def offload_optimizer(model: nn.Module, config, tokens: int, shape: ModelShape | None = None) -> OffloadEngine:
    """An `OffloadEngine` for a `TrainConfig`, once the planner says it fits; `tokens` per sample
    size the activations; `shape`: the model's (default: from `config.model`, one of our presets)."""
    off, run = config.offload, config.run
    policy = offload_policy(config)
    shape = shape or shape_of_config(config.model)
    work = Workload(batch=run.batch_size, tokens=tokens, attention=_attention_kind(shape.attention))
    blocks = engine_blocks(model)
    activations = sum(activation_parts(shape, work, policy.compute_bytes).values())
    if off.resident_blocks == "auto":
        policy = dataclasses.replace(policy, resident_blocks=auto_resident_blocks(model, blocks, policy, activations))
    require_fit(engine_plan(model, blocks, policy, activations))
    return OffloadEngine(model, blocks, policy)


def engine_blocks(model: nn.Module) -> nn.ModuleList:
    """The blocks the engine streams, in call order, whatever the model class (its groups follow them)."""
    return nn.ModuleList(adapter_for(model).blocks(model))


def _attention_kind(name: str) -> str:
    return name if name in ("dense", "flash", "window", "slide") else "dense"  # unknown operators: the worst case
