"""A full disk said in one line: what was being written, where, how much it needed, what is intact.

Writers here write to a temporary name and rename (or delete the temporary on failure), so a full
disk loses nothing; what remains is telling the user. Libraries report it in their own ways:
`OSError` with errno ENOSPC (or EDQUOT), safetensors' "No space left on device (os error 28)",
torch.save's "unexpected pos" from its zip writer. So besides the error itself, `writing` asks the
disk: an estimate larger than the free space left after the failure is a full disk too.
"""

from __future__ import annotations

import errno
import shutil
from contextlib import contextmanager
from pathlib import Path

from slidefusion.errors import DiskFullError, UserError

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
FULL_WORDS = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the disk that holds `path` (its nearest existing parent), or None."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def is_disk_full(error: BaseException, folder: str | Path, needed: int | None) -> bool:
    if getattr(error, "errno", None) in FULL_ERRNOS or any(w in str(error) for w in FULL_WORDS):
        return True
    free = free_bytes(folder)
    return needed is not None and free is not None and needed > free


def _size(n: int | None) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} TB"


@contextmanager
def writing(what: str, folder: str | Path, needed: int | None = None, intact: str = "nothing was changed"):
    """Run the block that writes `what` into `folder` (about `needed` bytes); a full disk becomes a
    one-line `DiskFullError` naming them, the free space and what is `intact`."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - the writers' errors for a full disk have no common type
        if isinstance(error, UserError) or not is_disk_full(error, folder, needed):
            raise
        free = free_bytes(folder)
        need = f"it needs about {_size(needed)}" if needed else "it needs more room"
        have = f", {_size(free)} free" if free is not None else ""
        raise DiskFullError(f"the disk ran out of space writing {what} in {folder} ({need}{have}); {intact}; "
                            "free some space and run it again") from None


def tensor_bytes(*states) -> int:
    """Bytes of the tensors in the (nested) dicts and lists `states`."""
    import torch

    total, stack = 0, list(states)
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            total += item.numel() * item.element_size()
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return total


def folder_bytes(folder: str | Path) -> int:
    """Bytes of the regular files under `folder` (links followed, as a copy follows them)."""
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
