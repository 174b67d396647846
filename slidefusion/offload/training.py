"""The engine behind the trainer's optimizer seam (`Trainer` with `offload.enabled`)."""

import dataclasses
import math

from torch import nn

from slidefusion.adapters import adapter_for
from slidefusion.offload.activations import CHECKPOINTS
from slidefusion.offload.config import DTYPES
from slidefusion.offload.engine import OffloadEngine
from slidefusion.offload.planner import Workload, activation_parts, auto_resident_blocks, engine_plan, require_fit
from slidefusion.offload.policy import OffloadPolicy
from slidefusion.offload.shapes import ModelShape, shape_of_config


def offload_policy(config) -> OffloadPolicy:
    """The typed policy of a `TrainConfig`'s offload and optim sections ('auto' residency and
    tiling: 0 and off here; `offload_optimizer` resolves them)."""
    off = config.offload
    return OffloadPolicy(device=config.run.device, compute_dtype=DTYPES[off.compute_dtype], master=off.master,
                         moments=off.moments, rounding=off.rounding, optim=config.optim, prefetch=off.prefetch,
                         checkpoint=off.checkpoint, resident_blocks=0 if off.resident_blocks == "auto" else off.resident_blocks,
                         pin_budget=off.pin_budget_bytes, tile=off.tile if isinstance(off.tile, int) else None,
                         spill_dir=off.spill_dir, spill_after=off.spill_after_bytes,
                         overlap=None if off.overlap == "auto" else off.overlap,
                         optimizer_threads=None if off.optimizer_threads == "auto" else off.optimizer_threads,
                         frozen_dtype=config.lora.base_torch_dtype, frozen_scales=config.lora.base_scales)


def offload_optimizer(model: nn.Module, config, grid: tuple[int, int, int],
                      shape: ModelShape | None = None) -> OffloadEngine:
    """An `OffloadEngine` for a `TrainConfig`, once the planner says it fits; `grid` (T, H, W),
    the token grid of one sample, sizes the activations; `shape`: the model's (default: from
    `config.model`, one of our presets)."""
    return OffloadEngine(model, engine_blocks(model), fitting_policy(model, config, grid, shape))


def fitting_policy(model: nn.Module, config, grid: tuple[int, int, int],
                   shape: ModelShape | None = None) -> OffloadPolicy:
    """The engine's policy ('auto' residency and tiles resolved), or the planner's one-line refusal.
    A model on the meta device is enough, so a run can be checked before any weight or cache exists."""
    off, run = config.offload, config.run
    policy, blocks = offload_policy(config), engine_blocks(model)
    shape = shape or shape_of_config(config.model)
    work = Workload(batch=run.batch_size, tokens=math.prod(grid), attention=_attention_kind(shape.attention),
                    frames=grid[0])
    if off.tile == "auto" and shape.tileable:  # blocks with an unknown halo run whole under auto
        policy = dataclasses.replace(policy, tile=_auto_tile(model, blocks, policy, shape, work))
    parts = activation_parts(shape, work, policy.compute_bytes, policy.tile)
    if policy.spill_dir is not None:  # the store takes them off the device; reserve the disk they need
        policy = dataclasses.replace(policy, spill_reserve=max(0, parts.pop(CHECKPOINTS) - policy.spill_after))
    activations = sum(parts.values())
    if off.resident_blocks == "auto":
        policy = dataclasses.replace(policy, resident_blocks=auto_resident_blocks(model, blocks, policy, activations))
    require_fit(engine_plan(model, blocks, policy, activations))
    return policy


def _auto_tile(model, blocks, policy, shape, work) -> int | None:
    """`offload.tile=auto`: whole blocks when the engine's plan fits the device with them, else the
    largest tile (frames) that fits, else 1; whole blocks where the device's size is unknown (CPU)."""
    def fits(tile: int | None) -> bool:
        activations = sum(activation_parts(shape, work, policy.compute_bytes, tile).values())
        plan = engine_plan(model, blocks, dataclasses.replace(policy, tile=tile), activations)
        return plan.device_capacity is None or plan.device_bytes <= plan.device_capacity

    if fits(None):
        return None
    low, high = 1, work.frames - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def engine_blocks(model: nn.Module) -> nn.ModuleList:
    """The blocks the engine streams, in call order, whatever the model class (its groups follow them)."""
    return nn.ModuleList(adapter_for(model).blocks(model))


def _attention_kind(name: str) -> str:
    return name if name in ("dense", "flash", "window", "slide") else "dense"  # unknown operators: the worst case
