"""Compiled CPU kernel for slide / neighbourhood attention ("cpp"), forward and backward.

The C++ source (`csrc/slide_cpu.cpp`, which explains the algorithm) is built on first use by the
one native build helper (`slidefusion.core.native.torch_extension`: compiled for this CPU, named by
a hash of the sources, flags, CPU and torch version, cached in torch's extensions folder), so later
processes only load it. Where it cannot be built (no compiler, no ninja), one warning is issued and
both passes run the tiled PyTorch path instead. Inputs arrive normalised by the dispatch layer
(`backends.normalise`): contiguous CPU tensors of one float32 / float64 dtype, a float scale.
"""

import warnings
from pathlib import Path

from slidefusion.attention.backends import tiled
from slidefusion.core import native

Triple = tuple[int, int, int]

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("slide_cpu.cpp", "slide_rows.h")  # the compiled file and what it includes
NAME = "slidefusion_slide_cpu"
# -ffp-contract=fast lets a * b + c become one FMA (ISO C++ mode forbids it by default); -fopenmp
# makes at::parallel_for use the OpenMP runtime torch already loaded.
CFLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_state: dict = {"module": None, "error": None}


def build():
    """Compile (or load from the cache) the extension module; raises whatever the build raises."""
    return native.torch_extension(NAME, {name: (CSRC / name).read_bytes() for name in SOURCES}, CFLAGS, LDFLAGS)


def extension():
    """The compiled module, built at most once per process; None (after one warning) if it cannot be."""
    if _state["module"] is None and _state["error"] is None:
        try:
            _state["module"] = build()
        except Exception as error:  # no compiler, no ninja, a compile error: all mean "use the fallback"
            _state["error"] = error
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            warnings.warn(
                f"slidefusion: the compiled CPU attention kernel could not be built ({type(error).__name__}: "
                f"{first}); using the slower pure-PyTorch CPU path",
                RuntimeWarning,
                stacklevel=3,
            )
    return _state["module"]


def forward(q, k, v, offsets, kernel: Triple, scale: float):
    """out (B, T, H, W, heads, D) and lse (B, T, H, W, heads); NaN for query-heads whose offsets are not finite."""
    ext = extension()
    if ext is None:
        return tiled.forward(q, k, v, offsets, kernel, scale)
    return tuple(ext.forward(q, k, v, q.new_empty(0) if offsets is None else offsets, *kernel, scale))


def backward(q, k, v, offsets, lse, delta, grad_out, kernel: Triple, scale: float):
    """(dq, dk, dv, doffsets); delta = rowsum(dout * out) - dlse (B, T, H, W, heads)."""
    ext = extension()
    if ext is None:
        return tiled.backward(q, k, v, offsets, lse, delta, grad_out, kernel, scale)
    off = q.new_empty(0) if offsets is None else offsets
    return tuple(ext.backward(q, k, v, off, lse, delta, grad_out, *kernel, scale))
