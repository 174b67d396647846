"""The memory planner: what an offloaded training step needs, where, whether it fits, how fast.

`plan_training` builds a `Plan` for a model (`shapes.ModelShape`: a preset, Wan 2.1, a diffusers
folder) and a video size: the `slidefusion plan` command. `footprint.engine_plan` sizes an engine
from its actual parameters; the caller refuses to build one whose plan does not fit.

The accounting, per step with activation checkpointing at block boundaries:
  host    persistent state (14 B/param with fp32 master and moments; down to 4 with a bf16 master
          and 8-bit moments, see `formats`), gradient staging (2 block buffers, or every block's
          gradient when clipping defers the update), and the boundary activations that do not
          fit on the device.
  device  (prefetch + 1) slots for streamed blocks, the resident blocks, the rest of the weights
          and their gradients, block-gradient buffers, the boundary activations kept on the
          device, one block's recompute working set, and the attention workspace.
  PCIe    streamed blocks up twice (forward, backward recompute), resident ones once (after their
          update), gradients down once, offloaded activations down and up once.
  time    max(compute at an MFU, PCIe, the host AdamW's bytes at a host bandwidth): the three overlap.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch

from slidefusion.errors import UserError
from slidefusion.offload.formats import update_bytes_per_param
from slidefusion.offload.footprint import (  # noqa: F401  (re-exported: the planner's public names)
    StateChoice,
    auto_resident_blocks,
    engine_footprint,
    engine_plan,
    require_fit,
)
from slidefusion.offload.plan import Plan, available_host_memory, device_capacity, human, parse_bytes  # noqa: F401
from slidefusion.offload.shapes import ModelShape, model_shape, shape_of_config  # noqa: F401

WORKING_VALUES_PER_TOKEN = 16  # x hidden, plus 3 x mlp_ratio: the tensors one DiT block's backward holds
ATTENTIONS = ("dense", "flash", "window", "slide")
HOST_BYTES_S = 20e9  # host memory bandwidth the optimizer threads reach (a stated assumption; --host-bandwidth)


@dataclass(frozen=True)
class Workload:
    """One training step's input: tokens per sample after the autoencoder and patching."""

    batch: int
    tokens: int
    attention: str  # dense | flash | window | slide
    window: int = 4 * 8 * 8  # tokens a query sees in window attention
    points: int = 32  # sampling points per query and head in slide attention


def tokens_for(frames: int, height: int, width: int, patch: tuple[int, int, int], stride: tuple[int, int, int]) -> int:
    """Tokens of one clip: pixels / autoencoder stride / patch, rounded up on each axis."""
    return math.prod(math.ceil(n / s / p) for n, s, p in zip((frames, height, width), stride, patch))


def attention_workspace(work: Workload, heads: int, hidden: int, compute_bytes: int) -> tuple[int, float, str]:
    """(bytes, flops of one forward per block, how it was counted) of the self-attention operator."""
    n, b = work.tokens, work.batch
    if work.attention == "dense":  # materialised scores of one head at a time; flops 4 N^2 C
        return b * n * n * compute_bytes, 4.0 * b * n * n * hidden, "scores of one head (N^2) materialised"
    if work.attention == "flash":  # fused kernels (SDPA's flash / memory-efficient): a log-sum-exp per row
        return b * heads * n * 4, 4.0 * b * n * n * hidden, "flash attention, no N^2 scores"
    if work.attention == "window":
        return b * heads * n * work.window * compute_bytes, 4.0 * b * n * work.window * hidden, f"scores inside {work.window}-token windows"
    if work.attention == "slide":  # offsets (3) and weights (1) per point, values gathered on the fly
        return b * heads * n * work.points * 4 * compute_bytes, 4.0 * b * n * work.points * hidden, f"{work.points} sampled points per query and head"
    raise UserError(f"attention={work.attention!r} is unknown; valid: {', '.join(ATTENTIONS)}")


def activation_parts(shape: ModelShape, work: Workload, compute_bytes: int = 2) -> dict[str, int]:
    """Device bytes of activations for a model shape and workload, by kind (checkpoints included)."""
    hidden, tokens = shape.hidden, work.batch * work.tokens
    workspace, _, how = attention_workspace(work, shape.heads, hidden, compute_bytes)
    return {
        "activation checkpoints": len(shape.block_params) * tokens * hidden * compute_bytes,  # each block's input
        "block working set": int(tokens * hidden * (WORKING_VALUES_PER_TOKEN + 3 * shape.mlp_ratio) * compute_bytes),
        f"attention workspace ({how})": workspace,
    }


def plan_training(model, work: Workload, gpu_memory: int, host_memory: int, pcie_bytes_s: float, tflops: float,
                  prefetch: int = 1, compute_bytes: int = 2, mfu: float = 0.6, master: str = "fp32", moments: str = "fp32",
                  resident_blocks: int | str = 0, host_bytes_s: float = HOST_BYTES_S) -> Plan:
    """The full plan of one training step for a `ModelShape` (or one of our `ModelConfig`s) and a
    workload; `resident_blocks="auto"` keeps as many blocks on the device as its plan leaves room for."""
    shape = model if isinstance(model, ModelShape) else shape_of_config(model)
    dtype = {2: torch.bfloat16, 4: torch.float32}[compute_bytes]
    choice = StateChoice(dtype, master, moments, prefetch=prefetch)
    plan = _plan_with(shape, work, choice, gpu_memory, host_memory)
    if resident_blocks == "auto":
        resident_blocks = _auto_resident(shape, work, choice, gpu_memory, host_memory, plan)
    if resident_blocks:
        choice = dataclasses.replace(choice, resident_blocks=min(resident_blocks, len(shape.block_params)))
        plan = _plan_with(shape, work, choice, gpu_memory, host_memory, "activation checkpoints" in plan.host)
    _time(plan, shape, work, choice, (tflops, mfu, pcie_bytes_s, host_bytes_s))
    plan.check_capacity()
    return plan


