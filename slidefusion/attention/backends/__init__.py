"""The dispatch layer of slide / neighbourhood attention: one record per kernel, one chooser, one normaliser.

Kernels (each module defines `forward(q, k, v, offsets, kernel, scale) -> (out, lse)` and
`backward(q, k, v, offsets, lse, delta, dout, kernel, scale) -> (dq, dk, dv, doffsets)`, neither
differentiable; `ops.py` makes them one differentiable torch.library op):
  * "tiled": `tiled.py`, tiled plain PyTorch with a recomputing backward; runs on any device;
  * "cpp": `cpp.py`, a compiled C++ kernel for CPU tensors, built on first use; where it cannot be
    built it warns once and runs "tiled" instead;
  * "triton": `triton.py`, fused CUDA kernels.
"reference" is `reference.slide_attention_reference`, the gather-then-softmax specification,
differentiated by autograd. "auto" picks "triton" for CUDA tensors when triton is installed,
"cpp" for CPU tensors, else "tiled".

Which backend runs is decided in `choose` only; dtype, scale and contiguity are settled in
`normalise` only, for every kernel. Whether gradients are needed is autograd's business: the
op's registered backward runs only when some input requires grad.
"""

import importlib
import importlib.util
import os
from dataclasses import dataclass

import torch

from slidefusion.core.errors import UserError, unknown_value


@dataclass(frozen=True)
class KernelSpec:
    """One kernel implementation: where it lives, where it runs, which dtypes it computes natively."""

    module: str  # defines forward(...) and backward(...)
    device: str | None  # the one device type it accepts; None: any
    dtypes: tuple[torch.dtype, ...]  # storage dtypes it computes in; others are cast to dtypes[0] and back


KERNELS: dict[str, KernelSpec] = {
    "tiled": KernelSpec("slidefusion.attention.backends.tiled", None, (torch.float32, torch.float64)),
    "cpp": KernelSpec("slidefusion.attention.backends.cpp", "cpu", (torch.float32, torch.float64)),
    # The Triton kernels load any float type and accumulate in float32.
    "triton": KernelSpec("slidefusion.attention.backends.triton", "cuda", (torch.float32, torch.bfloat16, torch.float16)),
}
BACKENDS = ("auto", "reference", *KERNELS)

# Looked up once: `choose` runs inside torch.compile's trace, where an import can't be.
_HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True when the triton package is installed (it may still lack a GPU; see `triton.py`)."""
    return _HAS_TRITON


def choose(backend: str, device: torch.device) -> str:
    """The backend that runs for tensors on `device`: `backend` itself, or what "auto" stands for there."""
    if backend not in BACKENDS:
        raise unknown_value("backend", backend, BACKENDS)
    if backend == "auto":
        if device.type == "cuda" and _HAS_TRITON:
            return "triton"
        return "cpp" if device.type == "cpu" else "tiled"
    spec = KERNELS.get(backend)
    if spec is not None and spec.device is not None and device.type not in (spec.device, "meta"):
        # Triton's interpreter (TRITON_INTERPRET=1) runs the same kernels on CPU tensors: the tests use it.
        interpreted = backend == "triton" and device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
        if not interpreted:
            raise UserError(f"backend={backend!r} needs {spec.device} tensors; got {device.type} (use backend='auto')")
    return backend


def kernel_module(backend: str):
    """The module holding `backend`'s forward and backward (imported on first use: triton is optional)."""
    return importlib.import_module(KERNELS[backend].module)


def compute_dtype(dtype: torch.dtype, backend: str) -> torch.dtype:
    """The dtype `backend` computes `dtype` inputs in."""
    native = KERNELS[backend].dtypes
    return dtype if dtype in native else native[0]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The log-sum-exp's dtype for `dtype` inputs: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Normalised:
    """Kernel-ready arguments: contiguous tensors of one compute dtype, a float scale."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    offsets: torch.Tensor | None
    scale: float


def normalise(q, k, v, offsets, scale: float | None, backend: str) -> Normalised:
    """Cast to `backend`'s compute dtype, make contiguous, fill the default scale D ** -0.5.

    The casts are ordinary differentiable ops, so gradients come back in the callers' dtypes.
    """
    dtype = compute_dtype(q.dtype, backend)
    q, k, v = (x.to(dtype).contiguous() for x in (q, k, v))
    if offsets is not None:
        offsets = offsets.to(dtype).contiguous()
    return Normalised(q, k, v, offsets, q.shape[-1] ** -0.5 if scale is None else float(scale))
