"""Build and load `adamw_kernels.c` (plain C through ctypes, no torch headers: ~0.2 s to build).

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

SOURCE = Path(__file__).with_name("adamw_kernels.c")
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared"]


def _cpu_key() -> str:
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        flags = ""
    return flags


def _signatures(lib: ctypes.CDLL) -> ctypes.CDLL:
    F, I, P, L = ctypes.c_float, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64
    lib.moments.argtypes = [P, P, I, P, P, L, F, I, F, I, F, F, F]
    lib.apply.argtypes = [P, P, P, P, I, L, F, F, F]
    lib.fused.argtypes = [P, P, I, P, P, P, I, L, F, I, F, I, F, F, F, F, F, F]
    lib.touch.argtypes = [P, P, P, P, P, L]
    for fn in (lib.moments, lib.apply, lib.fused, lib.touch):
        fn.restype = None
    return lib


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels, or None where no C compiler is available."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None or os.environ.get("SLIDEFUSION_NO_C_KERNELS"):
        return None
    if not SOURCE.is_file():  # an install without package data: torch fallbacks
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join(FLAGS).encode() + _cpu_key().encode()).hexdigest()[:16]
    folder = Path(os.environ.get("SLIDEFUSION_CACHE", Path.home() / ".cache" / "slidefusion"))
    target = folder / f"adamw_kernels-{key}.so"
    try:
        if not target.exists():
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:  # build aside, then rename: atomic
                built = Path(tmp) / target.name
                result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True,
                                        text=True, check=False)
                if result.returncode != 0:
                    return None
                built.replace(target)
        return _signatures(ctypes.CDLL(str(target)))
    except OSError:  # no writable cache folder, or the library does not load here: torch fallbacks
        return None
