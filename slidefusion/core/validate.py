"""Checks for values that come from users: numbers, seeds, byte sizes, devices and output paths.

Each check raises `UserError` with one line that names `key` (a flag such as `--guidance` or a
config key such as `optim.lr`) and says what would be valid. The command line's argparse types
(`slidefusion.cli.args`) and the typed configs call the same functions, so a value is judged the
same way wherever it comes in. This module sits below everything but `errors`.
"""

import math
import os
import tempfile
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch

from slidefusion.core.errors import UserError

SEED_MAX = 2**64 - 1  # torch.Generator.manual_seed takes 0..2**64-1
INT_MAX = 2**63 - 1  # what a torch int64 (sizes, counts) can hold
SIZE_UNITS = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "PB": 1e15,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}


def _subject(key: str | None, value) -> str:
    return f"{key}={value!r}" if key else repr(value)


def interval(low=None, high=None, low_open: bool = False, high_open: bool = False) -> str:
    """The range in words: 'in (0, 1]', '>= 0', '< 1', or '' for any finite number."""
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{'<' if high_open else '<='} {high:g}"
    return ""


def in_interval(value: float, low=None, high=None, low_open: bool = False, high_open: bool = False) -> bool:
    return not ((low is not None and (value <= low if low_open else value < low))
                or (high is not None and (value >= high if high_open else value > high)))


def finite(value, key: str | None, low=None, high=None, *, low_open: bool = False, high_open: bool = False) -> float:
    """`value` (a number or its text) as a finite float inside the range, else a UserError."""
    where = interval(low, high, low_open, high_open)
    wanted = f"a finite number{' ' + where if where else ''}"
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError, OverflowError):
        number = math.nan
    if not math.isfinite(number) or not in_interval(number, low, high, low_open, high_open):
        raise UserError(f"{_subject(key, value)} must be {wanted}")
    return number


def integer(value, key: str | None, low: int | None = None, high: int | None = None) -> int:
    """`value` (an int or its decimal text) as an int in [low, high] (default: what int64 holds)."""
    low = -INT_MAX - 1 if low is None else low
    high = INT_MAX if high is None else high
    number = None
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str):
        try:
            number = int(value.strip())
        except ValueError:
            number = None
    if number is None or not low <= number <= high:
        bounds = f">= {low}" if high == INT_MAX else f"in {low}..{high}"
        raise UserError(f"{_subject(key, value)} must be an integer {bounds}")
    return number


def seed(value, key: str | None) -> int:
    """A random seed: an int in 0..2**64-1, what `torch.Generator.manual_seed` accepts."""
    try:
        return integer(value, key, 0, SEED_MAX)
    except UserError:
        raise UserError(f"{_subject(key, value)} must be a seed, an integer in 0..2**64-1") from None


def byte_size(value, key: str | None, *, per_second: bool = False, bare_bytes: bool = False) -> int:
    """'141GB', '1.5TB', '64GiB' (with '/s' for a bandwidth) -> bytes, >= 1.

    A number without a unit is refused: `--gpu-memory 24` read as 24 bytes would plan nonsense, and
    read as 24 GB it would guess. So is a bare 'G' ('24G': 10**9 or 2**30 bytes?). `bare_bytes`
    (the Python API, where an int means bytes) accepts a plain number as bytes."""
    example = "55GB/s" if per_second else "141GB, 1.5TB or 64GiB"
    units = "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)"
    text = str(value).strip().upper()
    if per_second and text.endswith("/S"):
        text = text[:-2]
    unit = text.lstrip("0123456789.E+-")
    digits = text[:len(text) - len(unit)]
    unit = unit.strip()
    try:
        number = float(digits) * SIZE_UNITS[unit]
    except (ValueError, KeyError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number) or number < 1:
        if unit in ("K", "M", "G", "T", "P") and digits:
            raise UserError(f"{_subject(key, value)} is ambiguous: write {digits}{unit}B (powers of 1000) or "
                            f"{digits}{unit}iB (powers of 1024)")
        raise UserError(f"{_subject(key, value)} must be a size such as {example} (positive and finite; units: {units})")
    if not unit and not bare_bytes:
        raise UserError(f"{_subject(key, value)} has no unit; write e.g. {digits}GB (units: {units})")
    return int(number)


def device(name, key: str | None) -> torch.device:
    """A device that exists on this machine: cpu, or cuda / cuda:N when CUDA has device N."""
    cuda = torch.cuda.is_available()
    valid = "cpu" + (f", cuda, cuda:0..{torch.cuda.device_count() - 1}" if cuda else " (no CUDA device here)")
    try:
        found = torch.device(str(name)) if str(name).strip() else None
    except (RuntimeError, ValueError):
        found = None
    ok = found is not None and (found.type == "cpu" or (
        found.type == "cuda" and cuda and (found.index or 0) < torch.cuda.device_count()))
    if not ok:
        raise UserError(f"{_subject(key, name)} is not a device on this machine; valid: {valid}")
    return found


def output_path(path, key: str | None, suffixes: tuple[str, ...] = (), folder: bool = False,
                inside: bool = False) -> Path:
    """Check, before any work, that `path` can be written: a valid suffix, not an existing entry of
    the other kind (folder vs file), and a writable nearest existing parent (with `inside`, files go
    into the folder: an existing one must itself be writable). Creates nothing."""
    if not str(path).strip():
        raise UserError(f"{_subject(key, str(path))} is empty; give a {'folder' if folder else 'file'} path")
    path = Path(path).expanduser()
    if suffixes and path.suffix.lower() not in suffixes:
        raise UserError(f"{_subject(key, str(path))} must end in {' or '.join(suffixes)}")
    if not folder and path.is_dir():
        raise UserError(f"{_subject(key, str(path))} is an existing folder; give a file path")
    if folder and path.exists() and not path.is_dir():
        raise UserError(f"{_subject(key, str(path))} is an existing file; give a folder path")
    if inside and path.is_dir() and not _writable(path):
        raise UserError(f"{_subject(key, str(path))} cannot be written: the folder is not writable")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{_subject(key, str(path))} cannot be created: {parent} is a file, not a folder")
    if not _writable(parent):
        raise UserError(f"{_subject(key, str(path))} cannot be written: {parent} is not writable")
    return path


def _writable(folder: Path) -> bool:
    """True if a file can be created in `folder` (tried: permission bits do not stop root)."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:  # an unnamed temporary file (O_TMPFILE on Linux): nothing appears in the folder
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def renamed_keys(options: Mapping, renames: Mapping[str, str], where: str) -> dict:
    """`options` (a config section) with deprecated keys renamed (old -> new), one FutureWarning line
    per old key met; a UserError if a section gives both names."""
    options = dict(options)
    for old, new in renames.items():
        if old in options:
            if new in options:
                raise UserError(f"{where} gives both {old} and {new}; {old} is the old name of {new}: keep {new}")
            warnings.warn(f"{where}.{old} is deprecated; write {where}.{new} (same values)", FutureWarning, stacklevel=3)
            options[new] = options.pop(old)
    return options
