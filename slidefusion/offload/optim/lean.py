"""AdamW on lean host state (bf16 master, bf16 or 8-bit moments): the plain-torch specification and
the C kernel (`lean_kernels.c`, which documents the encodings) behind one call.

`lean_adamw_(buffers, ...)` runs the C kernel when it is built, split over threads by whole blocks,
and `lean_adamw_reference_` otherwise; the two are bitwise equal (tests/offload/test_offload_lean.py).
The stochastic-rounding bits are a hash of (seed, element index), so a run repeats exactly and a
resumed run continues the same random streams.
"""

import ctypes
from dataclasses import dataclass
from functools import partial

import torch

from slidefusion.offload.optim import kernels
from slidefusion.offload.optim.adam import run_ranges
from slidefusion.offload.optim.formats import QBLOCK

KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
MASK32 = 0xFFFFFFFF


FRAC = 16 / 15  # a decade's fraction from [1/16, 1) to [0, 1) (rounded to fp32 where used)
UNFRAC = 15 / 16
SIGNED_BITS, UNSIGNED_BITS = 7, 8  # magnitude bits of the 8-bit codes: m has a sign, v does not


@dataclass
class LeanBuffers:
    """One group's flat buffers for one update (the trainable prefix)."""

    master: torch.Tensor  # fp32 or bf16
    comp: torch.Tensor | None  # bf16 Kahan compensation
    exp_avg: torch.Tensor  # fp32, bf16, or uint8 codes
    exp_avg_sq: torch.Tensor
    m_scale: torch.Tensor | None  # fp32 absmax per block (8-bit moments)
    v_scale: torch.Tensor | None
    starts: torch.Tensor | None  # int64 block starts and the end (8-bit moments)
    grad: torch.Tensor  # fp32, bf16 or fp16
    out: torch.Tensor | None  # the compute copy, when it is not the master
    base: int = 0  # the buffers start at this element of their group (a data-parallel shard): the random
    # streams hash (seed, base + index), so a shard rounds each element as the whole group would

    def block_starts(self) -> torch.Tensor | None:
        """The blocks' starts and end as element indices of the group (None: fixed blocks from 0).
        A shard always has explicit starts: its blocks begin at `base`, not at a multiple of QBLOCK."""
        if self.starts is not None:
            return self.starts + self.base
        if self.base == 0:
            return None
        return torch.tensor([*range(self.base, self.base + self.numel, QBLOCK), self.base + self.numel], dtype=torch.int64)

    @property
    def numel(self) -> int:
        return self.master.numel()

    @property
    def moments_kind(self) -> int:
        return {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2}[self.exp_avg.dtype]

    @property
    def master_kind(self) -> int:
        return 0 if self.master.dtype == torch.float32 else (2 if self.comp is not None else 1)


