"""Where block-boundary checkpoints wait for the backward pass: host memory, then a spill file.

`SpilledCheckpoints` is a store for the engine's checkpoint seam (see `engine.hooks.KeptCheckpoints`).
Each block's inputs (the token grid above all) stay in host memory until `budget` bytes are held;
past that the *oldest* go to disk, so the newest, which the backward pass needs first, are still in
memory when it starts. Writes run on a writer thread behind the forward pass (at most
`write_behind` blocks in flight: the forward waits only when the disk cannot keep up); the backward
pass reads ahead in reverse on a reader thread, `read_ahead` blocks before they are needed. A block
taken while its write is still in flight is served from memory.

Both default to one block: while block i computes, only block i - 1 is being written (forward) or
read (backward), so beside the block in use the store holds at most one block's inputs that it
would not hold without a disk. That is all the overlap needs when a block's compute takes longer
than its transfer (the disk keeps up); a deeper queue only helps a disk that stalls now and then,
and costs a block's inputs of host memory per step of depth. `reading` and `writing` gauge the bytes
of the blocks read ahead and not yet taken, and of those being written (`.peak`: high-water marks).

The bytes on disk are the tensors' own, so results are bitwise those of host-resident checkpoints.
Tensors seen in an earlier block of the step (the conditioning and text every block shares), and
tensors under `min_bytes`, are kept by reference: spilling them would free nothing.

On a GPU a spilled block is copied to the host when it is stored and back when it is taken
(synchronously, a small share of a large model's step over PCIe; a copy stream would hide it). A write
that fails (a full disk) keeps the block in memory and stops the step at the next block with one
line, before any update; the disk space is reserved before each step (`begin_step`).
"""

import threading
import time
import weakref
from functools import partial

import torch

from slidefusion.errors import UserError
from slidefusion.offload.engine.hooks import KeptCheckpoints
from slidefusion.offload.engine.transfer import DONE, Handle, Worker
from slidefusion.offload.tiling.spill import KEY, SpillFile, aligned


class Gauge:
    """Bytes held for one purpose, moved by several threads, and their high-water mark."""

    def __init__(self):
        self.value = self.peak = 0
        self._lock = threading.Lock()

    def add(self, change: int) -> None:
        with self._lock:
            self.value += change
            self.peak = max(self.peak, self.value)


class Entry:
    """One block's stored inputs; `big` indexes the tensors that may go to disk."""

    def __init__(self, index: int, tensors: list, big: list[int]):
        self.index, self.tensors, self.big = index, tensors, big
        self.meta = {i: (tensors[i].shape, tensors[i].dtype, tensors[i].requires_grad) for i in big}
        self.nbytes = sum(tensors[i].numel() * tensors[i].element_size() for i in big)
        self.offsets: list[int] = []
        self.lock = threading.Lock()
        self.evicted, self.claimed = False, False
        self.written: Handle = DONE
        self.read: Handle | None = None


