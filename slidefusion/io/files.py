"""Writing without half-written results: a file or a folder appears under its name complete, or not at all.

Both write under a hidden temporary name beside the destination and rename it into place in one
step (a rename within a folder is atomic on POSIX), so a crash, a kill or an exception leaves
either the old entry or the new one, never a mixture; the temporary is removed on any error.
"""

import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slidefusion.io.partial import MARKER, hold, remove_abandoned_folders


@contextmanager
def atomic_folder(final: Path) -> Iterator[Path]:
    """Yield a hidden temporary sibling of `final`; on success it replaces `final` in one rename,
    on any error it is deleted, so `final` is never seen half-written. The temporary holds a locked
    marker while it is written (`io.partial`): the ones a killed writer left for the same `final`
    are removed first, never one a live writer holds."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_folders(final.parent, re.compile(rf"^\.{re.escape(final.name)}-[a-z0-9_]{{8}}$"))
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    marker = None
    try:
        marker = hold(tmp / MARKER)
        yield tmp
        (tmp / MARKER).unlink()  # the lock stays with the descriptor until the rename is done
        _fsync_tree(tmp)
        old = None
        if final.exists():  # replacing: move the old one aside, put the new one in, then delete the old
            old = final.rename(final.with_name(f".old-{final.name}-{os.getpid()}"))
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if marker is not None:
            os.close(marker)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Yield a hidden temporary path beside `final` to write; on success it replaces `final` in one
    rename, on any error it is deleted. Creates `final`'s folder."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.tmp")
    try:
        yield tmp
        tmp.replace(final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> Path:
    """`text` into `path` atomically; returns the path."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def _fsync_tree(folder: Path) -> None:
    for child in folder.rglob("*"):  # subfolders too: a diffusers export holds one per component
        if child.is_file():
            with open(child, "rb") as handle:
                os.fsync(handle.fileno())