def _plan_with(shape, work, choice, gpu_memory, host_memory, checkpoints_on_host: bool | None = None) -> Plan:
    plan = engine_footprint([(n, 0) for n in shape.block_params], (shape.rest_params, 0), choice)
    plan.host_capacity, plan.device_capacity = host_memory, gpu_memory
    parts = activation_parts(shape, work, choice.compute_bytes)
    checkpoints = parts.pop("activation checkpoints")
    plan.device.update(parts)
    spare = plan.device_capacity - plan.device_bytes
    if not (checkpoints <= spare if checkpoints_on_host is None else not checkpoints_on_host):
        plan.host["activation checkpoints"] = checkpoints
        plan.notes.append(f"activation checkpoints ({human(checkpoints)}) exceed the device's spare "
                          f"{human(max(spare, 0))}: offloaded to host" if checkpoints_on_host is None else
                          f"activation checkpoints ({human(checkpoints)}) go to host, resident blocks take the device's spare")
    else:
        plan.device["activation checkpoints"] = checkpoints
    return plan


def _auto_resident(shape, work, choice, gpu_memory, host_memory, base: Plan) -> int:
    """After activations (checkpoints placed as without residency), the most blocks that still fit."""
    on_host = "activation checkpoints" in base.host
    for count in range(len(shape.block_params), 0, -1):
        trial = _plan_with(shape, work, dataclasses.replace(choice, resident_blocks=count), gpu_memory, host_memory, on_host)
        if trial.device_bytes <= gpu_memory:
            return count
    return 0


def _time(plan: Plan, shape: ModelShape, work: Workload, choice: StateChoice, rates: tuple) -> None:
    """Step time = max(compute, PCIe, host AdamW): the transfers and the optimizer overlap compute."""
    tflops, mfu, pcie, host_rate = rates
    size, tokens, blocks = choice.compute_bytes, work.batch * work.tokens, shape.block_params
    cut = len(blocks) - choice.resident_blocks
    uploads = 2 * sum(blocks[:cut]) + sum(blocks[cut:]) + shape.rest_params  # streamed twice, resident once
    plan.pcie_bytes = (uploads + shape.params) * size + 2 * plan.host.get("activation checkpoints", 0)
    attention = attention_workspace(work, shape.heads, shape.hidden, size)[1]
    cross = 4.0 * tokens * shape.text_tokens * shape.hidden
    flops = 4 * (2 * shape.params * tokens + (attention + cross) * len(blocks))  # forward, recompute, 2x backward
    parts = {"compute": flops / (tflops * 1e12 * mfu), "PCIe": plan.pcie_bytes / pcie,
             "host AdamW": shape.params * update_bytes_per_param(choice.compute_dtype, choice.master, choice.moments,
                                                                 choice.rounding) / host_rate}
    plan.step_s = max(parts.values())
    plan.notes.append(f"{shape.params / 1e9:.2f} B parameters in {len(blocks)} blocks of {max(blocks) / 1e9:.3g} B; "
                      f"{work.tokens} tokens per sample; {choice.resident_blocks} blocks resident")
    plan.notes.append("step time = max(" + ", ".join(f"{k} {v:.3g} s" for k, v in parts.items()) + f"), assuming "
                      f"{tflops:g} TFLOP/s at {mfu:.0%} MFU, {human(pcie)}/s PCIe, host AdamW at {human(host_rate)}/s")


def report(plan: Plan, title: str) -> str:
    lines = [title]
    for place, parts, used, cap in (("host", plan.host, plan.host_bytes, plan.host_capacity),
                                    ("device", plan.device, plan.device_bytes, plan.device_capacity)):
        lines.append(f"  {place}: {human(used)}" + (f" of {human(cap)}" if cap else ""))
        lines += [f"    {name:<52} {human(size):>10}" for name, size in parts.items()]
    lines.append(f"  PCIe per step: {human(plan.pcie_bytes)}")
    if plan.step_s is not None:
        lines.append(f"  predicted step time: {plan.step_s:.3g} s")
    lines += [f"  note: {note}" for note in plan.notes]
    lines.append(f"  verdict: {plan.verdict()}")
    return "\n".join(lines)


def largest_frames(shape: ModelShape, work: Workload, frames: int, height: int, width: int, stride, sizes: dict) -> int:
    """The most frames (a multiple of the temporal stride, < `frames`) whose plan fits; 0 if none."""
    def fits(n: int) -> bool:
        tokens = tokens_for(n, height, width, shape.patch, stride)
        return plan_training(shape, Workload(work.batch, tokens, work.attention), **sizes).fits

    low, high = 0, frames // stride[0]  # in latent frames; fits(low) holds by convention
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * stride[0]) else (low, mid - 1)
    return low * stride[0]
