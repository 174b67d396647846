"""Stream (name, tensor) pairs out of safetensors shards, one tensor at a time.

The format is an 8-byte little-endian header length, a JSON header (name -> dtype, shape, byte
offsets) and the raw data. Each tensor is read with `readinto` straight into its own buffer instead
of through a memory map: `safe_open` maps the whole shard, and every page read through the map stays
resident until the shard is closed, so host memory would peak at the weights plus a whole shard.
Here it peaks at the weights plus the largest tensor converted (`pytest -s tests/pretrained -k peaks`
measures both).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from slidefusion.core.dtypes import SAFETENSORS
from slidefusion.errors import UserError, check

DTYPES = SAFETENSORS  # header code -> torch dtype, from the one dtype table
_MAX_HEADER = 100 * 2**20  # the format's own limit


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a shard: absolute byte range [start, end) in `path`."""

    name: str
    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_header(path: str | Path) -> list[TensorEntry]:
    """The tensors of one safetensors file in file order; UserError if it is not a valid one."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        length = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        _require(0 < length <= min(_MAX_HEADER, size - 8), path, "header length is out of range")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise UserError(f"weights shard {path} is not a valid safetensors file: unreadable header") from None
    _require(isinstance(header, dict), path, "header is not a JSON object")
    base, entries = 8 + length, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entries.append(_entry(path, name, info, base, size))
    return sorted(entries, key=lambda e: e.start)


def _entry(path: Path, name: str, info, base: int, size: int) -> TensorEntry:
    ok = isinstance(info, dict) and info.get("dtype") in DTYPES and isinstance(info.get("shape"), list)
    _require(ok, path, f"tensor {name} has an unknown dtype or no shape")
    begin, end = info.get("data_offsets", (None, None))
    dtype, shape = DTYPES[info["dtype"]], tuple(int(s) for s in info["shape"])
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    _require(isinstance(begin, int) and end - begin == nbytes and base + end <= size, path,
             f"tensor {name}'s byte range does not match its shape (truncated file?)")
    return TensorEntry(name, path, dtype, shape, base + begin, base + end)


def _require(condition: bool, path: Path, reason: str) -> None:
    check(condition, f"weights shard {path} is not a valid safetensors file: {reason}")


def read_tensor(f, entry: TensorEntry, out: Tensor | None = None) -> Tensor:
    """Read `entry` from the open binary file `f` into `out` (a uint8 buffer of at least its size)
    or a fresh CPU tensor; returns it viewed with the entry's dtype and shape."""
    buffer = torch.empty(entry.nbytes, dtype=torch.uint8) if out is None else out[: entry.nbytes]
    if entry.nbytes:
        f.seek(entry.start)
        read = f.readinto(buffer.numpy())
        _require(read == entry.nbytes, entry.path, f"tensor {entry.name} is cut short")
    return buffer.view(entry.dtype).view(entry.shape)


def target_dtype(name: str, dtype: torch.dtype, file_dtype: torch.dtype, keep_fp32: Sequence[str]) -> torch.dtype:
    """diffusers' rule: floating tensors become `dtype`, except those under a `_keep_in_fp32_modules`
    name (a dotted component of `name`), which become float32; other tensors keep their dtype."""
    if not file_dtype.is_floating_point:
        return file_dtype
    parts = name.split(".")
    return torch.float32 if any(module in parts for module in keep_fp32) else dtype


def stream_tensors(entries: Sequence[TensorEntry], dtype: torch.dtype | None = None,
                   keep_fp32: Sequence[str] = ()) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) for `entries`, shard by shard in file order, each converted to its
    `target_dtype` (kept as stored when `dtype` is None). One file is open at a time.

    A tensor that needs converting is read into one reused scratch buffer, so the conversions'
    temporaries do not fragment the heap that holds the weights already yielded."""
    targets = {e.name: e.dtype if dtype is None else target_dtype(e.name, dtype, e.dtype, keep_fp32) for e in entries}
    converted = [e.nbytes for e in entries if targets[e.name] != e.dtype]
    scratch = torch.empty(max(converted), dtype=torch.uint8) if converted else None
    by_file: dict[Path, list[TensorEntry]] = {}
    for entry in entries:
        by_file.setdefault(entry.path, []).append(entry)
    for path, group in by_file.items():
        with open(path, "rb") as f:
            for entry in sorted(group, key=lambda e: e.start):
                if targets[entry.name] == entry.dtype:
                    yield entry.name, read_tensor(f, entry)
                else:
                    yield entry.name, read_tensor(f, entry, scratch).to(targets[entry.name])
