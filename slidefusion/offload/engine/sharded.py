"""The offload engine under data parallelism: each rank owns a shard of every group's host state.

    shard       group g's trainable prefix [0, n) is cut at W + 1 points (W ranks: data x sequence
                parallel); rank r holds the master weights and AdamW moments of [cuts[r], cuts[r+1])
                only, and runs AdamW on them alone
    backward    as block g's gradient leaves autograd it is reduce-scattered (asynchronous, behind a
                handle): the device keeps computing earlier blocks while it travels. The d2h copy of
                this rank's reduced shard (or, on a CPU device, the update itself) waits on that handle
    publish     after the update, the rest of group g's compute copy comes from the other ranks, on a
                thread of its own: an all-gather over every rank (one host copy per rank), or, with one
                copy per node shared through /dev/shm (`shared_host`), over the ranks of the other
                nodes only, then a barrier of the node's ranks. Its handle is what the next forward's
                prefetch of block g waits for, so the all-gather runs under the update of later groups
                and the forward of earlier blocks
    scale       the reduced gradient is a sum over the W ranks; the update scales it by 1 / dp (dp =
                data-parallel ranks: sequence-parallel ranks share a sample, their parts add up)

Cuts fall where splitting an update changes nothing, at quantization block starts (a tensor's start
plus a multiple of 2048 values): an 8-bit block's absmax stays with one rank, and the fp32 kernel's
vector body and scalar tail of each tensor stay where they were, so a shard's update is bitwise that
part of the whole group's. Collectives need equal pieces, so shards are padded to the largest one.

Every thread that issues collectives has its own process group (`RankGroups`): collectives on one
group must be issued in the same order on every rank, which two threads sharing one could not promise.
"""

import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slidefusion.offload.engine.device import GradientShipper
from slidefusion.offload.optim.formats import block_starts
from slidefusion.offload.engine.layout import REST
from slidefusion.offload.engine.transfer import DONE, Handle, Worker
from slidefusion.parallel.comm import LinkDelay, ParallelError

# torch's names for the one-tensor collectives (the older ones warn from torch 2.10 on)
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


@dataclass(frozen=True)
class RankGroups:
    """The ranks of a run as the engine sees them, and one process group per issuing thread.

    world, rank: every rank holds a shard (data x sequence parallel); dp: data-parallel ranks (the
    gradient's divisor); local_rank, local_world: this rank's place on its node. `reduce` (the
    default backend, NCCL on GPUs: compute thread, the gradients' reduce-scatter on the device);
    the others are gloo groups of host tensors: `host` (optimizer thread: the clipping norm; the
    compute thread while the optimizer is idle: state gathers), `gather` (publish thread: the compute
    copy's other shards; None: nothing to fetch) whose members own the shards `gather_ranks`, `node`
    (publish thread: the barrier of ranks sharing one host copy; None: not shared). `link`: an
    emulated link for benchmarks; `overlap=False` waits on every collective as soon as it is issued
    (the plain schedule a benchmark compares against)."""

    world: int
    rank: int
    dp: int
    local_rank: int
    local_world: int
    reduce: object
    host: object
    gather: object | None
    gather_ranks: tuple[int, ...]
    node: object | None
    link: LinkDelay | None = None
    overlap: bool = True

    @property
    def shared(self) -> bool:
        return self.node is not None


def make_rank_groups(local_world: int, shared: bool, timeout_s: float, dp: int | None = None,
                     link: LinkDelay | None = None, overlap: bool = True) -> RankGroups:
    """The engine's groups over the initialised world (ranks node-major, `local_world` per node,
    as torchrun numbers them). Every rank must call this at the same point, in the same order."""
    import datetime

    world, rank = dist.get_world_size(), dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)

    def group(ranks=None):
        return dist.new_group(ranks, timeout=timeout, backend="gloo")

    reduce, host = dist.new_group(timeout=timeout), group()
    nodes, node_index, local = world // local_world, rank // local_world, rank % local_world
    if not shared:
        return RankGroups(world, rank, dp or world, local, local_world, reduce, host, group(), tuple(range(world)),
                          None, link, overlap)
    node = cross = None
    for m in range(nodes):  # every rank takes part in creating every group
        g = group(list(range(m * local_world, (m + 1) * local_world)))
        node = g if m == node_index else node
    for i in range(local_world):
        members = [m * local_world + i for m in range(nodes)]
        g = group(members) if nodes > 1 else None
        cross = (g, tuple(members)) if i == local else cross
    return RankGroups(world, rank, dp or world, local, local_world, reduce, host, cross[0], cross[1], node, link,
                      overlap)


