"""`SpillFile`: one scratch file for checkpoints past host memory, in large aligned direct writes.

The file is opened with O_TMPFILE where the filesystem has it: it never has a name, so nothing is
left behind whatever happens to the process (the kernel frees it when the descriptor closes, on
success, on an exception and on a kill alike). Elsewhere it is `slidefusion-spill-<pid>-<16 hex>.tmp`,
held under an exclusive `flock` while this process lives and removed on close; the next start in the
same folder removes exactly those names whose lock is free (their owner died), never anything
else: not another live run's files, not symlinks, not other names.

I/O goes through a page-aligned staging buffer in chunks of `CHUNK` bytes at 4 KiB-aligned
offsets, with O_DIRECT where the filesystem accepts it (no page cache: the host memory a spilled
checkpoint frees stays free); a filesystem that refuses it, at open or at the first write, gets
buffered I/O instead. Sizes are bytes.
"""

import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import weakref

import torch

from slidefusion.errors import UserError

ALIGN = 4096  # offsets and lengths of direct I/O: a multiple of every logical block size in use
CHUNK = 16 << 20  # bytes per read or write call
NAME = re.compile(r"slidefusion-spill-\d+-[0-9a-f]{16}\.tmp")
KEY = "offload.spill_dir"


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def remove_stale(folder: str) -> list[str]:
    """Remove the spill files in `folder` whose owner process has died; return their names."""
    removed = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        try:
            if not NAME.fullmatch(name) or not stat.S_ISREG(os.lstat(path).st_mode):
                continue
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:  # gone meanwhile, or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: nobody holds it any more
        except OSError:
            os.close(fd)
            continue
        os.unlink(path)
        os.close(fd)
        removed.append(name)
    return removed


def create_named(folder: str, direct: bool) -> tuple[int, str]:
    """A new locked spill file with this process's name pattern: (descriptor, path)."""
    path = os.path.join(folder, f"slidefusion-spill-{os.getpid()}-{secrets.token_hex(8)}.tmp")
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | (os.O_DIRECT if direct else 0)
    fd = os.open(path, flags, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd, path


def _open(folder: str, anonymous: bool, direct: bool) -> tuple[int, str | None]:
    if anonymous and hasattr(os, "O_TMPFILE"):
        try:
            return os.open(folder, os.O_TMPFILE | os.O_RDWR | (os.O_DIRECT if direct else 0), 0o600), None
        except OSError as error:
            if error.errno == errno.EINVAL and direct:
                return _open(folder, anonymous, False)
            if error.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
    try:
        return create_named(folder, direct)
    except OSError as error:
        if error.errno == errno.EINVAL and direct:
            return create_named(folder, False)
        raise


def _staging() -> tuple[mmap.mmap, torch.Tensor]:
    buffer = mmap.mmap(-1, CHUNK)  # anonymous maps are page-aligned, as O_DIRECT needs
    return buffer, torch.frombuffer(buffer, dtype=torch.uint8)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


class SpillFile:
    """Scratch space in `folder` (see the module docstring). `write` and `read` may run on two
    threads at once (each has its own staging buffer), never two writes or two reads at once."""

    def __init__(self, folder: str, anonymous: bool = True, direct: bool = True):
        if not os.path.isdir(folder):
            raise UserError(f"{KEY}={folder!r} is not an existing folder; create it or choose another")
        self.folder, self.removed = folder, remove_stale(folder)
        try:
            self.fd, self.path = _open(folder, anonymous, direct)
        except OSError as error:
            raise UserError(f"{KEY}={folder!r} is not writable ({error.strerror}); choose a writable folder on a local disk") from None
        # a file nobody closed (an exception unwinding past the engine, a plain exit) still goes
        self._remove = weakref.finalize(self, _remove, self.fd, self.path)
        self.direct = bool(fcntl.fcntl(self.fd, fcntl.F_GETFL) & os.O_DIRECT)
        (self._wmap, self._wstage), (self._rmap, self._rstage) = _staging(), _staging()
        self.reserved = 0

    def free_bytes(self) -> int:
        info = os.statvfs(self.folder)
        return info.f_bavail * info.f_frsize

    def reserve(self, nbytes: int) -> None:
        """Hold `nbytes` of disk for the coming step, or a one-line UserError when it is not there."""
        free = self.free_bytes() + self.reserved
        try:
            if nbytes > free:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            if nbytes > self.reserved:
                os.posix_fallocate(self.fd, 0, nbytes)
                self.reserved = nbytes
        except OSError as error:
            raise UserError(f"{KEY}={self.folder!r} has {free / 1e9:.3g} GB free but a step spills {nbytes / 1e9:.3g} GB "
                            f"of checkpoints ({error.strerror}); free space, or raise offload.spill_after") from None

    def release(self) -> None:
        """Give the disk space back (between steps)."""
        os.ftruncate(self.fd, 0)
        self.reserved = 0

    def write(self, offset: int, tensor: torch.Tensor) -> int:
        """Write a contiguous tensor's bytes at `offset` (a multiple of ALIGN); returns the bytes
        the write occupies (a multiple of ALIGN)."""
        data = _bytes(tensor)
        for start in range(0, data.numel(), CHUNK):
            n = min(CHUNK, data.numel() - start)
            self._wstage[:n].copy_(data[start:start + n])
            self._io(os.pwrite, memoryview(self._wmap)[:aligned(n)], offset + start)
        return aligned(data.numel())

    def read(self, offset: int, out: torch.Tensor) -> None:
        """Fill the contiguous tensor `out` with the bytes written at `offset`."""
        data = _bytes(out)
        for start in range(0, data.numel(), CHUNK):
            n = min(CHUNK, data.numel() - start)
            self._io(lambda fd, view, at: os.preadv(fd, [view], at), memoryview(self._rmap)[:aligned(n)], offset + start)
            data[start:start + n].copy_(self._rstage[:n])

    def _io(self, call, view: memoryview, offset: int) -> None:
        try:
            done = call(self.fd, view, offset)
        except OSError as error:  # a filesystem that takes the flag at open but not the I/O
            if error.errno != errno.EINVAL or not self.direct:
                raise
            fcntl.fcntl(self.fd, fcntl.F_SETFL, fcntl.fcntl(self.fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            self.direct = False
            done = call(self.fd, view, offset)
        if done != len(view):
            raise OSError(errno.EIO, f"short spill I/O: {done} of {len(view)} bytes")

    def close(self) -> None:
        if self.fd < 0:
            return
        self._remove()
        self.fd = -1
        self._wstage = self._rstage = None  # the maps close once no tensor views them
        self._wmap.close()
        self._rmap.close()


def check_spill_dir(folder: str) -> None:
    """A one-line UserError now, before any work, if `folder` cannot hold a spill file."""
    SpillFile(folder).close()


def _remove(fd: int, path: str | None) -> None:
    """Unlink a named spill file (while its lock is held, so no other start races for it) and close it."""
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    os.close(fd)
