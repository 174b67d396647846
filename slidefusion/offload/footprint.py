"""The engine's own footprint: weights, optimizer state and gradient buffers, on the host and the device.

`engine_plan` sizes an `OffloadEngine(model, blocks, policy)` before it is built, from the model's
actual parameter counts; the caller checks it with `require_fit` (the engine does not).
"""

import dataclasses
from dataclasses import dataclass

import torch

from slidefusion.errors import UserError
from slidefusion.offload.formats import trainable_bytes_per_param
from slidefusion.offload.layout import split_groups
from slidefusion.offload.plan import Plan, available_host_memory, device_capacity, parse_bytes

@dataclass(frozen=True)
class StateChoice:
    """What the engine will hold, for sizing: the policy's state and streaming knobs."""

    compute_dtype: torch.dtype = torch.bfloat16
    master: str = "fp32"
    moments: str = "fp32"
    rounding: str = "stochastic"
    prefetch: int = 1
    clip: bool = False
    checkpoint: bool = True
    resident_blocks: int = 0
    frozen_dtype: torch.dtype | None = None  # an fp8 base: frozen weights as 1-byte codes (+ scales)

    @classmethod
    def of(cls, policy) -> "StateChoice":
        return cls(policy.compute_dtype, policy.master, policy.moments, policy.rounding, policy.prefetch,
                   policy.clip is not None, policy.checkpoint, policy.resident_blocks, policy.frozen_dtype)

    @property
    def compute_bytes(self) -> int:
        return torch.finfo(self.compute_dtype).bits // 8

    @property
    def frozen_bytes(self) -> int:
        """Host bytes per frozen parameter, scales aside: the compute copy, or an fp8 code."""
        return self.compute_bytes if self.frozen_dtype is None else 1


DTYPE_LABELS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def engine_footprint(blocks: list[tuple[int, int]], rest: tuple[int, int], choice: StateChoice,
                     scale_bytes: int = 0) -> Plan:
    """The weight, optimizer-state and gradient bytes of an engine (no activations), from the
    (trainable, frozen) parameter counts of each block in call order and of the rest; `scale_bytes`:
    an fp8 base's scales, where the caller knows the shapes."""
    size, per = choice.compute_bytes, trainable_bytes_per_param(choice.compute_dtype, choice.master, choice.moments, choice.rounding)
    trainable, frozen = sum(t for t, _ in blocks) + rest[0], sum(f for _, f in blocks) + rest[1]
    plan = Plan()
    label = f"persistent state ({per:.3g} B/param in {DTYPE_LABELS[choice.compute_dtype]})"
    how = "compute copy" if choice.frozen_dtype is None else "fp8 codes + scales"
    plan.host[label + (f", frozen: {how}" if frozen else "")] = int(trainable * per + frozen * choice.frozen_bytes
                                                                    + scale_bytes)
    largest_trainable = max([t for t, _ in blocks] + [rest[0]])
    plan.host["gradient staging"] = (trainable if choice.clip else 2 * largest_trainable) * size
    cut = len(blocks) - choice.resident_blocks
    streamed, resident = [t + f for t, f in blocks[:cut]], [t + f for t, f in blocks[cut:]]
    if streamed:
        in_flight = (choice.prefetch + 1) * max(streamed) if choice.checkpoint else sum(streamed)
        plan.device["weights in flight"] = in_flight * size
        if choice.frozen_dtype is not None:  # each slot's fp8 upload beside its decoded weights
            plan.device["fp8 uploads in flight"] = (choice.prefetch + 1) * max(f for _, f in blocks[:cut])
    if resident:
        plan.device[f"resident blocks ({len(resident)})"] = sum(resident) * size
    plan.device["resident weights + grads"] = (sum(rest) + rest[0]) * size
    plan.device["block gradients"] = 3 * max(t for t, _ in blocks) * size
    return plan


def engine_plan(model, blocks, policy, activation_bytes: int = 0, device_memory: int | str | None = None,
                host_memory: int | str | None = None) -> Plan:
    """The plan of `OffloadEngine(model, blocks, policy)` before it is built, against the device's
    and the host's capacity (default: the device's total and the host's MemAvailable)."""
    specs, rest = split_groups(model, blocks)
    count = lambda spec: (sum(p.numel() for _, p in spec.trainable), sum(p.numel() for _, p in spec.frozen))  # noqa: E731
    scales = 0
    if policy.frozen_dtype is not None:  # 4 bytes per scale: per output row, or per tensor
        rows = lambda p: p.shape[0] if policy.frozen_scales == "channel" and p.dim() >= 2 else 1  # noqa: E731
        scales = 4 * sum(rows(p) for spec in [*specs, rest] for _, p in spec.frozen)
    plan = engine_footprint([count(s) for s in specs], count(rest), StateChoice.of(policy), scales)
    if activation_bytes:
        plan.device["activations (given)"] = int(activation_bytes)
    plan.device_capacity = parse_bytes(device_memory, "device_memory") if device_memory is not None else device_capacity(policy.torch_device)
    plan.host_capacity = parse_bytes(host_memory, "host_memory") if host_memory is not None else available_host_memory()
    plan.check_capacity()
    return plan


def require_fit(plan: Plan) -> None:
    """The caller's fit check: a UserError with the planner's reason when `plan` does not fit."""
    if not plan.fits:
        raise UserError(f"this offload configuration {plan.verdict()}; run `slidefusion plan` to size it")


def auto_resident_blocks(model, blocks, policy, activation_bytes: int = 0, device_memory: int | str | None = None) -> int:
    """`resident_blocks=auto`: the most blocks (the last ones in call order) that can stay on the
    device beside everything else, activations included; 0 where the device's size is unknown."""
    for count in range(len(blocks), -1, -1):
        trial = dataclasses.replace(policy, resident_blocks=count)
        plan = engine_plan(model, blocks, trial, activation_bytes, device_memory, host_memory=None)
        if plan.device_capacity is None:
            return 0
        if plan.device_bytes <= plan.device_capacity:
            return count
    return 0
