"""Housekeeping of a run folder (runs/NAME/): one writer at a time, no stale temporaries, and one
metrics record per step.

`RunLock` is an advisory `fcntl.flock` on RUN/.lock, held while a run writes into its folder. The
kernel drops a flock when the process ends however it ends (kill -9 included), so a lock is never
stale and nothing has to be cleaned up by hand. Cleaning happens only while the lock is held, so it
never touches a folder another live run is writing into.
"""

import json
import os
import re
import shutil
from pathlib import Path

from slidefusion.errors import UserError
from slidefusion.io.checkpoint import TEMPORARY
from slidefusion.io.files import write_text

LOCK_NAME = ".lock"


def _caption_temporary(cache_name: str) -> re.Pattern:
    """The name `CaptionCache.save` gives its temporary file (mkstemp: NAME + 8 characters + .tmp)."""
    return re.compile(rf"^{re.escape(cache_name)}[a-z0-9_]+\.tmp$")


class RunLock:
    """Exclusive, non-blocking ownership of a run folder for as long as it is held."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.fd: int | None = None
        self.created: list[Path] = []  # folders acquire made, deepest first

    def acquire(self) -> None:
        """Take the lock, or a UserError naming who holds it; creates the folder if needed."""
        import fcntl

        self.created = [p for p in (self.run_dir, *self.run_dir.parents) if not p.exists()]
        self.run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # BlockingIOError: held by another process (or another open in this one)
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UserError(f"run folder {self.run_dir} is in use by another training run ({holder}); "
                            "wait for it to finish, or choose another run.name") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}\n".encode(), 0)
        self.fd = fd

    def release(self) -> None:
        """Drop the lock; a folder that acquire created and nothing else wrote into goes again,
        so a command that fails early leaves no trace."""
        if self.fd is None:
            return
        if self.created and [p.name for p in self.run_dir.iterdir()] == [LOCK_NAME]:
            (self.run_dir / LOCK_NAME).unlink()
            for folder in self.created:
                try:
                    folder.rmdir()
                except OSError:  # not empty: someone else uses it now
                    break
        os.close(self.fd)  # closing the only descriptor drops the flock
        self.fd = None


def remove_stale_temporaries(run_dir: Path, cache_name: str = "captions.safetensors") -> list[str]:
    """Delete what an interrupted save left in `run_dir`: hidden `.checkpoint-N-*` / `.old-checkpoint-N-*`
    folders and the caption cache's temporary file. Only names our own writers make, only directly
    inside `run_dir`; call it while holding the run's `RunLock`. Returns the names removed."""
    caption_tmp = _caption_temporary(cache_name)
    removed = []
    for child in sorted(Path(run_dir).iterdir()) if Path(run_dir).is_dir() else ():
        if child.is_symlink():
            continue
        if TEMPORARY.match(child.name) and child.is_dir():
            shutil.rmtree(child)
        elif caption_tmp.match(child.name) and child.is_file():
            child.unlink()
        else:
            continue
        removed.append(child.name)
    return removed


def truncate_metrics(path: Path, step: int) -> int:
    """Keep in metrics.jsonl only the records of steps <= `step` (a run resumed from there writes
    the rest again) and drop a last line torn by a kill. Rewritten atomically; returns lines dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    lines = path.read_text().splitlines()
    kept = []
    for index, line in enumerate(lines):
        try:
            record = json.loads(line)
        except ValueError:
            if index == len(lines) - 1:
                continue  # half a record: the writer was killed mid-line
            kept.append(line)
            continue
        if not (isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step):
            kept.append(line)
    dropped = len(lines) - len(kept)
    if dropped:
        write_text(path, "".join(line + "\n" for line in kept))
    return dropped
