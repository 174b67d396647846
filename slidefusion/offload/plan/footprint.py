"""The engine's own footprint: weights, optimizer state and gradient buffers, on the host and the device.

`engine_plan` sizes an `OffloadEngine(model, blocks, policy)` before it is built, from the model's
actual parameter counts; the caller checks it with `require_fit` (the engine does not).
"""

import torch
from torch import nn

from slidefusion.errors import UserError
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


def engine_footprint(blocks: list[Counts], rest: Counts, policy) -> Plan:
    """The weight, optimizer-state and gradient bytes of an engine (no activations) for an
    `OffloadPolicy` whose `resident_blocks` is a number, from the (trainable, frozen) parameter
    counts of each block in call order and of the rest."""
    dtype = policy.dtype
    size, per = policy.compute_bytes, trainable_bytes_per_param(dtype, policy.master, policy.moments, policy.rounding)
    trainable, frozen = sum(t for t, _ in blocks) + rest[0], sum(f for _, f in blocks) + rest[1]
    plan = Plan()
    label = f"persistent state ({per:.3g} B/param in {DTYPE_LABELS[dtype]})"
    plan.host[label + (", frozen: compute copy" if frozen else "")] = int(trainable * per + frozen * size)
    largest_trainable = max([t for t, _ in blocks] + [rest[0]])
    plan.host["gradient staging"] = (trainable if policy.clip is not None else 2 * largest_trainable) * size
    cut = len(blocks) - policy.resident_blocks
    streamed, resident = [t + f for t, f in blocks[:cut]], [t + f for t, f in blocks[cut:]]
    if streamed:
        in_flight = (policy.prefetch + 1) * max(streamed) if policy.checkpoint else sum(streamed)
        plan.device["weights in flight"] = in_flight * size
    if resident:
        plan.device[f"resident blocks ({len(resident)})"] = sum(resident) * size
    plan.device["resident weights + grads"] = (sum(rest) + rest[0]) * size
    plan.device["block gradients"] = 3 * max(t for t, _ in blocks) * size
    return plan


def engine_plan(model, blocks, policy, activation_bytes: int = 0, device_memory: int | str | None = None,
                host_memory: int | str | None = None) -> Plan:
    """The plan of `OffloadEngine(model, blocks, policy)` before it is built, against the device's
    and the host's capacity (default: the device's total and the host's MemAvailable)."""
    plan = engine_footprint(*parameter_counts(model, blocks), policy)
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
