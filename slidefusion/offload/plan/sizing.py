"""`Sizing`: what one training step of a policy needs on the device, the host and the disk.

One record serves both askers:
  the planner (`slidefusion plan`)  counts from a `ModelShape`, capacities from the flags, and the
                                    block checkpoints placed wherever there is room (device, then
                                    host, then disk): what could be made to work;
  the trainer                       counts from the model it will train (trainable and frozen apart),
                                    capacities of this machine, and the checkpoints placed where the
                                    policy puts them (on the device, or with `spill_dir` host memory
                                    up to `spill_after` and the rest on disk).
`resolve` searches policies against `plan`, and the caller checks the resolved one with `require_fit`.
"""

import dataclasses
from dataclasses import dataclass

from torch import nn

from slidefusion.offload.plan.footprint import Counts, engine_footprint, frozen_scale_counts, parameter_counts
from slidefusion.offload.plan.model_shape import ModelShape
from slidefusion.offload.plan.plan import Plan, available_host_memory, device_capacity
from slidefusion.offload.tiling.activations import CHECKPOINTS, Workload, activation_parts, place_checkpoints


@dataclass(frozen=True)
class Sizing:
    """Parameter counts, the widths activations scale with, one step's workload, and the capacities
    in bytes (None: unknown, never refused)."""

    blocks: tuple[Counts, ...]  # (trainable, frozen) parameters per block, in call order
    rest: Counts  # outside the blocks
    shape: ModelShape  # hidden, heads, MLP ratio, whether the blocks tile
    work: Workload
    device_capacity: int | None
    host_capacity: int | None
    disk_capacity: int | None = None
    by_room: bool = False  # checkpoints wherever there is room (the planner), else where the policy puts them
    scales: dict | None = None  # an fp8 base's scale counts (`frozen_scale_counts`); None: no frozen parameters known

    @classmethod
    def of_model(cls, model: nn.Module, blocks, shape: ModelShape, work: Workload, device=None) -> "Sizing":
        """The trainer's sizing of `model` (meta is enough) on `device` (a torch.device; None: no limit)."""
        counts, rest = parameter_counts(model, blocks)
        capacity = None if device is None else device_capacity(device)
        return cls(tuple(counts), rest, shape, work, capacity, available_host_memory(),
                   scales=frozen_scale_counts(model, blocks))

    @classmethod
    def of_shape(cls, shape: ModelShape, work: Workload, device: int | None, host: int | None,
                 disk: int | None) -> "Sizing":
        """The planner's sizing of a `ModelShape` (every parameter trainable)."""
        return cls(tuple((n, 0) for n in shape.block_params), (shape.rest_params, 0), shape, work, device, host, disk,
                   by_room=True)

    @property
    def frames(self) -> int:
        return self.work.frames

    @property
    def tileable(self) -> bool:
        return self.shape.tileable

    def fits_device(self, policy, unknown: bool = True) -> bool:
        """Whether `policy`'s device bytes fit (`unknown`: the answer where the capacity is not known)."""
        if self.device_capacity is None:
            return unknown
        return self.plan(policy).device_bytes <= self.device_capacity

    def plan(self, policy) -> Plan:
        """The plan of one step under `policy` (its `tile` and `resident_blocks` numbers), capacities
        checked: weights and state (`engine_footprint`), activations, and where the checkpoints go."""
        plan = engine_footprint(list(self.blocks), self.rest, policy, self.scales)
        plan.device_capacity, plan.host_capacity, plan.disk_capacity = (
            self.device_capacity, self.host_capacity, self.disk_capacity)
        tile = policy.tile
        plan.tile = tile if tile is not None and tile < self.frames else None
        parts = activation_parts(self.shape, self.work, policy.compute_bytes, plan.tile)
        checkpoints = parts.pop(CHECKPOINTS)
        plan.device.update(parts)
        if self.by_room:
            place_checkpoints(plan, checkpoints, plan.disk_capacity, self._device_room(plan, policy))
        else:
            _place_as_policy(plan, checkpoints, policy)
        if plan.tile:
            plan.tile_device_bytes = sum(v for k, v in parts.items() if "tile" in k)
        plan.check_capacity()
        return plan

    def _device_room(self, plan: Plan, policy) -> int | None:
        """The device bytes left for the checkpoints (None: no limit). With resident blocks they stay
        where the plan without residency put them, so residency only takes the room they leave."""
        if policy.resident_blocks:
            base = self.plan(dataclasses.replace(policy, resident_blocks=0))
            return -1 if CHECKPOINTS not in base.device else None
        return None if plan.device_capacity is None else plan.device_capacity - plan.device_bytes


def _place_as_policy(plan: Plan, checkpoints: int, policy) -> None:
    """The engine's placement: on the device, or with `spill_dir` the first `spill_after` bytes in
    host memory and the rest in the spill file."""
    if policy.spill_dir is None:
        plan.device[CHECKPOINTS] = checkpoints
        return
    on_host = min(checkpoints, policy.spill_after)
    if on_host:
        plan.host[CHECKPOINTS] = on_host
    if checkpoints > on_host:
        plan.disk[CHECKPOINTS + " (spilled)"] = checkpoints - on_host
