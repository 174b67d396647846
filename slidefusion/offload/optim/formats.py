"""How one group's master weights and AdamW moments are stored on the host (bytes per trainable parameter).

    master fp32           4   the weights AdamW updates
    master bf16           2   stochastic rounding; with bf16 compute it IS the compute copy (0 extra)
    master bf16 + kahan   4   a bf16 compensation term keeps what rounding dropped (value = hi + lo)
    moments fp32          8   exp_avg, exp_avg_sq
    moments bf16          4   stochastic rounding
    moments int8          2   + an fp32 absmax per block of <= 2048 values: blockwise dynamic
                              quantization as in 8-bit Adam (see lean_kernels.c for the map);
                              blocks never straddle two parameters

Add the compute copy (2 B in bf16) unless it is the master. Frozen parameters hold the compute copy only.
"""

import torch

from slidefusion.offload.engine.layout import Layout

QBLOCK = 2048  # values per int8 quantization block (as in 8-bit Adam)
# `allocate(numel, dtype, dma)` below returns an empty 1-D host tensor (see `engine.pinning.HostAllocator`);
# dma=False: only the CPU reads it, so it is never page-locked.


class MasterWeights:
    """The weights AdamW updates, over a group's trainable prefix."""

    def __init__(self, kind: str, rounding: str, n: int, compute: torch.Tensor, allocate):
        self.kind = kind
        self.kahan = kind == "bf16" and rounding == "kahan"
        dtype = torch.float32 if kind == "fp32" else torch.bfloat16
        # with a compute copy of the master's dtype the two are one buffer (the optimizer writes it once)
        self.is_compute = compute.dtype == dtype
        self.value = compute[:n] if self.is_compute else allocate(n, dtype, False)
        self.comp = allocate(n, torch.bfloat16, False).zero_() if self.kahan else None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The persistent state, keyed as in `state_dict`."""
        return {"master": self.value} if self.comp is None else {"master": self.value, "master_comp": self.comp}

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for name, t in self.tensors().items()
                   if not (name == "master" and self.is_compute))


class Moments:
    """AdamW's first and second moments over a group's trainable prefix."""

    def __init__(self, kind: str, layout: Layout, n: int, allocate, span: tuple[int, int] | None = None):
        """Over the first `n` values of `layout`, or (`span`, a data-parallel shard cut at block
        starts) over values [lo, hi) of them, with block starts counted from lo."""
        self.kind = kind
        lo, hi = span or (0, n)
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[kind]
        self.exp_avg, self.exp_avg_sq = allocate(hi - lo, dtype, False).zero_(), allocate(hi - lo, dtype, False).zero_()
        self.starts = self.scales = None
        if kind == "int8":
            starts = block_starts(layout, n)
            self.starts = torch.cat([starts[(starts >= lo) & (starts < hi)], torch.tensor([hi])]) - lo
            blocks = self.starts.numel() - 1
            self.scales = allocate(2 * blocks, torch.float32, False).zero_()  # absmax of m, then of v

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}
        return out if self.scales is None else {**out, "scales": self.scales}

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    @property
    def exp_avg_scale(self) -> torch.Tensor | None:
        return None if self.scales is None else self.scales[:self.starts.numel() - 1]

    @property
    def exp_avg_sq_scale(self) -> torch.Tensor | None:
        return None if self.scales is None else self.scales[self.starts.numel() - 1:]


def block_starts(layout: Layout, n: int) -> torch.Tensor:
    """Start offsets of the quantization blocks over the first `n` values of `layout`, and `n` at
    the end: each parameter is cut into blocks of QBLOCK values from its own start."""
    starts = []
    for entry in layout.entries:
        if entry.offset >= n:
            break
        starts += range(entry.offset, entry.offset + entry.numel, QBLOCK)
    return torch.tensor([*starts, n], dtype=torch.int64)


def trainable_bytes_per_param(compute_dtype: torch.dtype, master: str, moments: str, rounding: str) -> float:
    """Persistent host bytes of one trainable parameter (compute copy, master, moments): the one
    definition the planner uses; an engine reports what it actually allocated."""
    compute = torch.finfo(compute_dtype).bits // 8
    if master == "fp32":  # the compute copy itself when that is fp32
        weights = 4 + (0 if compute_dtype == torch.float32 else compute)
    else:  # bf16: the compute copy itself when that is bf16
        weights = 2 + (0 if compute_dtype == torch.bfloat16 else compute) + (2 if rounding == "kahan" else 0)
    return weights + {"fp32": 8, "bf16": 4, "int8": 2 + 2 * 4 / QBLOCK}[moments]


def update_bytes_per_param(compute_dtype: torch.dtype, master: str, moments: str, rounding: str) -> float:
    """Bytes one AdamW update moves per trainable parameter: the gradient in, master and moments in
    and out, the compute copy out (unless it is the master)."""
    compute = torch.finfo(compute_dtype).bits // 8
    weights = 4 if master == "fp32" else (4 if rounding == "kahan" else 2)
    separate_copy = compute_dtype != (torch.float32 if master == "fp32" else torch.bfloat16)
    return compute + 2 * weights + 2 * {"fp32": 8, "bf16": 4, "int8": 2}[moments] + (compute if separate_copy else 0)
