"""What a killed writer leaves behind, recognised as ours and dead before anything is removed.

Writers put their output under a temporary name and rename it into place, so a kill never leaves
a half file under the real name; it leaves the temporary. Each writer holds an exclusive `flock`
on a file of its temporary (a folder's `MARKER`, or the temporary file itself) while it writes.
The kernel drops a flock when its process ends however it ends (kill -9 included), so a temporary
whose lock can be taken has no live writer. Only names our writers make, with that lock free, are
ever removed: a user's file never matches both.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path

MARKER = ".slidefusion-partial"  # inside a temporary folder while it is written


def hold(path: str | Path) -> int:
    """Create (or open) `path` and take its exclusive lock; returns the descriptor to close when done."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    try:
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)  # for a person looking; the lock is what counts
    except OSError:  # a full disk: the writer's own write will say so
        pass
    return fd


def is_abandoned(path: str | Path) -> bool:
    """True if `path` is a regular file whose writer's lock is free (the writer is gone)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: a live writer
        return False
    finally:
        os.close(fd)  # drops the lock taken just now, if any
    return True


def remove_abandoned_folders(parent: str | Path, pattern: re.Pattern) -> list[str]:
    """Delete the folders directly in `parent` whose name matches `pattern` and that hold an
    abandoned `MARKER`; returns their names."""
    removed = []
    for child in sorted(Path(parent).iterdir()) if Path(parent).is_dir() else ():
        if pattern.match(child.name) and child.is_dir() and not child.is_symlink() and is_abandoned(child / MARKER):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child.name)
    return removed


def remove_abandoned_files(folder: str | Path, pattern: re.Pattern) -> list[str]:
    """Delete the files directly in `folder` whose name matches `pattern` and whose lock is free."""
    removed = []
    for child in sorted(Path(folder).iterdir()) if Path(folder).is_dir() else ():
        if pattern.match(child.name) and child.is_file() and not child.is_symlink() and is_abandoned(child):
            child.unlink(missing_ok=True)
            removed.append(child.name)
    return removed
