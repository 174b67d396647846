"""The memory planner: what an offloaded training step needs, where, whether it fits, how fast.

`plan_training` builds a `Plan` for a model (`shapes.ModelShape`: a preset, Wan 2.1, a diffusers
folder) and a video size: the `slidefusion plan` command. `footprint.engine_plan` sizes an engine
from its actual parameters; the caller refuses to build one whose plan does not fit.

The accounting, per step with activation checkpointing at block boundaries:
  host    persistent state (14 B/param with fp32 master and moments; down to 4 with a bf16 master
          and 8-bit moments, see `formats`), gradient staging (2 block buffers, or every block's
          gradient when clipping defers the update), and the boundary activations that do not
          fit on the device, up to the host's spare room.
  disk    the boundary activations past that (`offload.spill_dir`), written and read once.
  device  (prefetch + 1) slots for streamed blocks, the resident blocks, the rest of the weights
          and their gradients, block-gradient buffers, the boundary activations kept on the
          device, one block's recompute working set (whole, or one tile: `activations`), and
          the attention workspace.
  PCIe    streamed blocks up twice (forward, backward recompute), resident ones once (after their
          update), gradients down once, offloaded activations down and up once.
  time    max(compute at an MFU, PCIe, the host AdamW's bytes at a host bandwidth, disk traffic at
          the disk's bandwidth): the four overlap.
`tile="auto"` keeps whole blocks when they fit and otherwise takes the largest tile that does.
"""

import dataclasses
import math

import torch

from slidefusion.errors import UserError
from slidefusion.offload.activations import (  # noqa: F401  (re-exported)
    ATTENTIONS,
    CHECKPOINTS,
    WORKING_VALUES_PER_TOKEN,
    Workload,
    activation_parts,
    attention_workspace,
    halo_flops_factor,
    tiling_flops,
    place_checkpoints,
)
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

HOST_BYTES_S = 20e9  # host memory bandwidth the optimizer threads reach (a stated assumption; --host-bandwidth)


def tokens_for(frames: int, height: int, width: int, patch: tuple[int, int, int], stride: tuple[int, int, int]) -> int:
    """Tokens of one clip: pixels / autoencoder stride / patch, rounded up on each axis."""
    return math.prod(grid_for(frames, height, width, patch, stride))


def grid_for(frames: int, height: int, width: int, patch, stride) -> tuple[int, int, int]:
    """The token grid (T', H', W') of one clip, rounded up on each axis."""
    return tuple(math.ceil(n / s / p) for n, s, p in zip((frames, height, width), stride, patch))


def plan_training(model, work: Workload, gpu_memory: int, host_memory: int, pcie_bytes_s: float, tflops: float,
                  prefetch: int = 1, compute_bytes: int = 2, mfu: float = 0.6, master: str = "fp32", moments: str = "fp32",
                  resident_blocks: int | str = 0, host_bytes_s: float = HOST_BYTES_S, tile: int | str | None = None,
                  disk: int | None = None, disk_bytes_s: float | None = None) -> Plan:
    """The full plan of one training step for a `ModelShape` (or one of our `ModelConfig`s) and a
    workload; `resident_blocks="auto"` keeps as many blocks on the device as its plan leaves room
    for; `tile` frames per tile (None: whole blocks, "auto": whole if they fit, else the largest
    tile that does); `disk` bytes free for spilled checkpoints (None: no spilling)."""
    shape = model if isinstance(model, ModelShape) else shape_of_config(model)
    dtype = {2: torch.bfloat16, 4: torch.float32}[compute_bytes]
    choice = StateChoice(dtype, master, moments, prefetch=prefetch)
    space = (gpu_memory, host_memory, disk)
    if tile is not None and not shape.tileable:
        if tile != "auto":
            raise UserError(f"--tile={tile}: the blocks of {shape.name} cannot be tiled (the halo of their attention is "
                            "unknown; tileable: ours and Wan); use --tile off or auto")
        tile = None  # auto: whole blocks
    if tile == "auto":
        tile = _auto_tile(shape, work, choice, space)
    plan = _plan_with(shape, work, choice, space, tile)
    if tile is not None and tile >= work.frames:
        plan.notes.append(f"a tile of {tile} frames covers the clip's {work.frames}: clamped, whole blocks")
    if resident_blocks == "auto":
        resident_blocks = _auto_resident(shape, work, choice, space, tile, plan)
    if resident_blocks:
        choice = dataclasses.replace(choice, resident_blocks=min(resident_blocks, len(shape.block_params)))
        plan = _plan_with(shape, work, choice, space, tile, CHECKPOINTS not in plan.device)
    _time(plan, shape, work, choice, (tflops, mfu, pcie_bytes_s, host_bytes_s, disk_bytes_s))
    plan.check_capacity()
    return plan


