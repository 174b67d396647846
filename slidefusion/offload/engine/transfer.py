"""Asynchronous work that returns handles: copies between host and device, and CPU jobs.

Every asynchronous operation returns a `Handle`; the caller waits on it exactly where the result is
needed. `wait()` makes the *device's* compute stream wait (free on CPU, where compute is the
calling thread), `synchronize()` blocks the calling *host thread*. On CUDA a copy is an event on a
dedicated copy stream; on CPU it is a job on a background thread, so the ordering logic is the same
code in both cases and races show up in CPU tests.
"""

import itertools
import queue
import threading
import time
from collections.abc import Callable

import torch


class Handle:
    """Completion of one asynchronous operation."""

    def wait(self) -> None:
        """Order later work on the current device stream after this operation."""
        self.synchronize()

    def synchronize(self) -> None:
        """Block the calling host thread until the operation has finished."""

    def done(self) -> bool:
        return True


DONE = Handle()


class ThreadHandle(Handle):
    """Set by a host thread when its job finishes; carries the job's exception, if any."""

    def __init__(self):
        self._event = threading.Event()
        self._error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self._error = error
        self._event.set()

    def synchronize(self) -> None:
        self._event.wait()
        if self._error is not None:
            raise RuntimeError(f"offload worker failed: {self._error!r}") from self._error

    def done(self) -> bool:
        return self._event.is_set()


class CudaHandle(Handle):
    """An event recorded on a CUDA stream."""

    def __init__(self, stream: "torch.cuda.Stream"):
        self.event = torch.cuda.Event()
        self.event.record(stream)

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()

    def done(self) -> bool:
        return self.event.query()


def no_jitter() -> None:
    """The default fault injector: do nothing."""


def serial_torch_here() -> None:
    """Run the calling thread's torch CPU operations on one core. The engine's background threads
    (copies, optimizer) work beside the compute thread; letting each of their small operations
    fork torch's intra-op pool only makes them wait on cores the compute is using (an AdamW calling
    torch.sqrt per chunk slows down severalfold with 2 torch threads). torch
    keeps the thread count per thread, but setting it also changes the default of threads started
    later: restore that elsewhere."""
    keep = torch.get_num_threads()
    torch.set_num_threads(1)
    restore = threading.Thread(target=torch.set_num_threads, args=(keep,))
    restore.start()
    restore.join()


class InlineWorker:
    """Runs each submitted job at once, on the submitting thread: the compute's, for a policy that
    is not `overlapped`. `Worker` is the same interface on a thread of its own.

    A job first waits for its `after` handles. `jitter` runs before each job: tests set it to
    random sleeps to expose races. `busy_s` counts seconds spent running jobs (not waiting for
    dependencies); `exposed_s` those the compute spent on them itself, here all of them.
    """

    def __init__(self):
        self.jitter: Callable[[], None] = no_jitter
        self.busy_s = 0.0

    def submit(self, job: Callable[[], None], after: tuple[Handle, ...] = (), low: bool = False) -> Handle:
        self._run_job(job, after)
        return DONE

    def _run_job(self, job: Callable[[], None], after: tuple[Handle, ...]) -> None:
        for dependency in after:
            dependency.synchronize()
        self.jitter()
        start = time.perf_counter()
        job()
        self.busy_s += time.perf_counter() - start

    @property
    def exposed_s(self) -> float:
        return self.busy_s

    def close(self) -> None:
        """Nothing runs in the background."""


class Worker(InlineWorker):
    """One background thread running submitted jobs in order; each job gets a `ThreadHandle`.

    A job's dependencies wait on this thread, so they never block the submitter. `low` jobs run
    only when no other job is waiting (in order among themselves).
    """

    exposed_s = 0.0  # the engine measures the compute's waits on this thread itself

    def __init__(self, name: str):
        super().__init__()
        self._jobs: queue.PriorityQueue = queue.PriorityQueue()
        self._order = itertools.count()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], after: tuple[Handle, ...] = (), low: bool = False) -> ThreadHandle:
        handle = ThreadHandle()
        self._jobs.put((int(low), next(self._order), (job, after, handle)))
        return handle

    def _run(self) -> None:
        serial_torch_here()
        failed: BaseException | None = None
        while True:
            item = self._jobs.get()[2]
            if item is None:
                return
            job, after, handle = item
            if failed is not None:  # once a job fails, later ones would run on broken state
                handle.set(failed)
                continue
            try:
                self._run_job(job, after)
                handle.set()
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits on the handle
                failed = error
                handle.set(error)

    def close(self) -> None:
        self._jobs.put((2, next(self._order), None))  # after every job
        self._thread.join()


class ThreadCopier:
    """Copies on a background thread (CPU 'device'): `copy(dst, src, after) -> Handle`.

    `set_bandwidth(bytes_per_s)` makes each copy last at least bytes / bandwidth, like a link of
    that speed: benchmarks use it to build a transfer-bound configuration on a CPU."""

    def __init__(self, name: str):
        self.worker = Worker(name)
        self.host_wait_s = 0.0  # never blocks the submitter: dependencies wait on the worker
        self.bytes_per_s: float | None = None

    def set_jitter(self, jitter: Callable[[], None]) -> None:
        self.worker.jitter = jitter

    def set_bandwidth(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: tuple[Handle, ...] = (), low: bool = False) -> Handle:
        """`low`: after every other copy already waiting (refreshes that must not delay streaming)."""
        return self.worker.submit(lambda: self._copy(dst, src), after, low)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        start = time.perf_counter()
        dst.copy_(src)
        if self.bytes_per_s:
            time.sleep(max(0.0, src.numel() * src.element_size() / self.bytes_per_s - (time.perf_counter() - start)))

    def marker(self) -> Handle:
        """The point the compute stream has reached; CPU compute is synchronous, so: now."""
        return DONE

    def close(self) -> None:
        self.worker.close()


class CudaCopier:
    """Copies on a dedicated CUDA stream; dependencies become stream waits, not host waits."""

    def __init__(self, name: str, device: torch.device, piece_bytes: int = 256 << 20):
        self.stream = torch.cuda.Stream(device=device)
        self.jitter: Callable[[], None] = no_jitter
        self.host_wait_s = 0.0  # time the submitter blocked on host-side (thread) dependencies
        self.piece_bytes = piece_bytes  # = the page-locking chunk: no copy spans two locked ranges

    def set_jitter(self, jitter: Callable[[], None]) -> None:
        self.jitter = jitter  # runs in the submitting thread: delays the issue of the copy

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: tuple[Handle, ...] = (), low: bool = False) -> Handle:
        """`low` is a hint a CUDA copy stream cannot honour: its copies run in the order issued."""
        for dependency in after:
            if isinstance(dependency, CudaHandle):
                self.stream.wait_event(dependency.event)
            else:  # a host job (the optimizer writing the source): a stream cannot wait on it
                start = time.perf_counter()
                dependency.synchronize()
                self.host_wait_s += time.perf_counter() - start
        self.jitter()
        piece = max(1, self.piece_bytes // src.element_size())
        with torch.cuda.stream(self.stream):
            for start in range(0, src.numel(), piece):  # copies start at a host buffer's base
                dst[start:start + piece].copy_(src[start:start + piece], non_blocking=True)
            return CudaHandle(self.stream)

    def marker(self) -> Handle:
        return CudaHandle(torch.cuda.current_stream())

    def close(self) -> None:
        self.stream.synchronize()


def make_copier(name: str, device: torch.device, piece_bytes: int = 256 << 20):
    return CudaCopier(name, device, piece_bytes) if device.type == "cuda" else ThreadCopier(name)
