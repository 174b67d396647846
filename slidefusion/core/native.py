"""The one native build helper: compile a kernel once per source version, flags and CPU, and cache it.

Two kinds of kernels are built on first use: C++ against torch's headers (the slide attention CPU
kernel, through `torch.utils.cpp_extension.load`) and plain C loaded through ctypes (the host AdamW
kernels). Both follow the same rules, defined here once:

  - one `-march=native` rule: every build is compiled for the CPU it runs on (`NATIVE`), and the
    CPU's identity (its model name and feature flags) is part of the build's name, so a cache folder
    shared between machines (a home folder on a cluster) never hands a library to a CPU it was not
    built for: another CPU builds its own;
  - a build is named by a hash of its sources, flags, the CPU and (C++) the torch and Python versions:
    two checkouts of different versions never overwrite a library the other one has loaded, and
    checkouts of one version share one build;
  - files are written aside and renamed into place, so a reader never sees half a library;
  - a build that cannot be made (no compiler, a compile error, a read-only cache) returns None and
    the caller runs its PyTorch fallback; `SLIDEFUSION_NO_C_KERNELS` asks for that on purpose.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from functools import cache
from pathlib import Path

NATIVE = ("-march=native",)


@cache
def cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux /proc/cpuinfo; the platform string elsewhere)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    wanted = [line for line in lines if line.startswith(("model name", "flags", "Features", "CPU part"))]
    return "\n".join(dict.fromkeys(wanted)) or f"{sys.platform} {os.uname().machine if hasattr(os, 'uname') else ''}"


def build_name(stem: str, sources: Sequence[bytes], flags: Sequence[str], *extra: str) -> str:
    """`stem-<hash>`: the hash of the sources, flags, CPU identity and `extra` (e.g. torch's version)."""
    digest = hashlib.sha256()
    for part in (*sources, " ".join(flags).encode(), cpu_identity().encode(), *(e.encode() for e in extra)):
        digest.update(len(part).to_bytes(8, "little") + part)
    return f"{stem}-{digest.hexdigest()[:16]}"


def disabled() -> bool:
    """True where the user asked for the PyTorch fallbacks (`SLIDEFUSION_NO_C_KERNELS`)."""
    return bool(os.environ.get("SLIDEFUSION_NO_C_KERNELS"))


def write_once(path: Path, data: bytes) -> None:
    """Write `path` unless it holds `data` already; aside, then renamed into place."""
    if path.exists() and path.read_bytes() == data:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def c_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def shared_library(target: Path, sources: Sequence[Path], flags: Sequence[str]) -> Path | None:
    """`target` (a shared library of plain C `sources`), compiled there first if it is not yet;
    None where there is no compiler or the compile fails."""
    compiler = c_compiler()
    if compiler is None or disabled():
        return None
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                command = [compiler, *NATIVE, *flags, "-fPIC", "-shared", *map(str, sources), "-o", str(built)]
                if subprocess.run(command, capture_output=True, text=True, check=False).returncode != 0:
                    return None
                built.replace(target)
        return target
    except OSError:  # no writable cache folder
        return None


def torch_extension(stem: str, files: dict[str, bytes], cflags: Sequence[str], ldflags: Sequence[str]):
    """A C++ torch extension of `files` (name -> text; the first is compiled, the others are what it
    includes), built with `cflags` (plus `NATIVE`) in torch's extensions folder (TORCH_EXTENSIONS_DIR,
    default ~/.cache/torch_extensions) and loaded; raises whatever the build raises."""
    import torch
    from torch.utils.cpp_extension import load

    flags = [*NATIVE, *cflags]
    name = build_name(stem, [f.encode() + t for f, t in sorted(files.items())], [*flags, *ldflags],
                      torch.__version__, f"{sys.version_info[:2]}").replace("-", "_")
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions"
    folder = Path(root) / name
    folder.mkdir(parents=True, exist_ok=True)
    for file, text in files.items():  # the copy the build reads: the same path for every checkout
        write_once(folder / file, text)
    return load(name=name, sources=[str(folder / next(iter(files)))], extra_cflags=flags, extra_ldflags=list(ldflags),
                build_directory=str(folder), verbose=False)


def cache_folder() -> Path:
    """Where plain C libraries are cached: $SLIDEFUSION_CACHE, default ~/.cache/slidefusion."""
    return Path(os.environ.get("SLIDEFUSION_CACHE", Path.home() / ".cache" / "slidefusion"))


__all__ = ["NATIVE", "build_name", "c_compiler", "cache_folder", "cpu_identity", "disabled", "shared_library",
           "torch_extension", "write_once"]
