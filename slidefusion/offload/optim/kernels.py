"""Build and load `adamw_kernels.c` and `lean_kernels.c` (plain C through ctypes, no torch headers:
well under a second to build).

The library is built by the one native build helper (`slidefusion.core.native`: compiled for this
CPU, once per source version, flags and CPU, into $SLIDEFUSION_CACHE, default ~/.cache/slidefusion).
Without a C compiler `load()` returns None and `adam.py` falls back to torch operations. ctypes
releases the GIL during a call, so the optimizer thread runs truly beside the compute thread.
"""

import ctypes
from functools import cache
from pathlib import Path

from slidefusion.core import native

SOURCES = [Path(__file__).with_name("adamw_kernels.c"), Path(__file__).with_name("lean_kernels.c")]
FLAGS = ["-O3", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math"]
OPENMP = ["-fopenmp"]  # for lean_update_ranges alone; tried first, left out where it does not build


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
    if not all(path.is_file() for path in SOURCES):  # an install without package data: torch fallbacks
        return None
    sources = [path.read_bytes() for path in SOURCES]
    for flags in ([*FLAGS, *OPENMP], FLAGS):  # without OpenMP where it does not build or load
        target = native.cache_folder() / f"{native.build_name('adamw_kernels', sources, flags)}.so"
        built = native.shared_library(target, SOURCES, flags)
        try:
            if built is not None:
                return _signatures(ctypes.CDLL(str(built)))
        except OSError:  # the library does not load here: try without OpenMP, then torch fallbacks
            continue
    return None
