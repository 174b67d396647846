"""The memory planner: what an offloaded training step needs, where, whether it fits, how fast.

`plan_policy` builds a `Plan` for a model (`model_shape.ModelShape`: a preset, Wan 2.1, a diffusers
folder), one step's workload, an `OffloadPolicy` and a `Machine`: the `slidefusion plan` command,
whose flags set the policy's fields. The trainer sizes the model it will train with the same
`Sizing` and `resolve` (`resolve.fitting_policy`) and refuses a plan that does not fit.

The accounting, per step with activation checkpointing at block boundaries:
  host    persistent state (14 B/param with fp32 master and moments; down to 4 with a bf16 master
          and 8-bit moments, see `optim.formats`), gradient staging (2 block buffers, or every block's
          gradient when clipping defers the update), and the boundary activations that do not
          fit on the device, up to the host's spare room.
  disk    the boundary activations past that (`offload.spill_dir`), written and read once.
  device  (prefetch + 1) slots for streamed blocks, the resident blocks, the rest of the weights
          and their gradients, block-gradient buffers, the boundary activations kept on the
          device, one block's recompute working set (whole, or one tile: `tiling.activations`), and
          the attention workspace.
  PCIe    streamed blocks up twice (forward, backward recompute), resident ones once (after their
          update), gradients down once, offloaded activations down and up once.
  time    max(compute at an MFU, PCIe, the host AdamW's bytes at a host bandwidth, disk traffic at
          the disk's bandwidth): the four overlap.
`auto` values (tile, resident blocks) are resolved by `resolve.resolve`.
"""

import dataclasses
import math
from dataclasses import dataclass

from slidefusion.errors import UserError
from slidefusion.offload.optim.formats import update_bytes_per_param
from slidefusion.offload.plan.model_shape import ModelShape, shape_of_config
from slidefusion.offload.plan.plan import Plan, human
from slidefusion.offload.plan.resolve import resolve
from slidefusion.offload.plan.sizing import Sizing
from slidefusion.offload.policy import AUTO, OffloadPolicy
from slidefusion.offload.tiling.activations import CHECKPOINTS, Workload, attention_workspace, tiling_flops

HOST_BYTES_S = 20e9  # host memory bandwidth the optimizer threads reach (a stated assumption; --host-bandwidth)


@dataclass(frozen=True)
class Machine:
    """The hardware a plan is made for: capacities in bytes (None: no limit), rates in bytes/s and TFLOP/s."""

    gpu_memory: int | None
    host_memory: int | None
    pcie_bytes_s: float
    tflops: float  # dense TFLOP/s of the device in the compute dtype
    mfu: float = 0.6  # the fraction of `tflops` a step reaches
    host_bytes_s: float = HOST_BYTES_S
    disk: int | None = None  # bytes free for spilled checkpoints (None: no spilling)
    disk_bytes_s: float | None = None


def tokens_for(frames: int, height: int, width: int, patch: tuple[int, int, int], stride: tuple[int, int, int]) -> int:
    """Tokens of one clip: pixels / autoencoder stride / patch, rounded up on each axis."""
    return math.prod(grid_for(frames, height, width, patch, stride))


def grid_for(frames: int, height: int, width: int, patch, stride) -> tuple[int, int, int]:
    """The token grid (T', H', W') of one clip, rounded up on each axis."""
    return tuple(math.ceil(n / s / p) for n, s, p in zip((frames, height, width), stride, patch))


def plan_policy(model, work: Workload, policy: OffloadPolicy, machine: Machine) -> Plan:
    """The full plan of one training step for a `ModelShape` (or one of our `ModelConfig`s), a
    workload, an `OffloadPolicy` (its `auto` values resolved here) and a `Machine`."""
    shape = model if isinstance(model, ModelShape) else shape_of_config(model)
    if policy.tile not in (None, AUTO) and not shape.tileable:
        raise UserError(f"--tile={policy.tile}: the blocks of {shape.name} cannot be tiled (the halo of their attention "
                        "is unknown; tileable: ours and Wan); use --tile off or auto")
    if isinstance(policy.resident_blocks, int):
        policy = dataclasses.replace(policy, resident_blocks=min(policy.resident_blocks, len(shape.block_params)))
    sizing = Sizing.of_shape(shape, work, machine.gpu_memory, machine.host_memory, machine.disk)
    policy = resolve(policy, sizing)
    plan = sizing.plan(policy)
    if policy.tile is not None and policy.tile >= work.frames:
        plan.notes.append(f"a tile of {policy.tile} frames covers the clip's {work.frames}: clamped, whole blocks")
    _time(plan, shape, work, policy, machine)
    return plan


def plan_training(model, work: Workload, gpu_memory: int, host_memory: int, pcie_bytes_s: float, tflops: float,
                  prefetch: int = 1, compute_bytes: int = 2, mfu: float = 0.6, master: str = "fp32", moments: str = "fp32",
                  resident_blocks: int | str = 0, host_bytes_s: float = HOST_BYTES_S, tile: int | str | None = None,
                  disk: int | None = None, disk_bytes_s: float | None = None) -> Plan:
    """`plan_policy` with the policy's and the machine's fields as keywords (`compute_bytes` 2:
    bfloat16, 4: float32); `resident_blocks` and `tile` take "auto"."""
    policy = OffloadPolicy(compute_dtype={2: "bfloat16", 4: "float32"}[compute_bytes], master=master, moments=moments,
                           prefetch=prefetch, resident_blocks=resident_blocks, tile=tile)
    machine = Machine(gpu_memory, host_memory, pcie_bytes_s, tflops, mfu, host_bytes_s, disk, disk_bytes_s)
    return plan_policy(model, work, policy, machine)


