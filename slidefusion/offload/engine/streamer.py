"""A pool of `prefetch + 1` device buffers that blocks stream through, one pass at a time.

A pass is an order of blocks (forward: 0..L-1, backward: L-1..0). Position k of the pass runs in
the slot that position k - (prefetch + 1) released, so while block k computes, the next
`prefetch` blocks are already uploading. Uploads are issued when a slot is released and waited on
in `acquire`, right where the weights are needed:

    acquire(k) -> wait upload k -> compute block k -> release(k) -> issue upload k + prefetch + 1

A backward pass starts with the blocks the forward pass left in the pool, so those are not
uploaded again.
"""

import time
from collections.abc import Callable

import torch

from slidefusion.offload.engine.transfer import DONE, Handle


class BlockStreamer:
    """Streams `sources[b]` (flat host buffers) through `slots` (flat device buffers)."""

    def __init__(self, copier, sources: list[torch.Tensor], slots: list[torch.Tensor],
                 upload_after: Callable[[int], tuple[Handle, ...]], codec=None):
        self.copier = copier
        self.codec = codec  # more of a block to upload with it and decode into its slot (`fp8.Fp8Streaming`)
        self.sources = sources
        self.slots = slots
        self.upload_after = upload_after  # what must finish before block b's source may be read
        self.holds: list[int | None] = [None] * len(slots)  # which block each slot holds
        self.free: list[Handle] = [DONE] * len(slots)  # when each slot's last reader finished
        self.h2d_bytes = 0
        self.wait_s = 0.0  # time compute waited for uploads (exposed transfer)
        self.peak_bytes = 0  # most block bytes resident in the pool at once

    def start(self, order: list[int], reuse: bool) -> None:
        """Begin a pass over `order`; `reuse` keeps what the pool already holds (weights unchanged)."""
        if not reuse:
            self.holds = [None] * len(self.slots)
        self.order, self.slot_of, self.ready = order, {}, {}
        first = order[:len(self.slots)]
        kept = {b: s for s, b in enumerate(self.holds) if b in first}
        spare = [s for s in range(len(self.slots)) if s not in kept.values()]
        for k, block in enumerate(first):
            if block in kept:
                self.slot_of[k], self.ready[k] = kept[block], DONE
            else:
                self._upload(k, spare.pop(0))

    def _upload(self, k: int, slot: int) -> None:
        block = self.order[k]
        source = self.sources[block]
        self.slot_of[k] = slot
        self.holds[slot] = block
        after = (self.free[slot], *self.upload_after(block))
        self.ready[k] = self.copier.copy(self.slots[slot][:source.numel()], source, after)
        self.h2d_bytes += source.numel() * source.element_size()
        if self.codec is not None:
            self.ready[k], extra = self.codec.upload(self.copier, block, slot, after, self.ready[k])
            self.h2d_bytes += extra
        self._note_occupancy()

    def _note_occupancy(self) -> None:
        held = sum(self.sources[b].numel() * self.sources[b].element_size() for b in self.holds if b is not None)
        self.peak_bytes = max(self.peak_bytes, held)

    def acquire(self, k: int) -> torch.Tensor:
        """The device buffer holding position k's block, once its upload has landed."""
        start = time.perf_counter()
        self.ready[k].wait()
        self.wait_s += time.perf_counter() - start
        slot = self.slot_of[k]
        if self.codec is not None:
            self.codec.decode(self.order[k], slot, self.slots[slot])
        return self.slots[slot]

    def release(self, k: int) -> None:
        """Position k's compute is issued; its slot goes to position k + len(slots)."""
        slot = self.slot_of[k]
        self.free[slot] = self.copier.marker()
        following = k + len(self.slots)
        if following < len(self.order):
            self._upload(following, slot)