@dataclass(frozen=True)
class Sharding:
    """Where group buffers are cut (`GroupState` reads this): rank `rank` of `world`; `writes_compute`:
    this rank writes the parts of a shared compute copy nobody owns (the frozen parameters)."""

    world: int
    rank: int
    writes_compute: bool = True

    def cuts(self, layout, n: int, moments: str) -> list[int]:
        """W + 1 cut points of [0, n), each a quantization block start (whatever `moments`: see the
        module docstring), as near to even as those allow."""
        allowed = block_starts(layout, n).tolist()
        cuts = [0]
        for j in range(1, self.world):
            target = j * n / self.world
            best = min(allowed, key=lambda s: (abs(s - target), s))
            cuts.append(max(cuts[-1], best))
        return cuts + [n]


def piece(cuts: list[int]) -> int:
    """The padded size of one shard: the largest."""
    return max(b - a for a, b in zip(cuts, cuts[1:]))


class CollectiveHandle(Handle):
    """An asynchronous collective (`async_op=True` work): `wait` orders the current CUDA stream
    after it (on CPU: blocks), `synchronize` blocks the calling thread. With an emulated link it
    completes no earlier than `ready_at`. A failure names the rank and the collective, one line."""

    def __init__(self, work, name: str, rank: int, ready_at: float = 0.0, cuda: bool = False):
        self.work, self.name, self.rank, self.ready_at, self.cuda = work, name, rank, ready_at, cuda
        self.waited_s = 0.0

    def _finish(self) -> None:
        start = time.perf_counter()
        try:
            self.work.wait()
        except Exception as error:  # gloo / NCCL raise RuntimeError subclasses with long texts
            raise ParallelError(f"rank {self.rank}: {self.name} failed (a peer died, timed out or disagreed): "
                                f"{str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__}") from error
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        self.waited_s += time.perf_counter() - start

    def wait(self) -> None:
        self._finish()

    def synchronize(self) -> None:
        self._finish()
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def done(self) -> bool:
        return self.work.is_completed() and time.perf_counter() >= self.ready_at


class Collectives:
    """Issues this engine's collectives: each returns a `CollectiveHandle`; counts their bytes and
    the seconds callers blocked on them; emulates `groups.link` (one link per rank, shared by the
    engine's threads)."""

    def __init__(self, groups: RankGroups, device: torch.device):
        self.groups, self.cuda = groups, device.type == "cuda"
        self.bytes, self._link_free, self._lock = 0, 0.0, threading.Lock()
        self.handles: list[CollectiveHandle] = []

    def _ready_at(self, nbytes: int) -> float:
        if self.groups.link is None:
            return 0.0
        with self._lock:
            self._link_free = max(time.perf_counter(), self._link_free) + self.groups.link.seconds(nbytes)
            return self._link_free

    def _issue(self, name: str, nbytes: int, start) -> CollectiveHandle:
        try:
            work = start()
        except Exception as error:
            raise ParallelError(f"rank {self.groups.rank}: {name} could not start: "
                                f"{str(error).strip().splitlines()[0][:200]}") from error
        self.bytes += nbytes
        handle = CollectiveHandle(work, name, self.groups.rank, self._ready_at(nbytes), self.cuda)
        self.handles = [h for h in self.handles if not h.done()] + [handle]
        if not self.groups.overlap:  # the plain schedule: wait right here
            handle.synchronize()
        return handle

    def reduce_scatter(self, out: torch.Tensor, send: torch.Tensor, name: str) -> CollectiveHandle:
        group = self.groups.reduce
        moved = (send.numel() - out.numel()) * send.element_size()
        return self._issue(name, moved, lambda: REDUCE_SCATTER(out, send, group=group, async_op=True))

    def all_gather(self, out: torch.Tensor, send: torch.Tensor, group, name: str) -> CollectiveHandle:
        moved = (out.numel() - send.numel()) * send.element_size()
        return self._issue(name, moved, lambda: ALL_GATHER(out, send, group=group, async_op=True))

    def all_reduce(self, x: torch.Tensor, group, name: str) -> CollectiveHandle:
        return self._issue(name, x.numel() * x.element_size(), lambda: dist.all_reduce(x, group=group, async_op=True))

    @property
    def waited_s(self) -> float:
        return sum(h.waited_s for h in self.handles)


