"""An fp8 frozen base: a LoRA run's frozen weights held on the host and streamed as float8 codes
with float32 scales, dequantised per block on the device (`lora.base_dtype=float8_e4m3fn`).

    codes, scales = quantise(weight, torch.float8_e4m3fn, "channel")   # codes (numel,), scales (rows,)
    weight ~= dequantise(codes, scales, weight.shape, torch.bfloat16)

Scales: "channel" gives each output row (dim 0: a Linear's output feature, a conv's output channel)
its own scale, amax(|row|) / the format's largest finite value; "tensor" one per parameter; a 1-D
parameter (bias, norm) always has one. Per-channel scales follow the rows' very different ranges
in attention and MLP weights at 4 bytes a row.

One engine group's frozen parameters live in one flat byte buffer, `FrozenCodes.wire` = [codes |
scales]: one host-to-device copy per block moves both, at a little over 1 byte per parameter where
the compute copy took 2 (bf16) or 4. `FrozenCodes.decode_into` expands a device copy of the wire
into the frozen region of the block's flat compute buffer: one multiply per parameter.
"""

from __future__ import annotations

import torch

from slidefusion.core.dtypes import DTYPES
from slidefusion.core.errors import UserError, check
from slidefusion.offload.engine.transfer import Handle

FP8_DTYPES = {d.name: d.torch for d in DTYPES if d.name.startswith("float8")}  # name -> dtype, from the one table
SCALES = ("channel", "tensor")
_ALIGN = 16  # the scales start on this byte boundary of the wire buffer (float32 views need 4)


def _rows(shape: tuple[int, ...], per: str) -> int:
    return shape[0] if per == "channel" and len(shape) >= 2 else 1