class SpilledCheckpoints:
    """Checkpoints in host memory up to `budget` bytes, the rest in a spill file in `folder`."""

    def __init__(self, folder: str, budget: int, device: torch.device, planned: int = 0, min_bytes: int = 64 << 10,
                 read_ahead: int = 1, write_behind: int = 1, anonymous: bool = True):
        self.file = SpillFile(folder, anonymous)
        self.budget, self.device, self.planned, self.min_bytes = budget, device, planned, min_bytes
        self.read_ahead, self.write_behind = read_ahead, write_behind
        self.writer, self.reader = Worker("offload-spill-write"), Worker("offload-spill-read")
        self.bytes_written = self.bytes_read = self.last_step_bytes = 0
        self.write_s = self.read_s = self.exposed_s = 0.0
        self.reading, self.writing = Gauge(), Gauge()  # moved by the reader, the writer and the caller
        self._reset()

    def _reset(self) -> None:
        self.entries: list[Entry] = []
        self.in_flight: list[Entry] = []
        self.seen: dict[int, weakref.ref] = {}
        self.memory, self.cursor, self.failed = 0, 0, None

    # -- the engine's checkpoint seam -----------------------------------------------------------

    def put(self, ctx, tensors: list) -> None:
        if self.failed is not None:
            raise UserError(f"{KEY}={self.file.folder!r}: writing checkpoints failed ({self.failed}); "
                            "the step stopped before any update")
        big = [i for i, t in enumerate(tensors) if self._spillable(t)]
        tensors = [_to_host(t) if i in big else t for i, t in enumerate(tensors)]
        entry = Entry(len(self.entries), tensors, big)
        ctx.spill_entry = entry
        self.entries.append(entry)
        self.memory += entry.nbytes
        self._evict()

    def take(self, ctx) -> list:
        entry = ctx.spill_entry
        with entry.lock:
            entry.claimed = True
            on_disk = any(entry.tensors[i] is None for i in entry.big)
        if on_disk and entry.read is None:
            self._load_async(entry)
        if entry.read is not None:  # a prefetch may be running even when memory served the block
            start = time.perf_counter()
            entry.read.synchronize()
            self.exposed_s += time.perf_counter() - start
        if not entry.evicted:
            self.memory -= entry.nbytes
        if entry.read is not None:
            self.reading.add(-entry.nbytes)
        tensors, entry.tensors = entry.tensors, None
        self._prefetch(entry.index)
        return [_to_device(t, self.device, entry.meta[i][2]) if i in entry.meta else t for i, t in enumerate(tensors)]

    # -- the step -------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Reserve the disk the step will need (the last step's spill, or the planned one)."""
        wanted = aligned(max(self.planned, self.last_step_bytes))
        if wanted:
            self.file.reserve(wanted)

    def begin_backward(self) -> None:
        self._prefetch(len(self.entries))

    def end_step(self) -> None:
        """After the step (or its failure): drain the threads, drop every block, free the disk."""
        self.writer, self.reader = _drained(self.writer, "offload-spill-write"), _drained(self.reader, "offload-spill-read")
        self.last_step_bytes = max(self.last_step_bytes, self.cursor)
        self.reading.value = self.writing.value = 0  # blocks read ahead and never taken (a failed step) are dropped
        self._reset()
        self.file.release()

    def close(self) -> None:
        self.end_step()
        self.writer.close()
        self.reader.close()
        self.file.close()

    # -- inside ---------------------------------------------------------------------------------

    def _spillable(self, t) -> bool:
        if not torch.is_tensor(t) or t.numel() * t.element_size() < self.min_bytes:
            return False
        known, self.seen[id(t)] = self.seen.get(id(t)), weakref.ref(t)
        return known is None or known() is not t

    def _evict(self) -> None:
        """Send the oldest blocks in memory to disk until the budget holds."""
        for entry in self.entries:
            if self.memory <= self.budget:
                return
            if entry.evicted or entry.claimed or not entry.nbytes:
                continue
            self._throttle()
            entry.evicted, self.memory = True, self.memory - entry.nbytes
            self.writing.add(entry.nbytes)
            for i in entry.big:
                entry.offsets.append(self.cursor)
                self.cursor += aligned(entry.meta[i][0].numel() * entry.meta[i][1].itemsize)
            entry.written = self.writer.submit(partial(self._write, entry, [entry.tensors[i] for i in entry.big]))
            self.in_flight.append(entry)

    def _throttle(self) -> None:
        """Wait while `write_behind` writes are already in flight: the disk is behind."""
        self.in_flight = [e for e in self.in_flight if not e.written.done()]
        start = time.perf_counter()
        while len(self.in_flight) >= self.write_behind:
            self.in_flight.pop(0).written.synchronize()
        self.exposed_s += time.perf_counter() - start

    def _write(self, entry: Entry, tensors: list[torch.Tensor]) -> None:
        start = time.perf_counter()
        try:
            for tensor, offset in zip(tensors, entry.offsets):
                self.bytes_written += self.file.write(offset, tensor.contiguous())
        except OSError as error:  # the block stays in memory; the forward stops at the next block
            self.failed = error.strerror or str(error)
            return
        finally:
            self.write_s += time.perf_counter() - start
            self.writing.add(-entry.nbytes)
        with entry.lock:
            if not entry.claimed:  # free the memory; a block already taken keeps its tensors
                for i in entry.big:
                    entry.tensors[i] = None

    def _load_async(self, entry: Entry) -> None:
        entry.read = self.reader.submit(partial(self._load, entry), (entry.written,))

    def _load(self, entry: Entry) -> None:
        self.reading.add(entry.nbytes)
        start = time.perf_counter()
        for i, offset in zip(entry.big, entry.offsets):
            if entry.tensors[i] is not None:  # still in memory: its write failed or it was taken early
                continue
            shape, dtype, _ = entry.meta[i]
            out = torch.empty(shape, dtype=dtype)
            self.file.read(offset, out)
            self.bytes_read += aligned(out.numel() * out.element_size())
            entry.tensors[i] = out
        self.read_s += time.perf_counter() - start

    def _prefetch(self, below: int) -> None:
        """Start reading the `read_ahead` blocks on disk that the backward pass needs next."""
        pending = 0
        for entry in reversed(self.entries[:below]):
            if pending >= self.read_ahead:
                return
            if not entry.evicted or entry.claimed:
                continue
            if entry.read is None:
                self._load_async(entry)
            pending += 1


def _to_host(t):
    return t.detach().to("cpu").requires_grad_(t.requires_grad) if torch.is_tensor(t) and t.device.type != "cpu" else t


def _to_device(t: torch.Tensor, device: torch.device, requires_grad: bool) -> torch.Tensor:
    if device.type != "cpu":
        t = t.to(device)
    return t.requires_grad_(requires_grad) if not t.requires_grad and requires_grad else t


def _drained(worker: Worker, name: str) -> Worker:
    """`worker` once its jobs are done, or a fresh one if a failed job poisoned it."""
    try:
        worker.submit(lambda: None).synchronize()
        return worker
    except RuntimeError:
        worker.close()
        return Worker(name)


def make_checkpoints(policy, device: torch.device):
    """The engine's checkpoint store for `policy.spill_dir` (None: kept where they are)."""
    if policy.spill_dir is None:
        return KeptCheckpoints()
    return SpilledCheckpoints(policy.spill_dir, policy.spill_after, device, planned=policy.spill_reserve)
