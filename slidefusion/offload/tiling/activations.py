"""Activation memory of one training step, whole or tiled, and where the checkpoints go.

Per step, with activation checkpointing at block boundaries (bytes in the compute dtype):
  checkpoints      every block's input, one grid (B, T, H, W, C) each: on the device if they fit
                   beside everything else, else host memory up to its spare room, the rest on disk
                   (`offload.spill_dir`; disk traffic: written once, read once).
  working set      what one block's recompute and backward hold at once: WORKING_VALUES_PER_TOKEN
                   plus 3 x mlp_ratio values per token, over the whole clip; tiled (`offload.tile`),
                   over one tile and its halo, beside the block's input, output and their gradients,
                   which stay whole (and, for dense attention, the keys and values of the whole clip
                   with their float32 gradients).
  attention        the operator's workspace over the tokens one call sees: the clip, a tile plus
                   its halo, or (dense, tiled) one tile's queries against every key.
The halo is the one the operators declare (`slidefusion.attention.tiling`), for their default sizes.
"""

import math
from dataclasses import dataclass, replace

from slidefusion.attention.registry import memory_models
from slidefusion.attention.tiling import slide_halo, window_rule
from slidefusion.core.errors import unknown_value

WORKING_VALUES_PER_TOKEN = 16  # x hidden, plus 3 x mlp_ratio: the tensors one DiT block's backward holds
ATTENTIONS = memory_models()  # the activation models below, one per kind the attention registry declares
CHECKPOINTS = "activation checkpoints"


@dataclass(frozen=True)
class Workload:
    """One training step's input: tokens per sample after the autoencoder and patching, over
    `frames` frames of the token grid (what tiles cut)."""

    batch: int
    tokens: int
    attention: str  # dense | flash | window | slide
    window: int = 4 * 8 * 8  # tokens a query sees in window attention
    points: int = 32  # sampling points per query and head in slide attention
    frames: int = 1
    window_frames: int = 4  # the temporal extent of those windows (slide: kt of its 3x7x7 default...
    slide_frames: int = 3  # ...and its max_offset)
    max_offset: float = 0.9

    def halo(self) -> int | None:
        """Frames of context a tile needs each side; None: dense (every key, no halo)."""
        if self.attention == "slide":
            return slide_halo(self.slide_frames, self.max_offset)
        if self.attention == "window":
            return window_rule(self.window_frames, shifted=True).halo
        return None


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
    raise unknown_value("attention", work.attention, ATTENTIONS)


def activation_parts(shape, work: Workload, compute_bytes: int = 2, tile: int | None = None) -> dict[str, int]:
    """Device bytes of activations for a `ModelShape` and workload, by kind (checkpoints included),
    whole (`tile=None`, or a tile that covers the clip) or `tile` frames per tile."""
    hidden, tokens, size = shape.hidden, work.batch * work.tokens, compute_bytes
    per_token = hidden * (WORKING_VALUES_PER_TOKEN + 3 * shape.mlp_ratio) * size
    parts = {CHECKPOINTS: len(shape.block_params) * tokens * hidden * size}  # each block's input
    if tile is None or tile >= work.frames:
        workspace, _, how = attention_workspace(work, shape.heads, hidden, size)
        return {**parts, "block working set": int(tokens * per_token), f"attention workspace ({how})": workspace}
    halo, per_frame = work.halo(), work.tokens / work.frames
    span = tile if halo is None else min(work.frames, tile + 2 * halo)
    parts["block input, output and their gradients (whole clip)"] = 4 * tokens * hidden * size
    label = f"block working set (tile of {tile} frames" + (f" + 2 x {halo} halo)" if halo else ")")
    parts[label] = int(work.batch * span * per_frame * per_token)
    if halo is None:
        parts["keys and values of the whole clip, and their fp32 gradients"] = tokens * hidden * (2 * size + 2 * 4)
        queries = replace(work, tokens=math.ceil(tile * per_frame))
        workspace, _, how = attention_workspace(queries, shape.heads, hidden, size)
        workspace = workspace * work.tokens // queries.tokens if work.attention == "dense" else workspace
        parts[f"attention workspace ({how}; {tile}-frame query tiles)"] = workspace
    else:
        workspace, _, how = attention_workspace(replace(work, tokens=math.ceil(span * per_frame)), shape.heads, hidden, size)
        parts[f"attention workspace ({how}; one tile + halo)"] = workspace
    return parts


def halo_flops_factor(work: Workload, tile: int | None) -> float:
    """Extra attention and QKV work of tiling, as a fraction (halo frames computed twice)."""
    halo = work.halo()
    if tile is None or tile >= work.frames or not halo:
        return 0.0
    return (min(work.frames, tile + 2 * halo) - tile) / tile


def tiling_flops(shape, work: Workload, tile: int | None, attention_flops: float) -> float:
    """Extra FLOP per block and step of tiling (`attention_flops`: one forward's attention): halo
    frames computed twice (attention and QKV; forward, recompute and 2x backward), or, for dense
    query tiles, `shape.query_tile_projections` d x d projections per token again (the key/value
    pre-pass and the stock processor's unused projections)."""
    if tile is None or tile >= work.frames:
        return 0.0
    tokens = work.batch * work.tokens
    if work.halo() is None:
        return 2.0 * shape.query_tile_projections * shape.hidden ** 2 * tokens
    return 4 * halo_flops_factor(work, tile) * (attention_flops + 2 * 3 * shape.hidden ** 2 * tokens)


def place_checkpoints(plan, checkpoints: int, disk: int | None, device_spare: int | None) -> None:
    """On the device if they fit in its `device_spare` bytes (None: no limit), else host memory up
    to its spare room and the rest on `disk` (bytes free there; None: no disk, all on the host)."""
    if device_spare is None or checkpoints <= device_spare:
        plan.device[CHECKPOINTS] = checkpoints
        return
    host_spare = max(0, plan.host_capacity - plan.host_bytes) if plan.host_capacity else checkpoints
    on_host = checkpoints if disk is None else min(checkpoints, host_spare)
    if on_host:
        plan.host[CHECKPOINTS] = on_host
    if checkpoints > on_host:
        plan.disk[CHECKPOINTS + " (spilled)"] = checkpoints - on_host
    plan.notes.append(f"activation checkpoints ({_gb(checkpoints)}) do not fit in the device's spare {_gb(max(device_spare, 0))}: "
                      f"{_gb(on_host)} in host memory" + (f", {_gb(checkpoints - on_host)} spilled to disk "
                                                          f"(offload.spill_after={math.floor(on_host / 1e8) / 10:g}GB)" if checkpoints > on_host else ""))


def _gb(n: float) -> str:
    return f"{n / 1e9:.3g} GB"