class ShardedShipper(GradientShipper):
    """`GradientShipper` under data parallelism: a group's gradient, gathered into a flat buffer on
    the device, is reduce-scattered at once; only this rank's reduced shard goes to host staging
    (on a CPU device the reduce-scatter writes staging itself), and the update waits on the handle."""

    def __init__(self, state, policy, d2h, strategy, comm: Collectives, world: int):
        # not GradientShipper.__init__: its buffers are sized for whole gradients, these for padded shards
        self.free: list[Handle] = [DONE, DONE]
        self.turn, self.d2h, self.strategy, self.holds = 0, d2h, strategy, False
        self.bytes, self.wait_s, self.comm, self.world = 0, 0.0, comm, world
        device, dtype = policy.torch_device, policy.compute_dtype
        padded = max(world * piece(g.cuts) for g in state.groups.values())
        self.direct = policy.direct
        self.buffers = [torch.zeros(padded, dtype=dtype, device=device) for _ in range(2)]
        uneven = any(_uneven(g.cuts, world) for g in state.groups.values())
        self.sends = [torch.zeros(padded, dtype=dtype, device=device) for _ in range(2)] if uneven else self.buffers
        shard = max(piece(g.cuts) for g in state.groups.values())
        self.outs = [] if self.direct else [torch.empty(shard, dtype=dtype, device=device) for _ in range(2)]

    def ship(self, group, grads: list, step: int, lr: float) -> None:
        if group.n_train == 0:
            return
        self.check_grads(group, grads)
        turn, self.turn = self.turn, 1 - self.turn
        self._wait(self.free[turn])  # the reduce-scatter (and copy) two groups back are done with this turn's buffers
        host, free = self.strategy.staging(group)
        flat, size = self.buffers[turn], piece(group.cuts)
        for view, grad in zip(group.layout.views(flat, len(group.trainable)), grads):
            view.copy_(grad)
        send = _padded(flat, self.sends[turn], group.cuts, size, self.world)
        if self.direct:
            self._wait(free)  # the reduce-scatter writes staging
        out = host[:size] if self.direct else self.outs[turn][:size]
        reduced = self.comm.reduce_scatter(out, send, f"reduce-scatter {group.name}")
        shard = out[:group.n_own]
        if self.direct:
            arrived = reduced
        else:
            self._wait(free)
            if self.comm.cuda:  # the copy stream waits on the collective; the compute thread does not
                with torch.cuda.stream(self.d2h.stream):
                    reduced.wait()
            arrived = self.d2h.copy(host[:group.n_own], shard, (self.d2h.marker(),) if self.comm.cuda else (reduced,))
        self.free[turn] = arrived
        self.bytes += group.n_own * flat.element_size()
        self.strategy.landed(group, host[:group.n_own], arrived, step, lr)


def _uneven(cuts: list[int], world: int) -> bool:
    size = piece(cuts)
    return any(cuts[j] != j * size for j in range(world))


def _padded(flat: torch.Tensor, send: torch.Tensor, cuts: list[int], size: int, world: int) -> torch.Tensor:
    """The gradient as `world` pieces of `size`: `flat` itself when the cuts are even, else a copy."""
    if send is flat or not _uneven(cuts, world):
        return flat[:world * size]
    for j, (a, b) in enumerate(zip(cuts, cuts[1:])):
        send[j * size:j * size + b - a].copy_(flat[a:b])
    return send[:world * size]


class ShardNorms:
    """Clipping across the ranks: each rank squares and sums its shard of every parameter's
    gradient; one all-reduce (on the optimizer thread's group) adds them up."""

    def __init__(self, comm: Collectives, scale: float):
        self.comm, self.scale = comm, scale

    def of(self, group, host: torch.Tensor) -> torch.Tensor:
        """(trainable parameters of `group`,) fp32 sums of squares over this rank's shard."""
        out = torch.zeros(len(group.trainable), dtype=torch.float32)
        for i, entry in enumerate(group.layout.entries[:len(group.trainable)]):
            a, b = max(entry.offset, group.lo), min(entry.offset + entry.numel, group.hi)
            if a < b:
                out[i] = host[a - group.lo:b - group.lo].float().square().sum()
        return out

    def coefficient(self, state, norms: dict, max_norm: float) -> float:
        from slidefusion.offload.optim.adam import clip_coefficient

        squares = torch.stack([norms[key][i] for key, i in state.norm_order])
        self.comm.all_reduce(squares, self.comm.groups.host, "clipping norm").synchronize()
        return clip_coefficient(list(squares.sqrt() * self.scale), max_norm)


