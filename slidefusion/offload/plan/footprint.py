"""The engine's own footprint: weights, optimizer state and gradient buffers, on the host and the device.

`engine_plan` sizes an `OffloadEngine(model, blocks, policy)` before it is built, from the model's
actual parameter counts; the caller checks it with `require_fit` (the engine does not).
"""

import torch
from torch import nn

from slidefusion.core.errors import UserError
from slidefusion.offload.engine.layout import split_groups
from slidefusion.offload.optim.formats import trainable_bytes_per_param
from slidefusion.offload.plan.plan import Plan, available_host_memory, device_capacity, parse_bytes

DTYPE_LABELS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
Counts = tuple[int, int]  # (trainable, frozen) parameters of one group


def parameter_counts(model: nn.Module, blocks) -> tuple[list[Counts], Counts]:
    """(trainable, frozen) parameters of each block in call order, and of the rest of `model`."""
    specs, rest = split_groups(model, blocks)
    count = lambda spec: (sum(p.numel() for _, p in spec.trainable), sum(p.numel() for _, p in spec.frozen))  # noqa: E731
    return [count(s) for s in specs], count(rest)


def frozen_scale_counts(model: nn.Module, blocks) -> dict[str, int]:
    """How many float32 scales an fp8 base of `model`'s frozen parameters holds, per `frozen_scales`
    choice: "channel" (one per output row of a 2-D or larger weight, one per 1-D one) or "tensor"."""
    specs, rest = split_groups(model, blocks)
    frozen = [p for spec in [*specs, rest] for _, p in spec.frozen]
    return {"channel": sum(p.shape[0] if p.dim() >= 2 else 1 for p in frozen), "tensor": len(frozen)}


def engine_footprint(blocks: list[Counts], rest: Counts, policy, scales: dict[str, int] | None = None) -> Plan:
    """The weight, optimizer-state and gradient bytes of an engine (no activations) for an
    `OffloadPolicy` whose `resident_blocks` is a number, from the (trainable, frozen) parameter
    counts of each block in call order and of the rest. With an fp8 base (`policy.frozen_dtype`) the
    frozen parameters take 1 byte each plus 4 per scale (`scales`: `frozen_scale_counts`; None: 0)."""
    dtype = policy.dtype
    size, per = policy.compute_bytes, trainable_bytes_per_param(dtype, policy.master, policy.moments, policy.rounding)
    trainable, frozen = sum(t for t, _ in blocks) + rest[0], sum(f for _, f in blocks) + rest[1]
    fp8 = policy.frozen_dtype is not None
    frozen_bytes = frozen * size if not fp8 else frozen + 4 * (scales or {}).get(policy.frozen_scales, 0)
    plan = Plan()
    label = f"persistent state ({per:.3g} B/param in {DTYPE_LABELS[dtype]})"
    how = "fp8 codes + scales" if fp8 else "compute copy"
    plan.host[label + (f", frozen: {how}" if frozen else "")] = int(trainable * per + frozen_bytes)
    largest_trainable = max([t for t, _ in blocks] + [rest[0]])
    plan.host["gradient staging"] = (trainable if policy.clip is not None else 2 * largest_trainable) * size
    cut = len(blocks) - policy.resident_blocks
    streamed, resident = [t + f for t, f in blocks[:cut]], [t + f for t, f in blocks[cut:]]
    if streamed:
        in_flight = (policy.prefetch + 1) * max(streamed) if policy.checkpoint else sum(streamed)
        plan.device["weights in flight"] = in_flight * size
        if fp8:  # each slot's fp8 upload beside its decoded weights
            plan.device["fp8 uploads in flight"] = (policy.prefetch + 1) * max(f for _, f in blocks[:cut])
    if resident:
        plan.device[f"resident blocks ({len(resident)})"] = sum(resident) * size
    plan.device["resident weights + grads"] = (sum(rest) + rest[0]) * size
    plan.device["block gradients"] = 3 * max(t for t, _ in blocks) * size
    return plan


def engine_plan(model, blocks, policy, activation_bytes: int = 0, device_memory: int | str | None = None,
                host_memory: int | str | None = None) -> Plan:
    """The plan of `OffloadEngine(model, blocks, policy)` before it is built, against the device's
    and the host's capacity (default: the device's total and the host's MemAvailable)."""
    scales = frozen_scale_counts(model, blocks) if policy.frozen_dtype is not None else None
    plan = engine_footprint(*parameter_counts(model, blocks), policy, scales)
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
