"""One host compute copy per node: the ranks of a node map the same pages of one /dev/shm file.

Local rank 0 creates the file at its full size (`posix_fallocate`, so a /dev/shm that is too small
fails here with a one-line error, not with SIGBUS mid-step), every local rank maps it with
`torch.UntypedStorage.from_file(shared=True)`, and once all have mapped it local rank 0 removes its
name: the pages live as long as some rank still maps them, so nothing is left behind however the
run ends. `SharedArena.take` hands out page-aligned pieces in call order, the same order on every
rank (the engine's groups in call order), so each piece is the same memory on every local rank.
"""

import os
import tempfile

import torch
import torch.distributed as dist

from slidefusion.core.errors import UserError
from slidefusion.offload.plan.plan import human

PAGE = 4096
SHM = "/dev/shm"


def page_round(nbytes: int) -> int:
    return -(-nbytes // PAGE) * PAGE


def shm_free_bytes(folder: str = SHM) -> int | None:
    """Bytes a new file in `folder` can still take (None where unknown)."""
    try:
        stat = os.statvfs(folder)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def check_room(nbytes: int, folder: str = SHM) -> None:
    """A one-line UserError when `folder` cannot hold `nbytes`, saying how much and where."""
    free = shm_free_bytes(folder)
    if free is None:
        raise UserError(f"parallel.shared_host=true needs {folder} (shared memory) for the node's one host copy of "
                        f"{human(nbytes)}, and there is none here; set parallel.shared_host=false")
    if free < nbytes:
        raise UserError(f"parallel.shared_host=true needs {human(nbytes)} of shared memory in {folder} for the node's one "
                        f"host compute copy, but {folder} has {human(free)} free; enlarge it (docker run --shm-size=..., "
                        f"or mount -o remount,size=... {folder}) or set parallel.shared_host=false (one copy per rank)")


class SharedArena:
    """`nbytes` of host memory mapped by every rank of `node_group` (the ranks of this node)."""

    def __init__(self, nbytes: int, node_group, local_rank: int, folder: str = SHM):
        self.nbytes, self.used = page_round(max(nbytes, 1)), 0
        name = [None]
        error = [None]
        if local_rank == 0:
            try:
                name[0] = _create(self.nbytes, folder)
            except UserError as failure:
                error[0] = str(failure)
        dist.broadcast_object_list(error, src=_first(node_group), group=node_group)
        if error[0] is not None:
            raise UserError(error[0])
        dist.broadcast_object_list(name, src=_first(node_group), group=node_group)
        try:
            storage = torch.UntypedStorage.from_file(name[0], shared=True, nbytes=self.nbytes)
            self.bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
            dist.barrier(group=node_group)  # every local rank maps the file before its name goes
        finally:
            if local_rank == 0:
                _unlink(name[0])
        self.path = name[0]

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The next `numel` elements of `dtype` (a page-aligned 1-D view of the shared pages)."""
        size = torch.empty((), dtype=dtype).element_size()
        start, self.used = self.used, self.used + page_round(numel * size)
        if self.used > self.nbytes:
            raise RuntimeError(f"shared arena of {self.nbytes} bytes exhausted (a piece of {numel * size} bytes asked)")
        return self.bytes[start:start + numel * size].view(dtype)


def _first(group) -> int:
    """The global rank of the group's first member."""
    return dist.get_global_rank(group, 0)


def _create(nbytes: int, folder: str) -> str:
    check_room(nbytes, folder)
    fd, path = tempfile.mkstemp(prefix="slidefusion-host-", dir=folder)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as error:
        os.close(fd)
        _unlink(path)
        raise UserError(f"parallel.shared_host=true could not reserve {human(nbytes)} in {folder} ({error.strerror}); "
                        "enlarge it or set parallel.shared_host=false") from None
    os.close(fd)
    return path


def _unlink(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def arena_bytes(numels: list[int], dtype: torch.dtype) -> int:
    """Bytes of an arena holding pieces of these sizes (each page-aligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(page_round(n * size) for n in numels)
