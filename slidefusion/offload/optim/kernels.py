"""Build and load `adamw_kernels.c` and `lean_kernels.c` (plain C through ctypes, no torch headers:
well under a second to build).

The library is compiled once per source version and CPU into a cache folder
($SLIDEFUSION_CACHE, default ~/.cache/slidefusion). Without a C compiler `load()` returns None and
`adam.py` falls back to torch operations. ctypes releases the GIL during a call, so the optimizer
thread runs truly beside the compute thread.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

SOURCES = [Path(__file__).with_name("adamw_kernels.c"), Path(__file__).with_name("lean_kernels.c")]
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]
OPENMP = ["-fopenmp"]  # for lean_update_ranges alone; tried first, left out where it does not build


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return flags


def _signatures(lib: ctypes.CDLL) -> ctypes.CDLL:
    F, I, P, L = ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
    lib.adamw.argtypes = [P, P, I, P, P, P, I, L, F, I, F, I, F, F, F, F, F, F]
    lib.touch.argtypes = [P, P, P, P, P, L]
    lib.lean_update.argtypes = [P, L, L]
    lib.lean_floor.argtypes = [P, P, P, ctypes.c_int32, L]
    for fn in (lib.adamw, lib.touch, lib.lean_update, lib.lean_floor):
        fn.restype = None
    if hasattr(lib, "lean_update_ranges"):  # built with OpenMP
        lib.lean_update_ranges.argtypes, lib.lean_update_ranges.restype = [P, P, ctypes.c_int32], None
    return lib


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None where no C compiler is available."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None or os.environ.get("SLIDEFUSION_NO_C_KERNELS"):
        return None
    if not all(path.is_file() for path in SOURCES):  # an install without package data: torch fallbacks
        return None
    source = b"".join(path.read_bytes() for path in SOURCES)
    folder = Path(os.environ.get("SLIDEFUSION_CACHE", Path.home() / ".cache" / "slidefusion"))
    for flags in ([*FLAGS, *OPENMP], FLAGS):  # without OpenMP where it does not build or load
        key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_key().encode()).hexdigest()[:16]
        lib = _built(compiler, flags, folder / f"adamw_kernels-{key}.so")
        if lib is not None:
            return _signatures(lib)
    return None


def _built(compiler: str, flags: list[str], target: Path) -> ctypes.CDLL | None:
    """The library at `target`, compiled there first if it is not yet (None where that fails)."""
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:  # build aside, then rename: atomic
                built = Path(tmp) / target.name
                result = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", str(built)], capture_output=True,
                                        text=True, check=False)
                if result.returncode != 0:
                    return None
                built.replace(target)
        return ctypes.CDLL(str(target))
    except OSError:  # no writable cache folder, or the library does not load here: torch fallbacks
        return None
