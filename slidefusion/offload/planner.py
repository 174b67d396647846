"""The memory planner: what an offloaded training step needs, where, and whether it fits.

A plan is data (`Plan`): byte counts per place and per kind, PCIe traffic, a predicted step time
and the reasons it does not fit. `plan_training` builds one for a model preset and a video size
(the `slidefusion plan` command); `engine_footprint` builds the weight part for an engine from
its actual parameter counts, and the engine refuses at start a plan whose `fits` is False.

The accounting, per step with activation checkpointing at block boundaries:
  host    14 B/param persistent (fp32 master + 2 fp32 moments + compute copy), gradient staging
          (2 block buffers, or every block's gradient when clipping defers the update), and any
          boundary activations that do not fit on the device.
  device  (prefetch + 1) block buffers, the resident (non-block) weights and their gradients,
          2 block-gradient buffers, one block's gradients as autograd makes them, the boundary
          activations kept on the device, one block's recompute working set, and the attention
          workspace of the chosen operator.
  PCIe    weights up twice (forward, backward recompute), gradients down once, plus offloaded
          activations down and up once.
"""

import math
from dataclasses import dataclass, field

import torch

from slidefusion import validate
from slidefusion.errors import UserError

WORKING_VALUES_PER_TOKEN = 16  # x hidden, plus 3 x mlp_ratio: the tensors one DiT block's backward holds


def parse_bytes(text: str | float, name: str) -> int:
    """'141GB', '1.5TB', '64GiB', '55GB/s', or a plain number of bytes -> bytes >= 1 (a UserError
    naming `name` otherwise: zero, negative, NaN and infinite sizes are refused, not read as "no limit")."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        text = repr(text)
    per_second = str(text).strip().upper().endswith("/S")
    return validate.byte_size(text, name, per_second=per_second)


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} TB"


@dataclass
class Plan:
    """Bytes by place and kind, traffic, time, and why it does not fit (empty when it fits)."""

    host: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)
    host_capacity: int | None = None
    device_capacity: int | None = None
    pcie_bytes: int = 0
    step_s: float | None = None
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def fits(self) -> bool:
        return not self.problems

    def check_capacity(self) -> None:
        """Fill `problems` from the totals and capacities."""
        for place, used, capacity, parts in (("device", self.device_bytes, self.device_capacity, self.device),
                                             ("host", self.host_bytes, self.host_capacity, self.host)):
            if capacity is not None and used > capacity:
                largest = sorted(parts, key=parts.get, reverse=True)[:2]
                self.problems.append(f"{place} needs {human(used)} but has {human(capacity)} (largest parts: "
                                     + ", ".join(f"{name} {human(parts[name])}" for name in largest) + ")")

    def verdict(self) -> str:
        return "fits" if self.fits else "does not fit: " + "; ".join(self.problems)


def engine_footprint(block_numels: list[int], resident_numel: int, compute_bytes: int, prefetch: int,
                     clip: bool, checkpoint: bool = True) -> Plan:
    """The weight, optimizer-state and gradient bytes of an engine (no activations)."""
    total, largest = sum(block_numels) + resident_numel, max(block_numels)
    plan = Plan()
    plan.host["persistent state (14 B/param in bf16)"] = total * (12 + compute_bytes)
    plan.host["gradient staging"] = (total if clip else 2 * largest + resident_numel) * compute_bytes
    in_flight = (prefetch + 1) * largest if checkpoint else sum(block_numels)
    plan.device["weights in flight"] = in_flight * compute_bytes
    plan.device["resident weights + grads"] = 2 * resident_numel * compute_bytes
    plan.device["block gradients"] = 3 * largest * compute_bytes
    return plan


@dataclass(frozen=True)
class Workload:
    """One training step's input: tokens per sample after the autoencoder and patching."""

    batch: int
    tokens: int
    attention: str  # dense | window | slide
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
    if work.attention == "window":
        return b * heads * n * work.window * compute_bytes, 4.0 * b * n * work.window * hidden, f"scores inside {work.window}-token windows"
    if work.attention == "slide":  # offsets (3) and weights (1) per point, values gathered on the fly
        return b * heads * n * work.points * 4 * compute_bytes, 4.0 * b * n * work.points * hidden, f"{work.points} sampled points per query and head"
    raise UserError(f"attention={work.attention!r} is unknown; valid: dense, window, slide")