def seeds(seed: int, step: int, key: int) -> tuple[int, int]:
    """The stochastic-rounding streams of one group's update at one step: the master's, and the
    moments' (m rounds with the low 16 bits of each value's hash, v with the high 16)."""
    def mix(x: int) -> int:  # splitmix64's finaliser
        x = (x + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return (x ^ (x >> 31)) & MASK32

    base = mix(mix(seed) ^ (step * 0x100000001B3) ^ ((key + 1) << 40))
    return mix(base ^ 1), mix(base ^ 2)


def _scalars(step: int, lr: float, cfg, grad_scale: float) -> dict[str, float]:
    """The update's constants, rounded to fp32 as the kernel receives them."""
    beta1, beta2 = cfg.betas
    values = {"decay": 1 - lr * cfg.weight_decay, "scale": grad_scale, "w1": 1 - beta1, "beta2": beta2, "value2": 1 - beta2,
              "inv_bias2_sqrt": 1 / (1 - beta2 ** step) ** 0.5, "eps": cfg.eps, "neg_step": -(lr / (1 - beta1 ** step))}
    return {k: torch.tensor(v, dtype=torch.float32).item() for k, v in values.items()}


# -- the specification ----------------------------------------------------------------------------


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on int64 holding uint32 values; products split in 16-bit halves never overflow."""
    def mul(x, c):
        return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32
    x = x ^ (x >> 16)
    x = mul(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul(x, 0x846CA68B)
    return x ^ (x >> 16)


def round_bf16_stochastic(x: torch.Tensor, seed: int, high: bool = False, base: int = 0) -> torch.Tensor:
    """fp32 -> bf16, adding 16 bits of hash(seed, base + index) (the low half, or the high half when
    `high`) to the bit pattern, then truncating."""
    index = torch.arange(base, base + x.numel(), dtype=torch.int64)
    h = _mix32((index & MASK32) ^ seed)
    noise = h >> 16 if high else h & 0xFFFF
    out = (((x.reshape(-1).view(torch.int32).to(torch.int64) & MASK32) + noise) >> 16) & 0xFFFF
    out = torch.where(torch.isnan(x.reshape(-1)), 0x7FC0, out)
    return (out - (out >= 0x8000).long() * 0x10000).to(torch.int16).view(torch.bfloat16)


def _block_of(starts: torch.Tensor, n: int) -> torch.Tensor:
    return torch.searchsorted(starts[1:], torch.arange(n), right=True)


def _pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2 ** exponent as fp32 (exact), for int exponents in [-126, 127]."""
    return ((exponent + 127) << 23).to(torch.int32).view(torch.float32)


def decode8(codes: torch.Tensor, magnitude_bits: int) -> torch.Tensor:
    """Magnitude codes (leading one = decade, bits below = bin) -> x in [0, 1): the bin centres."""
    c = codes.long()
    top = ((c | 1).float().view(torch.int32).long() >> 23) - 127
    t = (c.float() + 0.5) * _pow2(-top) - 1.0
    u = t * UNFRAC + 0.0625
    x = (u.view(torch.int32).long() - ((magnitude_bits - 1 - top) << 25)).to(torch.int32).view(torch.float32)
    return torch.where(c == 0, 0.0, x)


def encode8(x: torch.Tensor, magnitude_bits: int, keep_positive: bool) -> torch.Tensor:
    """x in [0, 1] -> magnitude codes (int64): decade from the exponent, then the bin holding x."""
    frac, b = torch.tensor(FRAC, dtype=torch.float32).item(), magnitude_bits
    raw = x.view(torch.int32).long()
    d = ((126 - (raw >> 23)) >> 2).clamp(0, b)  # x == 0 (and x below the last decade): d == b
    u = (raw + (d << 25)).to(torch.int32).view(torch.float32)
    z = (u - 0.0625) * frac + 1.0  # in [1, 2]; the bin is trunc(z * 2^(b-1-d)), read off z's bits
    code = (((z.view(torch.int32).long() & MASK32) - 0x3F000000) >> (24 - b + d)).clamp(max=(1 << b) - 1)
    below = ((raw != 0) if keep_positive else torch.zeros_like(x, dtype=torch.bool)).long()
    return torch.where(d >= b, below, code)


def quantize(values: torch.Tensor, block: torch.Tensor, blocks: int, signed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 values -> (uint8 codes, fp32 absmax per block)."""
    amax = torch.zeros(blocks).scatter_reduce(0, block, values.abs(), "amax")
    r = torch.where(amax > 0, 1.0 / torch.where(amax > 0, amax, 1.0), 0.0)
    code = encode8(values.abs() * r[block], SIGNED_BITS if signed else UNSIGNED_BITS, keep_positive=not signed)
    if signed:
        code = torch.where((values < 0) & (code != 0), code | 0x80, code)
    return code.to(torch.uint8), amax


def dequantize(codes: torch.Tensor, amax: torch.Tensor, signed: bool) -> torch.Tensor:
    """uint8 codes and per-element absmax -> fp32 values."""
    c = codes.long()
    x = decode8(c & 0x7F if signed else c, SIGNED_BITS if signed else UNSIGNED_BITS) * amax
    return torch.where((c & 0x80) != 0, -x, x) if signed else x


@torch.no_grad()
def lean_adamw_reference_(b: LeanBuffers, step: int, lr: float, cfg, grad_scale: float = 1.0,
                          stream_seeds: tuple[int, int] = (0, 0)) -> None:
    """One AdamW step on lean buffers, one torch operation per line of the C kernel's arithmetic."""
    c, n = _scalars(step, lr, cfg, grad_scale), b.numel
    block = _block_of(b.starts, n) if b.starts is not None else None  # relative to the buffers
    g = b.grad.float() * c["scale"]
    p = b.master.float() if b.comp is None else b.master.float() + b.comp.float()
    if b.moments_kind == 2:
        m, v = dequantize(b.exp_avg, b.m_scale[block], True), dequantize(b.exp_avg_sq, b.v_scale[block], False)
    else:
        m, v = b.exp_avg.float(), b.exp_avg_sq.float()
    p = p * c["decay"]
    m = m + (g - m) * c["w1"]
    v = v * c["beta2"] + (g * c["value2"]) * g
    p = p + (m * c["neg_step"]) / (v.double().sqrt().float() * c["inv_bias2_sqrt"] + c["eps"])
    _store_master(b, p, stream_seeds[0])
    if b.moments_kind == 2:
        (codes_m, amax_m), (codes_v, amax_v) = quantize(m, block, b.m_scale.numel(), True), quantize(v, block, b.v_scale.numel(), False)
        b.exp_avg.copy_(codes_m), b.exp_avg_sq.copy_(codes_v), b.m_scale.copy_(amax_m), b.v_scale.copy_(amax_v)
    elif b.moments_kind == 1:
        b.exp_avg.copy_(round_bf16_stochastic(m, stream_seeds[1], base=b.base))
        b.exp_avg_sq.copy_(round_bf16_stochastic(v, stream_seeds[1], high=True, base=b.base))
    else:
        b.exp_avg.copy_(m), b.exp_avg_sq.copy_(v)


def _store_master(b: LeanBuffers, p: torch.Tensor, seed: int) -> None:
    if b.master_kind == 0:
        b.master.copy_(p)
        stored = p
    elif b.master_kind == 1:
        b.master.copy_(round_bf16_stochastic(p, seed, base=b.base))
        stored = b.master.float()
    else:
        b.master.copy_(p.to(torch.bfloat16))
        b.comp.copy_((p - b.master.float()).to(torch.bfloat16))
        stored = b.master.float() + b.comp.float()
    if b.out is not None:
        b.out.copy_(stored)


# -- the kernel -----------------------------------------------------------------------------------


class _Args(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in ("p", "comp", "m", "v", "m_scale", "v_scale", "starts", "g", "out")] + [
        (name, ctypes.c_int32) for name in ("master_kind", "moments_kind", "grad_kind", "out_kind")] + [("n", ctypes.c_int64)] + [
        (name, ctypes.c_float) for name in ("decay", "scale", "w1", "beta2", "value2", "inv_bias2_sqrt", "eps", "neg_step")] + [
        (name, ctypes.c_uint32) for name in ("seed_p", "seed_m")]


def _ptr(t: torch.Tensor | None, base: int = 0) -> int | None:
    """`t`'s address, moved back by `base` elements: the kernel adds each block's start (an index
    of the group) to it, which for a shard lands inside the shard's own buffer."""
    return None if t is None else t.data_ptr() - base * t.element_size()


def _args(b: LeanBuffers, step: int, lr: float, cfg, grad_scale: float, stream_seeds, starts) -> _Args:
    c, at = _scalars(step, lr, cfg, grad_scale), b.base
    return _Args(_ptr(b.master, at), _ptr(b.comp, at), _ptr(b.exp_avg, at), _ptr(b.exp_avg_sq, at), _ptr(b.m_scale),
                 _ptr(b.v_scale), _ptr(starts), _ptr(b.grad, at), _ptr(b.out, at), b.master_kind, b.moments_kind,
                 KINDS[b.grad.dtype], KINDS[b.out.dtype] if b.out is not None else 0, b.numel, *c.values(), *stream_seeds)


def prepared_kernel(b: LeanBuffers, step: int, lr: float, cfg, grad_scale: float = 1.0,
                    stream_seeds: tuple[int, int] = (0, 0)):
    """The C kernel's whole update of `b` as a zero-argument callable with its arguments built once
    (None without a compiler): benchmarks time it on cache-resident buffers, where a call costs
    less than building its arguments. Calling it twice applies two identical updates."""
    lib = kernels.load()
    if lib is None:
        return None
    starts = b.block_starts()
    args = _args(b, step, lr, cfg, grad_scale, stream_seeds, starts)
    blocks = starts.numel() - 1 if starts is not None else -(-b.numel // QBLOCK)
    return lambda: lib.lean_update(ctypes.addressof(args), 0, blocks) and (args, b, starts)  # keeps them alive


def lean_adamw_(b: LeanBuffers, step: int, lr: float, cfg, grad_scale: float = 1.0,
                stream_seeds: tuple[int, int] = (0, 0), threads: int = 1, in_torch_pool: bool = False) -> None:
    """`lean_adamw_reference_`, in C where it is built: `threads` ranges of whole blocks at once,
    on the optimizer's pool, or (`in_torch_pool`, where the build has OpenMP) on torch's threads."""
    lib = kernels.load()
    if lib is None:
        return lean_adamw_reference_(b, step, lr, cfg, grad_scale, stream_seeds)
    starts = b.block_starts()  # kept alive until the kernel returns
    args = _args(b, step, lr, cfg, grad_scale, stream_seeds, starts)
    blocks = starts.numel() - 1 if starts is not None else -(-b.numel // QBLOCK)
    edges = block_edges(blocks, threads)
    if len(edges) == 2:
        return lib.lean_update(ctypes.addressof(args), 0, blocks)
    if in_torch_pool and hasattr(lib, "lean_update_ranges"):
        edges_c = (ctypes.c_int64 * len(edges))(*edges)
        return lib.lean_update_ranges(ctypes.addressof(args), edges_c, len(edges) - 1)
    run_ranges(partial(lib.lean_update, ctypes.addressof(args)), edges, threads)


def block_edges(blocks: int, threads: int) -> list[int]:
    """Where `threads` ranges of whole blocks start and end: at least 8 blocks each, so small
    groups run in one call."""
    parts = max(1, min(threads, blocks // 8))
    return [blocks * i // parts for i in range(parts + 1)]
