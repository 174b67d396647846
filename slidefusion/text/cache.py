"""Caption embeddings computed once and kept, in memory and optionally in a safetensors file.

Training sees the same captions every epoch, so encoding them again is wasted work. Each caption
is stored unpadded, (L_i, dim), and a requested batch is padded to its own longest caption, exactly
as `TextEncoder.encode` would pad it.

File layout: tensors "emb/<i>" (L_i, dim) float32; metadata "captions" is the JSON list whose i-th
entry is the caption of "emb/<i>" (captions are arbitrary text, so they cannot be keys themselves),
plus the encoder's name, max_length and dim so that a file from another encoder is never mixed in.
"""

from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

from slidefusion.core.errors import check
from slidefusion.text.encoder import TextEncoder, check_prompts

_FORMAT = "slidefusion.caption_cache/1"


class CaptionCache:
    """Memoised `encoder.encode` per caption. Tensors are kept and returned on the CPU."""

    def __init__(self, encoder: TextEncoder, path: str | Path | None = None, batch_size: int = 64):
        check(isinstance(batch_size, int) and batch_size >= 1,
              f"caption cache batch_size={batch_size!r} is invalid; valid: an int >= 1")
        self.encoder = encoder
        self.path = Path(path) if path is not None else None
        self.batch_size = batch_size
        self._entries: dict[str, Tensor] = {}  # caption -> (L_i, dim); dicts keep insertion order
        if self.path is not None and self.path.exists():
            self._entries = self._load(self.path)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, caption: str) -> bool:
        return caption in self._entries

    def get(self, captions: list[str]) -> tuple[Tensor, Tensor]:
        """States (B, L, dim) float32 and mask (B, L) bool for `captions`, L = longest of this batch.

        Only captions never seen before reach the encoder, each once, in batches of `batch_size`.
        """
        check_prompts(captions)
        missing = [c for c in dict.fromkeys(captions) if c not in self._entries]
        for start in range(0, len(missing), self.batch_size):
            self._encode_and_store(missing[start:start + self.batch_size])
        return pad_batch([self._entries[c] for c in captions])

    def save(self) -> None:
        """Write every entry to `path`, atomically: readers see the old file or the new one, never half."""
        check(self.path is not None,
              "CaptionCache path=None cannot be saved; valid: pass path=<file>.safetensors")
        from safetensors.torch import save_file

        captions = list(self._entries)
        tensors = {f"emb/{i}": self._entries[c].contiguous() for i, c in enumerate(captions)}
        metadata = {**self._identity(), "captions": json.dumps(captions, ensure_ascii=False)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The temp file sits in the same directory so that os.replace is a rename, not a copy.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata=metadata)
            os.replace(tmp, self.path)
        except BaseException:
            os.unlink(tmp)
            raise

    def _encode_and_store(self, captions: list[str]) -> None:
        states, mask = self.encoder.encode(captions)  # (b, L, dim), (b, L)
        for caption, row, row_mask in zip(captions, states.float().cpu(), mask.cpu()):
            self._entries[caption] = row[row_mask].clone()  # (L_i, dim): only the real tokens

    def _identity(self) -> dict[str, str]:
        """What must match for stored embeddings to be reusable (safetensors metadata is str -> str)."""
        enc = self.encoder
        return {"format": _FORMAT, "encoder": enc.name,
                "max_length": str(enc.max_length), "dim": str(enc.dim)}

    def _load(self, path: Path) -> dict[str, Tensor]:
        """Entries stored at `path`, or {} with a warning when they came from another encoder."""
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            stored = {k: metadata.get(k) for k in self._identity()}
            if stored != self._identity():
                warnings.warn(f"caption cache {path} was built with {stored}, not {self._identity()}; "
                              "discarding it (it will be overwritten on save)", stacklevel=3)
                return {}
            captions = json.loads(metadata["captions"])
            return {c: f.get_tensor(f"emb/{i}") for i, c in enumerate(captions)}


def pad_batch(rows: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Stack (L_i, dim) rows into zero-padded states (B, max L_i, dim) and mask (B, max L_i)."""
    length = max(r.shape[0] for r in rows)
    states = rows[0].new_zeros(len(rows), length, rows[0].shape[1])
    mask = torch.zeros(len(rows), length, dtype=torch.bool)
    for i, r in enumerate(rows):
        states[i, : r.shape[0]] = r
        mask[i, : r.shape[0]] = True
    return states, mask