def _plan_with(shape, work, choice, space, tile, off_device: bool | None = None) -> Plan:
    """The plan for one choice; `off_device` forces the checkpoints' placement (None: by room)."""
    plan = engine_footprint([(n, 0) for n in shape.block_params], (shape.rest_params, 0), choice)
    plan.device_capacity, plan.host_capacity, plan.disk_capacity = space
    plan.tile = tile if tile is not None and tile < work.frames else None
    parts = activation_parts(shape, work, choice.compute_bytes, plan.tile)
    checkpoints = parts.pop(CHECKPOINTS)
    plan.device.update(parts)
    spare = None if plan.device_capacity is None else plan.device_capacity - plan.device_bytes
    if off_device is not None:  # residency trials keep the checkpoints where the plan without residency put them
        spare = -1 if off_device else None
    place_checkpoints(plan, checkpoints, plan.disk_capacity, spare)
    if plan.tile:
        plan.tile_device_bytes = sum(v for k, v in parts.items() if "tile" in k)
    return plan


def _auto_tile(shape, work, choice, space) -> int | None:
    """None when whole blocks fit on the device; else the largest tile (frames) that fits; else 1."""
    def device_fits(tile):
        plan = _plan_with(shape, work, choice, space, tile)
        return plan.device_capacity is None or plan.device_bytes <= plan.device_capacity

    if device_fits(None):
        return None
    low, high = 1, work.frames - 1  # device bytes grow with the tile: bisect for the largest that fits
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if device_fits(mid) else (low, mid - 1)
    return low


def _auto_resident(shape, work, choice, space, tile, base: Plan) -> int:
    """After activations (checkpoints placed as without residency), the most blocks that still fit."""
    off_device = CHECKPOINTS not in base.device
    for count in range(len(shape.block_params), 0, -1):
        trial = _plan_with(shape, work, dataclasses.replace(choice, resident_blocks=count), space, tile, off_device)
        if trial.device_bytes <= space[0]:
            return count
    return 0


def _time(plan: Plan, shape: ModelShape, work: Workload, choice: StateChoice, rates: tuple) -> None:
    """Step time = max(compute, PCIe, host AdamW, disk): the transfers and the optimizer overlap compute."""
    tflops, mfu, pcie, host_rate, disk_rate = rates
    size, tokens, blocks = choice.compute_bytes, work.batch * work.tokens, shape.block_params
    cut = len(blocks) - choice.resident_blocks
    uploads = 2 * sum(blocks[:cut]) + sum(blocks[cut:]) + shape.rest_params  # streamed twice, resident once
    off_device = plan.host.get(CHECKPOINTS, 0) + sum(plan.disk.values())
    plan.pcie_bytes = (uploads + shape.params) * size + 2 * off_device
    plan.disk_traffic = 2 * sum(plan.disk.values())  # written in forward, read in backward
    attention = attention_workspace(work, shape.heads, shape.hidden, size)[1]
    cross = 4.0 * tokens * shape.text_tokens * shape.hidden
    tiling = tiling_flops(shape, work, plan.tile, attention) * len(blocks)
    flops = 4 * (2 * shape.params * tokens + (attention + cross) * len(blocks)) + tiling  # forward, recompute, 2x backward
    parts = {"compute": flops / (tflops * 1e12 * mfu), "PCIe": plan.pcie_bytes / pcie,
             "host AdamW": shape.params * update_bytes_per_param(choice.compute_dtype, choice.master, choice.moments,
                                                                 choice.rounding) / host_rate}
    if plan.disk_traffic:
        parts["disk"] = plan.disk_traffic / disk_rate if disk_rate else math.inf
    plan.step_s, plan.flops = max(parts.values()), flops
    plan.notes.append(f"{shape.params / 1e9:.2f} B parameters in {len(blocks)} blocks of {max(blocks) / 1e9:.3g} B; "
                      f"{work.tokens} tokens per sample; {choice.resident_blocks} blocks resident")
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


def largest_frames(shape: ModelShape, work: Workload, frames: int, height: int, width: int, stride, sizes: dict) -> int:
    """The most frames (1 + t*k for the temporal stride t, < `frames`) whose plan fits; 0 if none."""
    def fits(latent: int) -> bool:
        grid = grid_for(valid_frames(latent, stride), height, width, shape.patch, stride)
        return plan_training(shape, dataclasses.replace(work, tokens=math.prod(grid), frames=grid[0]), **sizes).fits

    low, high = 0, (frames - 2) // stride[0] + 1  # in latent frames, below `frames`; fits(low) holds by convention
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return valid_frames(low, stride) if low else 0