class Publisher:
    """After a group's update: the other shards of its compute copy, on the publish thread
    (see the module docstring); then `refresh(key)` uploads a resident group's new weights."""

    def __init__(self, state, comm: Collectives, refresh):
        self.state, self.comm, self.refresh, groups = state, comm, refresh, comm.groups
        self.worker = Worker("offload-publish")
        members = len(groups.gather_ranks) if groups.gather is not None else 1
        size = max(piece(g.cuts) for g in state.groups.values())
        dtype = state.rest.compute.dtype
        self.send = torch.empty(size, dtype=dtype)
        self.out = torch.empty(members * size, dtype=dtype) if members > 1 else None
        self.flag = torch.zeros(1)

    def publish(self, group, after: Handle) -> Handle:
        handle = self.worker.submit(lambda: self._publish(group), (after,))
        if not self.comm.groups.overlap:
            handle.synchronize()
        return handle

    def _publish(self, group) -> None:
        groups, size = self.comm.groups, piece(group.cuts)
        if self.out is not None:
            self.send[:group.n_own].copy_(group.compute[group.lo:group.hi])
            self.comm.all_gather(self.out[:len(groups.gather_ranks) * size], self.send[:size], groups.gather,
                                 f"all-gather {group.name}").synchronize()
            for i, owner in enumerate(groups.gather_ranks):
                a, b = group.cuts[owner], group.cuts[owner + 1]
                if owner != groups.rank:
                    group.compute[a:b].copy_(self.out[i * size:i * size + b - a])
        if groups.node is not None:  # every local rank has written its shards of the shared copy
            self.comm.all_reduce(self.flag, groups.node, f"node barrier {group.name}").synchronize()
        group.seen_versions = group.versions()  # these writes are ours, not a write through the model
        self.refresh(group.key)

    def publish_all(self) -> None:
        """Every group at once, in one order on every rank (after construction or a state load)."""
        for key in (REST, *range(len(self.state.blocks))):
            self.worker.submit(lambda g=self.state.groups[key]: self._publish(g)).synchronize()

    def close(self) -> None:
        self.worker.close()


class DataParallel:
    """What the engine's parts read under data parallelism (`OffloadEngine(..., ranks=RankGroups)`):
    the `sharding` of its host state, the staging size and gradient scale of its update strategy,
    the collectives, the clipping rule, and the publisher (started once the state exists)."""

    def __init__(self, groups: RankGroups, device: torch.device):
        self.groups, self.comm = groups, Collectives(groups, device)
        self.sharding = Sharding(groups.world, groups.rank, writes_compute=not groups.shared or groups.local_rank == 0)
        self.grad_scale = 1.0 / groups.dp
        self.publisher: Publisher | None = None
        self.arena = None
        self.shared_bytes = 0

    def compute_allocator(self, model, blocks, policy, allocator):
        """`allocate_compute(numel, dtype)` for `HostState`: pieces of one /dev/shm arena shared by the
        node's ranks (None when host copies are not shared: each rank allocates its own)."""
        if not self.groups.shared:
            return None
        from slidefusion.offload.engine.layout import layout_of, split_groups
        from slidefusion.offload.engine.shared_host import SharedArena, arena_bytes

        specs, rest = split_groups(model, blocks)
        numels = [layout_of(spec.named).numel for spec in (*specs, rest)]
        self.shared_bytes = arena_bytes(numels, policy.compute_dtype)
        self.arena = SharedArena(self.shared_bytes, self.groups.node, self.groups.local_rank)
        return lambda numel, dtype: allocator.adopt(self.arena.take(numel, dtype))

    def staging_numel(self, group) -> int:
        return piece(group.cuts)

    def norms(self) -> ShardNorms:
        return ShardNorms(self.comm, self.grad_scale)

    def start(self, state, refresh) -> None:
        """Fill every group's compute copy from its owners (the shards written at construction)."""
        self.publisher = Publisher(state, self.comm, refresh)
        self.publisher.publish_all()

    def publish(self, group, after: Handle) -> Handle:
        return self.publisher.publish(group, after)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
