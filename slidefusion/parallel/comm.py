"""Collectives behind handles: start now, wait exactly where the data is needed.

Every transfer goes through `Comm`, which (a) traces it, (b) counts the time the caller blocks in
`wait` as exposed communication, and (c) can emulate a slower link for benchmarks (`LinkDelay`).
A failed or timed-out collective raises `ParallelError` naming the rank, so a dead peer ends every
rank with an error instead of a hang (the process group's timeout bounds each wait).
"""

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from slidefusion.parallel.trace import Tracer


class ParallelError(RuntimeError):
    """A collective failed: a peer died, or it did not answer within the timeout."""


@dataclass(frozen=True)
class LinkDelay:
    """Benchmarking only: emulate a link of `gbps` gigabits per second and `latency_us` per transfer.

    Each rank's outgoing transfers queue on one emulated link: a transfer issued at t completes no
    earlier than max(t, previous completion) + latency + bytes / bandwidth. Real gloo traffic on one
    host is far faster, so the emulated time dominates, as an inter-node link would."""

    latency_us: float = 0.0
    gbps: float = float("inf")

    def seconds(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + nbytes * 8 / (self.gbps * 1e9)


class _LinkQueue:
    """When this rank's emulated outgoing link is next free (perf_counter seconds)."""

    free: float = 0.0


class _Works:
    """Several point-to-point works as one; holds the sent tensor until they are done."""

    def __init__(self, works: list, keep: Tensor | None):
        self.works, self.keep = works, keep

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        self.keep = None


class Handle:
    """An in-flight collective; `wait()` returns its output tensor once it has arrived."""

    def __init__(self, comm: "Comm", work, output: Tensor, name: str, issued: float, ready_at: float):
        self.comm, self.work, self.output, self.name = comm, work, output, name
        self.issued, self.ready_at, self.done = issued, ready_at, False

    def wait(self) -> Tensor:
        if self.done:
            return self.output
        start = time.perf_counter()
        try:
            if self.work is not None:
                self.work.wait()
        except Exception as error:  # gloo/NCCL raise RuntimeError subclasses with long texts
            raise ParallelError(f"rank {self.comm.global_rank}: {self.name} failed (a peer died, timed out or disagreed): "
                                f"{str(error).splitlines()[0][:200]}") from error
        delay = self.ready_at - time.perf_counter()
        if delay > 0:  # the emulated link has not delivered yet
            time.sleep(delay)
        end = time.perf_counter()
        self.comm.tracer.add(self.name, "comm", self.issued, end)
        self.comm.tracer.add(f"wait {self.name}", "wait", start, end)
        self.done = True
        return self.output


class Comm:
    """A process group plus tracing and optional link emulation.

    `rank` and `size` are this process's place in the group and the group's size (what the layouts
    use); `global_rank` is the process's rank in the whole job (what error messages name)."""

    def __init__(self, group=None, tracer: Tracer | None = None, link: LinkDelay | None = None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_rank = dist.get_rank()
        self.tracer = tracer or Tracer(rank=dist.get_rank(), enabled=False)
        self.link = link
        self._queue = _LinkQueue()

    def sub(self, group) -> "Comm":
        """A Comm on `group` (a subgroup this rank belongs to) sharing this one's tracer, link emulation
        and emulated link queue: a rank has one outgoing link whichever group a transfer belongs to."""
        comm = Comm(group, self.tracer, self.link)
        comm._queue = self._queue
        return comm

    def _ready_at(self, issued: float, nbytes: int) -> float:
        if self.link is None:
            return 0.0
        self._queue.free = max(issued, self._queue.free) + self.link.seconds(nbytes)
        return self._queue.free

    def all_to_all(self, send: Tensor, send_numels: list[int], recv_numels: list[int], name: str) -> Handle:
        """Start an uneven all-to-all of flat buffers: rank j gets send's j-th piece."""
        recv = send.new_empty(sum(recv_numels))
        issued = time.perf_counter()
        try:
            work = dist.all_to_all_single(recv, send.contiguous(), recv_numels, send_numels,
                                          group=self.group, async_op=True)
        except Exception as error:
            raise ParallelError(f"rank {self.global_rank}: {name} could not start: {str(error).splitlines()[0][:200]}") from error
        remote = (sum(send_numels) - send_numels[self.rank]) * send.element_size()
        return Handle(self, work, recv, name, issued, self._ready_at(issued, remote))

    def send_recv(self, send: Tensor | None, dst: int, recv: Tensor | None, src: int, tag: int, name: str) -> Handle:
        """Start sending `send` to group rank `dst` and receiving into `recv` from group rank `src` (a ring
        hop); an empty or None tensor moves nothing. `wait()` waits for both and returns `recv`. The
        emulated link delays the hop by what this rank sends (ring neighbours send alike)."""
        issued = time.perf_counter()
        ops = []
        if send is not None and send.numel():
            send = send.contiguous()
            ops.append(dist.P2POp(dist.isend, send, group=self.group, tag=tag, group_peer=dst))
        if recv is not None and recv.numel():
            ops.append(dist.P2POp(dist.irecv, recv, group=self.group, tag=tag, group_peer=src))
        try:
            # One batch: NCCL groups the pair, so a ring of 2 (the same peer both ways) cannot deadlock.
            works = dist.batch_isend_irecv(ops) if ops else []
        except Exception as error:
            raise ParallelError(f"rank {self.global_rank}: {name} could not start: {str(error).splitlines()[0][:200]}") from error
        nbytes = 0 if send is None else send.numel() * send.element_size()
        ready = self._ready_at(issued, nbytes) if nbytes else 0.0
        return Handle(self, _Works(works, send), recv, name, issued, ready)

    def all_gather(self, x: Tensor, name: str) -> list[Tensor]:
        """Blocking gather of equally-shaped tensors from every rank (pad uneven ones first)."""
        out = [torch.empty_like(x) for _ in range(self.size)]
        issued = time.perf_counter()
        try:
            work = dist.all_gather(out, x.contiguous(), group=self.group, async_op=True)
        except Exception as error:
            raise ParallelError(f"rank {self.global_rank}: {name} could not start: {str(error).splitlines()[0][:200]}") from error
        remote = x.numel() * x.element_size() * (self.size - 1)
        Handle(self, work, x, name, issued, self._ready_at(issued, remote)).wait()
        return out