def _time(plan: Plan, shape: ModelShape, work: Workload, policy: OffloadPolicy, machine: Machine) -> None:
    """Step time = max(compute, PCIe, host AdamW, disk): the transfers and the optimizer overlap compute."""
    tflops, mfu, pcie, host_rate, disk_rate = (machine.tflops, machine.mfu, machine.pcie_bytes_s, machine.host_bytes_s,
                                               machine.disk_bytes_s)
    size, tokens, blocks = policy.compute_bytes, work.batch * work.tokens, shape.block_params
    cut = len(blocks) - policy.resident_blocks
    uploads = 2 * sum(blocks[:cut]) + sum(blocks[cut:]) + shape.rest_params  # streamed twice, resident once
    off_device = plan.host.get(CHECKPOINTS, 0) + sum(plan.disk.values())
    plan.pcie_bytes = (uploads + shape.params) * size + 2 * off_device
    plan.disk_traffic = 2 * sum(plan.disk.values())  # written in forward, read in backward
    attention = attention_workspace(work, shape.heads, shape.hidden, size)[1]
    cross = 4.0 * tokens * shape.text_tokens * shape.hidden
    tiling = tiling_flops(shape, work, plan.tile, attention) * len(blocks)
    flops = 4 * (2 * shape.params * tokens + (attention + cross) * len(blocks)) + tiling  # forward, recompute, 2x backward
    parts = {"compute": flops / (tflops * 1e12 * mfu), "PCIe": plan.pcie_bytes / pcie,
             "host AdamW": shape.params * update_bytes_per_param(policy.dtype, policy.master, policy.moments,
                                                                 policy.rounding) / host_rate}
    if plan.disk_traffic:
        parts["disk"] = plan.disk_traffic / disk_rate if disk_rate else math.inf
    plan.step_s, plan.flops = max(parts.values()), flops
    plan.notes.append(f"{shape.params / 1e9:.2f} B parameters in {len(blocks)} blocks of {max(blocks) / 1e9:.3g} B; "
                      f"{work.tokens} tokens per sample; {policy.resident_blocks} blocks resident")
    extra = f"; tiling adds {tiling:.3g}: {_tiling_work(work)}" if tiling else ""
    plan.notes.append(f"{flops:.3g} FLOP per step ({6 * shape.params * tokens:.3g} of them 6 x params x tokens; forward, "
                      f"recompute and backward, attention included{extra})")
    plan.notes.append("step time = max(" + ", ".join(f"{k} {v:.3g} s" for k, v in parts.items()) + f"), assuming "
                      f"{tflops:g} TFLOP/s at {mfu:.0%} MFU, {human(pcie)}/s PCIe, host AdamW at {human(host_rate)}/s"
                      + (f", disk at {human(disk_rate)}/s" if plan.disk_traffic and disk_rate else ""))


def _tiling_work(work: Workload) -> str:
    return ("the keys and values of every tile computed before its queries" if work.halo() is None
            else "halo frames computed twice")


def report(plan: Plan, title: str) -> str:
    lines = [title]
    places = [("host", plan.host, plan.host_capacity), ("device", plan.device, plan.device_capacity)]
    if plan.disk or plan.disk_capacity:
        places.append(("disk", plan.disk, plan.disk_capacity))
    for place, parts, cap in places:
        lines.append(f"  {place}: {human(sum(parts.values()))}" + (f" of {human(cap)}" if cap else ""))
        lines += [f"    {name:<60} {human(size):>10}" for name, size in parts.items()]
    tiling = (f"{plan.tile} frames per tile, {human(plan.tile_device_bytes)} of device memory per tile"
              if plan.tile else "off (whole blocks)")
    lines.append(f"  tiling: {tiling}")
    lines.append(f"  PCIe per step: {human(plan.pcie_bytes)}")
    if plan.disk or plan.disk_capacity:
        lines.append(f"  disk per step: {human(sum(plan.disk.values()))} spilled, {human(plan.disk_traffic)} of traffic")
    if plan.step_s is not None:
        lines.append(f"  predicted step time: {plan.step_s:.3g} s ({plan.flops:.3g} FLOP)")
    lines += [f"  note: {note}" for note in plan.notes]
    lines.append(f"  verdict: {plan.verdict()}")
    return "\n".join(lines)


def valid_frames(latent_frames: int, stride) -> int:
    """Pixel frames of `latent_frames` latent frames through a causal video VAE of temporal stride
    `stride[0]` (Wan, CogVideoX, HunyuanVideo, LTX, ours): 1 + t*k, the only lengths it accepts."""
    return 1 + stride[0] * (latent_frames - 1)


def largest_frames(shape: ModelShape, work: Workload, policy: OffloadPolicy, machine: Machine, pixels: tuple[int, int, int],
                   stride) -> int:
    """The most frames (1 + t*k for the temporal stride t, < `frames` of `pixels` (frames, height,
    width)) whose plan fits; 0 if none."""
    frames, height, width = pixels

    def fits(latent: int) -> bool:
        grid = grid_for(valid_frames(latent, stride), height, width, shape.patch, stride)
        return plan_policy(shape, dataclasses.replace(work, tokens=math.prod(grid), frames=grid[0]), policy, machine).fits

    low, high = 0, (frames - 2) // stride[0] + 1  # in latent frames, below `frames`; fits(low) holds by convention
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return valid_frames(low, stride) if low else 0
