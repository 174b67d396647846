"""`resolve`: the one place where a policy's `auto` values become numbers.

    policy = resolve(OffloadPolicy(device="cuda", tile="auto", resident_blocks="auto"), sizing)
    require_fit(sizing.plan(policy))

  compute_dtype  auto -> bfloat16 on a GPU, float32 on a CPU (`OffloadPolicy.dtype`)
  tile           auto -> whole blocks (None) when they fit the device, else the largest tile (frames)
                 that fits, else 1; whole blocks where the device's size is unknown or the blocks
                 do not tile (`search_tile`)
  resident_blocks auto -> the most blocks, the last ones in call order, that fit the device beside
                 everything else; 0 where its size is unknown (`search_resident`)
  spill_reserve  with spill_dir: the disk bytes the plan spills, reserved before the first step
The tile is chosen first (with the residency the policy names, or none for auto), then the residency
in the room the tiles leave. `overlap` and `optimizer_threads` follow the device at run time
(`OffloadPolicy.overlapped`, `.threads`).
"""

import dataclasses
from collections.abc import Callable

from torch import nn

from slidefusion.errors import check
from slidefusion.offload.plan.footprint import engine_plan, require_fit
from slidefusion.offload.plan.model_shape import ModelShape
from slidefusion.offload.plan.sizing import Sizing
from slidefusion.offload.policy import AUTO, OffloadPolicy
from slidefusion.offload.tiling.activations import Workload
from slidefusion.offload.tiling.spill import check_spill_dir
from slidefusion.offload.tiling.tile_runner import check_tileable


def search_tile(fits: Callable[[int | None], bool], frames: int) -> int | None:
    """None when whole blocks fit; else the largest tile in [1, frames) that fits; else 1. Device
    bytes grow with the tile, so the search bisects."""
    if fits(None):
        return None
    low, high = 1, frames - 1
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def search_resident(fits: Callable[[int], bool], count: int) -> int:
    """The most of `count` blocks that can stay resident, or 0."""
    return next((n for n in range(count, 0, -1) if fits(n)), 0)


def resolve(policy: OffloadPolicy, sizing: Sizing | None = None) -> OffloadPolicy:
    """`policy` with every `auto` a number (see the module docstring). `sizing` is needed for an auto
    tile or residency and for a spill reserve; without it those must be given as numbers."""
    policy = dataclasses.replace(policy, compute_dtype=policy.dtype)
    if policy.resolved and (policy.spill_dir is None or sizing is None):
        return policy
    autos = [f"offload.{key}=auto" for key in ("tile", "resident_blocks") if getattr(policy, key) == AUTO]
    check(sizing is not None, f"{' and '.join(autos)} needs the model and one step's workload (resolve(policy, "
                              "Sizing...), as the trainer does); give a number to build an engine directly")
    if policy.tile == AUTO:
        trial = policy if policy.resident_blocks != AUTO else dataclasses.replace(policy, resident_blocks=0)
        tile = search_tile(lambda t: sizing.fits_device(dataclasses.replace(trial, tile=t)), sizing.frames) \
            if sizing.tileable else None
        policy = dataclasses.replace(policy, tile=tile)
    if policy.resident_blocks == AUTO:
        count = search_resident(lambda n: sizing.fits_device(dataclasses.replace(policy, resident_blocks=n), unknown=False),
                                len(sizing.blocks))
        policy = dataclasses.replace(policy, resident_blocks=count)
    if policy.spill_dir is not None:
        policy = dataclasses.replace(policy, spill_reserve=sum(sizing.plan(policy).disk.values()))
    return policy


def fitting_policy(model: nn.Module, blocks, policy: OffloadPolicy, shape: ModelShape, work: Workload) -> OffloadPolicy:
    """`policy` resolved against `model` (the meta device is enough, so a run is checked before any
    weight or cache exists) and one step of `work`, or a one-line refusal: a tile the blocks cannot
    run, a spill folder that cannot be written, or a plan that does not fit."""
    if isinstance(policy.tile, int):
        check_tileable(model, blocks, policy.tile)
    if policy.spill_dir is not None:
        check_spill_dir(policy.spill_dir)
    sizing = Sizing.of_model(model, blocks, shape, work, policy.torch_device)
    policy = resolve(policy, sizing)
    require_fit(sizing.plan(policy))
    return policy


def auto_resident_blocks(model: nn.Module, blocks, policy: OffloadPolicy, activation_bytes: int = 0,
                         device_memory: int | str | None = None) -> int:
    """`resident_blocks=auto` for an engine beside `activation_bytes` of activations: the most blocks
    (the last ones in call order) that stay on the device; 0 where the device's size is unknown."""
    def fits(count: int) -> bool:
        plan = engine_plan(model, blocks, dataclasses.replace(policy, resident_blocks=count), activation_bytes,
                           device_memory, host_memory=None)
        return plan.device_capacity is not None and plan.device_bytes <= plan.device_capacity

    return search_resident(fits, len(blocks))
