"""Training on several ranks: the launch, this rank's place, and the rules every rank keeps.

`torchrun --nproc-per-node N [--nnodes M ...] -m slidefusion train CONFIG ...` starts one process
per GPU (or CPU rank) with RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE in its environment;
`start` joins them into one process group (NCCL on GPUs, gloo on CPUs) and checks, before any
work, that the split is valid and that every rank was given the same config.

The world is `dp x sp` (`parallel.sp`): consecutive groups of `sp` ranks share each sample (sequence
parallelism), and the `dp` groups each take their own rows of every step's global batch of
dp x run.batch_size samples (`rows`). The step's randomness is drawn for the whole global batch, so a
rank's samples are a function of (seed, step, rank) alone, and the run sees what one process would
see with the whole batch.

Only rank 0 writes: the run folder's lock, logs, caches, checkpoints. What it does on behalf of
all goes through `agree`: the others wait for it and raise the same one-line error if it failed.
A dead or stuck peer ends every rank within `parallel.timeout_s` (the groups' timeout).
"""

import datetime
import hashlib
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from slidefusion.diffusion.rows import Rows
from slidefusion.core.errors import NonFiniteError, UserError, check

LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class PeerFailure(UserError):
    """Another rank failed, died or stopped answering: one line, exit code 1."""

    exit_code = 1


@dataclass(frozen=True)
class Place:
    """This rank in the world: `world` ranks, `local_world` per node (node-major numbering, as
    torchrun gives), `sp` ranks per sample."""

    world: int = 1
    rank: int = 0
    local_world: int = 1
    sp: int = 1

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sp

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world


class Distributed:
    """One process's part in a run (a single process is the world of one: every method is then
    free). `device` is this rank's device."""

    def __init__(self, place: Place, device: torch.device, config=None):
        self.place, self.device, self.config = place, device, config
        self._sp_group = self._engine_groups = None

    @property
    def active(self) -> bool:
        return self.place.world > 1

    @property
    def writer(self) -> bool:
        return self.place.rank == 0

    def rows(self, batch: int) -> Rows | None:
        """This rank's rows of a step's global batch (None on one process: all of it)."""
        if self.place.dp == 1:
            return None
        return Rows(self.place.dp_rank * batch, batch, self.place.dp * batch)

    def mean(self, value: float) -> float:
        """The mean of `value` over the ranks (a loss: every rank gets the global batch's)."""
        if not self.active:
            return value
        total = torch.tensor([value], dtype=torch.float64)
        dist.all_reduce(total)
        return float(total.item()) / self.place.world

    def agree(self, fn, *args):
        """`fn(*args)` on rank 0 alone; every rank returns its result (rank 0's; None elsewhere) or
        raises the same one-line error when it failed there."""
        result, failure = None, None
        if self.writer:
            try:
                result = fn(*args)
            except UserError as error:
                failure = (str(error), getattr(error, "exit_code", 2))
            except Exception as error:  # noqa: BLE001 - told to the others, then raised here as it was
                failure = (f"rank 0 failed: {type(error).__name__}: {str(error).strip()[:300]}", 1)
                if self.active:
                    _broadcast([failure])
                raise
        if self.active:
            failure = _broadcast([failure])[0]
        if failure is not None:
            error = UserError(failure[0]) if failure[1] == 2 else PeerFailure(failure[0])
            error.exit_code, error.agreed = failure[1], True
            raise error
        return result

    def together(self, fn, *args):
        """`fn(*args)` on every rank, then one all-gather of the outcomes: if it failed anywhere, every
        rank raises (rank 0 prints the first failure, naming its rank unless all failed alike)."""
        if not self.active:
            return fn(*args)
        result, mine = None, None
        try:
            result = fn(*args)
        except UserError as error:
            mine = (str(error), getattr(error, "exit_code", 2))
        outcomes = [None] * self.place.world
        dist.all_gather_object(outcomes, mine)
        failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
        if not failed:
            return result
        rank, (message, code) = failed[0]
        alike = len(failed) == self.place.world and len({m for _, (m, _) in failed}) == 1
        error = UserError(message if alike else f"rank {rank}: {message}")
        error.exit_code, error.agreed = code, True
        raise error

    def barrier(self) -> None:
        if self.active:
            dist.barrier()

    def sp_group(self):
        """This rank's sequence-parallel group (consecutive ranks); every rank creates every group."""
        if self._sp_group is None:
            sp, timeout = self.place.sp, datetime.timedelta(seconds=self.config.parallel.timeout_s)
            for first in range(0, self.place.world, sp):
                group = dist.new_group(list(range(first, first + sp)), timeout=timeout)
                if first <= self.place.rank < first + sp:
                    self._sp_group = group
        return self._sp_group

    def resident_optimizer(self, model):
        """The resident optimizer on these ranks: plain data parallel, or FSDP2 (`parallel.fsdp`)."""
        from slidefusion.training.dist_optim import resident_optimizer

        return resident_optimizer(model, self.config, self)

    def sequence_parallel(self, model) -> None:
        """The Ulysses hooks of this rank's sample group on `model` (nothing with `parallel.sp=1`);
        before the offload engine's hooks, which then run the hooked blocks."""
        from slidefusion.training.dist_optim import sequence_parallel

        sequence_parallel(model, self)

    def engine_groups(self):
        """The offload engine's process groups (None on one process)."""
        if not self.active:
            return None
        if self._engine_groups is None:
            from slidefusion.offload.engine.sharded import make_rank_groups

            parallel = self.config.parallel
            self._engine_groups = make_rank_groups(self.place.local_world, parallel.shared_host, parallel.timeout_s,
                                                   dp=self.place.dp)
        return self._engine_groups