def quantise(value: torch.Tensor, dtype: torch.dtype, per: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight -> (codes (numel,) of `dtype`, float32 scales (rows,)); an all-zero row gets scale 1."""
    rows = _rows(tuple(value.shape), per)
    flat = value.detach().float().reshape(rows, -1)
    amax = flat.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / torch.finfo(dtype).max, torch.ones_like(amax))
    return (flat / scales[:, None]).to(dtype).reshape(-1), scales


def dequantise(codes: torch.Tensor, scales: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`quantise`'s inverse up to rounding: codes (numel,) and scales (rows,) -> a `dtype` tensor of `shape`."""
    rows = scales.numel()
    return (codes.reshape(rows, -1).to(torch.float32) * scales[:, None]).to(dtype).reshape(shape)


class FrozenCodes:
    """The fp8 codes and scales of one group's frozen parameters, in one flat host byte buffer.
    `entries`: the frozen parameters' layout entries (offsets count from the group's start);
    `start`: where the frozen part begins in the group's flat layout (its trainable count)."""

    def __init__(self, entries, start: int, dtype: torch.dtype, per: str, allocate):
        check(per in SCALES, f"lora.base_scales={per!r} is unknown; valid: {', '.join(SCALES)}")
        self.dtype, self.per, self.start = dtype, per, start
        self.entries = list(entries)
        self.numel = sum(e.numel for e in self.entries)
        rows = [_rows(e.shape, per) for e in self.entries]
        self.scale_offsets = [sum(rows[:i]) for i in range(len(rows))]
        self.rows = rows
        scale_at = -(-self.numel // _ALIGN) * _ALIGN
        self.wire = allocate(scale_at + 4 * sum(rows), torch.uint8, True)
        self.codes = self.wire[:self.numel].view(dtype)
        self.scales = self.wire[scale_at:].view(torch.float32)
        self.scales.fill_(1.0)
        self._scale_at = scale_at

    def host_bytes(self) -> int:
        return self.wire.numel()

    def index_of(self, offset: int) -> int:
        """The entry at group offset `offset`."""
        for i, entry in enumerate(self.entries):
            if entry.offset == offset:
                return i
        raise UserError(f"no frozen parameter starts at offset {offset}")

    def write(self, offset: int, value: torch.Tensor) -> None:
        """Quantise one whole frozen parameter (at group offset `offset`) into the codes and scales."""
        i = self.index_of(offset)
        entry = self.entries[i]
        codes, scales = quantise(value.reshape(entry.shape), self.dtype, self.per)
        at = entry.offset - self.start
        self.codes[at:at + entry.numel].copy_(codes)
        self.scales[self.scale_offsets[i]:self.scale_offsets[i] + self.rows[i]].copy_(scales)

    def views(self) -> list[torch.Tensor]:
        """Each frozen parameter's codes, shaped like it (what the model's frozen parameters point
        at on the host: codes, not values; `value(i)` scales them)."""
        return [self.codes[e.offset - self.start:e.offset - self.start + e.numel].view(e.shape) for e in self.entries]

    def value(self, i: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Frozen parameter i dequantised (a new tensor)."""
        entry, s = self.entries[i], self.scale_offsets[i]
        at = entry.offset - self.start
        return dequantise(self.codes[at:at + entry.numel], self.scales[s:s + self.rows[i]], entry.shape, dtype)

    def decode_into(self, wire: torch.Tensor, flat: torch.Tensor) -> None:
        """Dequantise a device copy of `wire` into the frozen region of a group's flat compute
        buffer `flat` (on the same device), parameter by parameter."""
        codes = wire[:self.numel].view(self.dtype)
        scales = wire[self._scale_at:self._scale_at + 4 * sum(self.rows)].view(torch.float32)
        for entry, s, rows in zip(self.entries, self.scale_offsets, self.rows):
            at = entry.offset - self.start
            target = flat[entry.offset:entry.offset + entry.numel].view(rows, -1)
            torch.mul(codes[at:at + entry.numel].view(rows, -1).to(flat.dtype), scales[s:s + rows, None].to(flat.dtype),
                      out=target)


class _Both(Handle):
    """Two operations' completion as one handle."""

    def __init__(self, first: Handle, second: Handle):
        self.first, self.second = first, second

    def wait(self) -> None:
        self.first.wait()
        self.second.wait()

    def synchronize(self) -> None:
        self.first.synchronize()
        self.second.synchronize()

    def done(self) -> bool:
        return self.first.done() and self.second.done()


class Fp8Streaming:
    """The streamer's codec for groups with fp8 frozen parts: one device byte buffer per slot takes
    a block's wire in the same upload round as its compute part, and `decode` expands it into the
    slot when the block is acquired (once per upload: a kept slot is decoded already)."""

    def __init__(self, frozen: list[FrozenCodes | None], slots: int, device: torch.device):
        self.frozen = frozen
        largest = max((f.wire.numel() for f in frozen if f is not None), default=0)
        self.wires = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.decoded: list[int | None] = [None] * slots

    def upload(self, copier, block: int, slot: int, after: tuple, main: Handle) -> tuple[Handle, int]:
        """Issue the wire's copy beside the compute part's; (both handles, the bytes it moves)."""
        self.decoded[slot] = None
        codes = self.frozen[block]
        if codes is None:
            return main, 0
        handle = copier.copy(self.wires[slot][:codes.wire.numel()], codes.wire, after)
        return _Both(main, handle), codes.wire.numel()

    def decode(self, block: int, slot: int, flat: torch.Tensor) -> None:
        codes = self.frozen[block]
        if codes is not None and self.decoded[slot] != block:
            codes.decode_into(self.wires[slot], flat)
            self.decoded[slot] = block

    def reserved_bytes(self) -> int:
        return sum(w.numel() for w in self.wires)


def check_device(dtype: torch.dtype, device: torch.device, compute: torch.dtype) -> None:
    """A one-line UserError where `device` cannot turn `dtype` codes into `compute` values."""
    try:
        torch.ones(2, device=device).to(dtype).to(compute).sum().item()
    except (RuntimeError, TypeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        name = next(k for k, v in FP8_DTYPES.items() if v == dtype)
        raise UserError(f"lora.base_dtype={name} is not supported on {device} ({reason}); use lora.base_dtype=null "
                        "(the compute dtype)") from None