def activation_parts(config, work: Workload, compute_bytes: int = 2) -> dict[str, int]:
    """Device bytes of activations for a `ModelConfig` and workload, by kind (checkpoints included)."""
    hidden, tokens = config.hidden, work.batch * work.tokens
    blocks = config.depth * (2 if config.arch == "stdit" else 1)
    workspace, _, how = attention_workspace(work, config.heads, hidden, compute_bytes)
    return {
        "activation checkpoints": blocks * tokens * hidden * compute_bytes,  # each block's input
        "block working set": int(tokens * hidden * (WORKING_VALUES_PER_TOKEN + 3 * config.mlp_ratio) * compute_bytes),
        f"attention workspace ({how})": workspace,
    }


def plan_training(config, work: Workload, gpu_memory: int, host_memory: int, pcie_bytes_s: float, tflops: float,
                  prefetch: int = 1, compute_bytes: int = 2, mfu: float = 0.6) -> Plan:
    """The full plan for a `ModelConfig` (built on the meta device) and a workload."""
    from slidefusion.models import build_model

    model = build_model(config, "meta")
    block_numels = [sum(p.numel() for p in block.parameters()) for block in model.blocks]
    resident = sum(p.numel() for p in model.parameters()) - sum(block_numels)
    plan = engine_footprint(block_numels, resident, compute_bytes, prefetch, clip=False)
    plan.host_capacity, plan.device_capacity = host_memory, gpu_memory
    parts = activation_parts(config, work, compute_bytes)
    checkpoints = parts.pop("activation checkpoints")
    plan.device.update(parts)
    _place_checkpoints(plan, checkpoints)
    params, tokens = sum(block_numels) + resident, work.batch * work.tokens
    plan.pcie_bytes = sum(block_numels) * compute_bytes * 3 + 2 * plan.host.get("activation checkpoints", 0)
    attn_flops = attention_workspace(work, config.heads, config.hidden, compute_bytes)[1]
    flops = 4 * (2 * params * tokens + attn_flops * len(block_numels))  # forward, recompute, 2x backward
    plan.step_s = max(flops / (tflops * 1e12 * mfu), plan.pcie_bytes / pcie_bytes_s)
    plan.notes.append(f"{params / 1e9:.1f} B parameters in {len(block_numels)} blocks of {max(block_numels) / 1e9:.2f} B; "
                      f"{work.tokens} tokens per sample; step time = max(compute at {mfu:.0%} MFU, PCIe)")
    plan.check_capacity()
    return plan


def _place_checkpoints(plan: Plan, total: int) -> None:
    """Boundary activations stay on the device if they fit beside everything else, else go to host."""
    spare = plan.device_capacity - plan.device_bytes
    if total <= spare:
        plan.device["activation checkpoints"] = total
    else:
        plan.host["activation checkpoints"] = total
        plan.notes.append(f"activation checkpoints ({human(total)}) exceed the device's spare "
                          f"{human(max(spare, 0))}: offloaded to host")


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


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def largest_frames(config, work: Workload, frames: int, height: int, width: int, stride, sizes: dict) -> int:
    """The most frames (a multiple of the temporal stride, < `frames`) whose plan fits; 0 if none."""
    def fits(n: int) -> bool:
        tokens = tokens_for(n, height, width, config.patch_size, stride)
        return plan_training(config, Workload(work.batch, tokens, work.attention), **sizes).fits

    low, high = 0, frames // stride[0]  # in latent frames; fits(low) holds by convention
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid * stride[0]) else (low, mid - 1)
    return low * stride[0]