def _broadcast(box: list) -> list:
    dist.broadcast_object_list(box, src=0)
    return box


def launched() -> bool:
    """Started by torchrun (or `launch.spawn`) with more than one rank, or inside a process group."""
    return dist.is_available() and (dist.is_initialized() or int(os.environ.get("WORLD_SIZE", "1")) > 1)


def start(config) -> Distributed:
    """This process's part in the run of `config`: a single process, or (under torchrun) a rank of
    an initialised process group whose split and config are checked here, before any work."""
    try:
        return _start(config)
    except UserError as error:
        error.agreed = True  # every rank reaches the same verdict
        raise


def _start(config) -> Distributed:
    parallel = config.parallel
    if not launched():
        check(parallel.sp == 1, f"parallel.sp={parallel.sp} needs {parallel.sp} ranks or a multiple: launch with "
                                f"`torchrun --nproc-per-node {parallel.sp} -m slidefusion train ...`")
        return Distributed(Place(), torch.device(config.run.device), config)
    missing = [name for name in LAUNCH_VARIABLES if name not in os.environ and not dist.is_initialized()]
    check(not missing, f"a multi-rank run needs a launcher: run `torchrun --nproc-per-node N -m slidefusion train ...` "
                       f"(missing {', '.join(missing)})")
    device = _device(config.run.device)
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=parallel.timeout_s),
                                device_id=device if device.type == "cuda" else None)
    world, rank = dist.get_world_size(), dist.get_rank()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    place = Place(world, rank, local_world, parallel.sp)
    check_same_config(config)
    check(world % parallel.sp == 0, f"parallel.sp={parallel.sp} does not divide the world of {world} ranks "
                                    f"(data parallel x sequence parallel must equal it); valid: "
                                    f"{', '.join(str(k) for k in range(1, world + 1) if world % k == 0)}")
    check(world % local_world == 0, f"{world} ranks do not fill nodes of {local_world} (LOCAL_WORLD_SIZE): "
                                    "every node must run the same number of ranks")
    return Distributed(place, device, config)


def _device(name: str) -> torch.device:
    """cuda:LOCAL_RANK for a run on GPUs (every rank its own), else the CPU."""
    device = torch.device(name)
    if device.type != "cuda":
        return device
    local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    check(local < count, f"run.device={name}: local rank {local} has no GPU of its own (this node has {count}); "
                         "start at most one rank per GPU (torchrun --nproc-per-node)")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def config_text(config) -> str:
    return json.dumps(config.to_dict(), sort_keys=True, default=str)


def check_same_config(config) -> None:
    """Every rank was started with the same config (one all-gather of its hash; on a mismatch, of
    the configs, to name the first key that differs)."""
    text = config_text(config)
    digest = hashlib.sha256(text.encode()).hexdigest()
    hashes = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, digest)
    if len(set(hashes)) == 1:
        return
    texts = [None] * dist.get_world_size()
    dist.all_gather_object(texts, text)
    other = next(r for r, h in enumerate(hashes) if h != hashes[0])
    key = _first_difference(json.loads(texts[0]), json.loads(texts[other]))
    raise UserError(f"the ranks were started with different configs: rank {other} differs from rank 0 at {key}; "
                    "give every rank the same config file and overrides")


def _first_difference(a, b, prefix: str = "") -> str:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return _first_difference(a.get(key), b.get(key), f"{prefix}.{key}" if prefix else key)
    return f"{prefix} ({a!r} on rank 0, {b!r} there)"


PEER_SIGNS = ("connection closed", "connection reset", "timed out", "timeout", "broken pipe", "peer")


def peer_failed(error: BaseException) -> bool:
    """Whether `error` (or what caused it) is a collective that failed: a dead, stuck or exited peer."""
    from slidefusion.parallel.comm import ParallelError

    seen = error
    while seen is not None:
        if isinstance(seen, ParallelError) or (hasattr(dist, "DistError") and isinstance(seen, dist.DistError)):
            return True
        if isinstance(seen, RuntimeError) and any(sign in str(seen).lower() for sign in PEER_SIGNS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def rank_of_process() -> int:
    """This process's rank under a launcher (RANK), or in its process group; 0 otherwise."""
    return int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0))


def shard_note(config) -> str:
    """How the run splits, for the first log line of rank 0."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    sp = config.parallel.sp
    mode = ("offload engine, host state sharded" if config.offload.enabled
            else "FSDP2" + (" + CPU offload" if config.parallel.cpu_offload else "") if config.parallel.fsdp
            else "data parallel")
    return (f"{world} ranks = {world // sp} data parallel x {sp} sequence parallel ({mode}); global batch "
            f"{world // sp * config.run.batch_size}")


__all__ = ["Distributed", "PeerFailure", "Place", "check_same_config", "launched", "peer_failed",
           "rank_of_process", "shard_note", "start"]
