"""Compiled CPU kernel for slide / neighbourhood attention ("cpp"), forward and backward.

The C++ source (`csrc/slide_cpu.cpp`, which explains the algorithm) is built on first use with
`torch.utils.cpp_extension.load` and cached in torch's extensions folder (TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions), so later processes only load it. The build is named by a hash
of the sources and flags and compiles a copy of the sources kept in its folder: two checkouts of
different versions never rebuild (overwrite) a library the other one has loaded, which crashed
processes on a shared machine, and checkouts of one version share one build. Where it cannot be built (no
compiler, no ninja), one warning is issued and both passes run the tiled PyTorch path instead.
Inputs arrive normalised by the dispatch layer (`backends.normalise`): contiguous CPU tensors of
one float32 / float64 dtype, a float scale.
"""

import hashlib
import os
import sys
import tempfile
import warnings
from pathlib import Path

from slidefusion.attention.backends import tiled

Triple = tuple[int, int, int]

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("slide_cpu.cpp", "slide_rows.h")  # the compiled file and what it includes
NAME = "slidefusion_slide_cpu"
# No -march=native: the cached build must run on any x86-64 CPU that shares the cache (a home
# folder on a cluster); the hot loops are compiled per instruction set instead (see the source).
# -ffp-contract=fast lets a * b + c become one FMA (ISO C++ mode forbids it by default); -fopenmp
# makes at::parallel_for use the OpenMP runtime torch already loaded.
CFLAGS = ["-O3", "-ffp-contract=fast", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_state: dict = {"module": None, "error": None}


def build():
    """Compile (or load from the cache) the extension module; raises whatever the build raises."""
    import torch
    from torch.utils.cpp_extension import load

    texts = {name: (CSRC / name).read_bytes() for name in SOURCES}
    key = (sorted(texts.items()), CFLAGS, LDFLAGS, torch.__version__, sys.version_info[:2])
    name = f"{NAME}_{hashlib.sha256(repr(key).encode()).hexdigest()[:16]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    for file, text in texts.items():  # the copy the build reads: the same path for every checkout
        _write_once(folder / file, text)
    return load(name=name, sources=[str(folder / SOURCES[0])], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                build_directory=str(folder), verbose=False)


def _write_once(path: Path, text: bytes) -> None:
    """Write `path` unless it holds `text` already; atomically (temp file + rename)."""
    if path.exists() and path.read_bytes() == text:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(text)
    os.replace(tmp, path)


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
