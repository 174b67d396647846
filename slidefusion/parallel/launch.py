"""Starting ranks: under torchrun (`init_distributed`) or from Python (`spawn`), with timeouts.

The backend follows the device: NCCL when CUDA is available, gloo on CPU. Every collective is
bounded by the process group's timeout, and `spawn` bounds the whole job, so a dead or stuck rank
ends the others with an error instead of a hang.
"""

import datetime
import multiprocessing.connection as mp_connection
import os
import pickle
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from slidefusion.errors import UserError
from slidefusion.parallel.comm import ParallelError
from slidefusion.parallel.plan import DEFAULT_TIMEOUT_S


def pick_backend() -> tuple[str, torch.device]:
    """("nccl", cuda:LOCAL_RANK) with CUDA, else ("gloo", cpu)."""
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return "nccl", torch.device("cuda", local)
    return "gloo", torch.device("cpu")


def launcher_world() -> int:
    """The world size torchrun (or `spawn`) put in the environment, or a UserError saying how to launch."""
    missing = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise UserError(f"--parallel needs a launcher: run under `torchrun --nproc-per-node P -m slidefusion ...` "
                        f"(missing {', '.join(missing)})")
    return int(os.environ["WORLD_SIZE"])


def init_distributed(timeout_s: float = DEFAULT_TIMEOUT_S) -> torch.device:
    """Join the process group torchrun (or `spawn`) described in the environment; returns the device."""
    launcher_world()
    backend, device = pick_backend()
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    return device


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, timeout_s: float, sender, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    torch.set_num_threads(int(os.environ.get("SLIDEFUSION_WORKER_THREADS", "1")))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(rank, world, *args)
        sender.send_bytes(_packed({"ok": True, "value": value}))
        dist.destroy_process_group()
    except BaseException as error:  # report, then exit non-zero: the parent names the failed rank
        sender.send_bytes(_packed({"ok": False, "error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc()}))
        os._exit(1)


def _packed(record: dict) -> bytes:
    """A rank's record as bytes (plain pickle: tensors travel by value), so the parent can read them
    after the rank has exited; `Connection.send` would share tensor storage, which needs the sender alive."""
    return pickle.dumps(record)


def spawn(fn, world: int, *args, timeout_s: float = 120.0, job_timeout_s: float | None = None) -> list:
    """Run `fn(rank, world, *args)` on `world` gloo ranks on this machine; returns each rank's value.

    `fn` must be importable (a module-level function). Collectives time out after `timeout_s`; the
    whole job is killed after `job_timeout_s` (default 3 x timeout_s). Raises `ParallelError`
    naming every rank that failed. Each rank sends its value (or its error) back through a pipe."""
    if world < 1:
        raise UserError(f"world={world} must be >= 1")
    ctx = mp.get_context("spawn")
    port = free_port()
    pipes = [ctx.Pipe(duplex=False) for _ in range(world)]
    procs = [ctx.Process(target=_worker, args=(r, world, port, timeout_s, pipes[r][1], fn, args), daemon=True)
             for r in range(world)]
    for p, (_, sender) in zip(procs, pipes):
        p.start()
        sender.close()  # the child holds it now: a rank that dies closes its end, and the reader sees EOF
    deadline = time.monotonic() + (job_timeout_s or 3 * timeout_s)
    records = _receive([reader for reader, _ in pipes], deadline)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    stuck = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in stuck:  # only our own children, by handle
        procs[r].kill()
        procs[r].join()
    return _collect(records, procs, stuck)


def _receive(readers: list, deadline: float) -> list:
    """Each rank's record, or None for a rank that closed its pipe without one or sent none by the deadline."""
    records, waiting = [None] * len(readers), dict(enumerate(readers))
    while waiting and time.monotonic() < deadline:
        ready = mp_connection.wait(list(waiting.values()), timeout=max(0.0, deadline - time.monotonic()))
        for rank in [r for r, reader in waiting.items() if reader in ready]:
            try:
                records[rank] = pickle.loads(waiting[rank].recv_bytes())  # our own child's record
            except EOFError:
                pass  # died before sending
            waiting.pop(rank).close()
    for reader in waiting.values():
        reader.close()
    return records


def _collect(records: list, procs, stuck: list[int]) -> list:
    values, failures = [], []
    for r, (p, record) in enumerate(zip(procs, records)):
        if r in stuck:
            failures.append(f"rank {r} still running at the job deadline (killed)")
        elif record is None:
            failures.append(f"rank {r} died with exit code {p.exitcode}")
        elif not record["ok"]:
            failures.append(f"rank {r} failed: {record['error'].splitlines()[0][:300]}")
        else:
            values.append(record["value"])
    if failures:
        raise ParallelError("; ".join(failures))
    return values
