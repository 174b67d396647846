"""Compiled CPU kernel for slide / neighbourhood attention (forward and backward).

The C++ source (`csrc/slide_cpu.cpp`, which explains the algorithm) is built on first use with
`torch.utils.cpp_extension.load` and cached in torch's extensions folder (TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions), so later processes only load it. Where it cannot be built (no
compiler, no ninja), one warning is issued and calls fall back to the pure-PyTorch path in `cpu.py`.
"""

import warnings
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from slidefusion.attention.backends.cpu import slide_attention_cpu
from slidefusion.errors import UserError

Triple = tuple[int, int, int]

SOURCE = Path(__file__).resolve().parent / "csrc" / "slide_cpu.cpp"
NAME = "slidefusion_slide_cpu"
# No -march=native: the cached build must run on any x86-64 CPU that shares the cache (a home
# folder on a cluster); -O3 still auto-vectorises the `omp simd` loops. -fopenmp makes
# at::parallel_for use the OpenMP runtime torch already loaded.
CFLAGS = ["-O3", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_state: dict = {"module": None, "error": None}


def build():
    """Compile (or load from the cache) the extension module; raises whatever the build raises."""
    from torch.utils.cpp_extension import load

    return load(name=NAME, sources=[str(SOURCE)], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, verbose=False)


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


class SlideCppFunction(torch.autograd.Function):
    """Saves q, k, v, offsets, the output and its log-sum-exp; the backward recomputes the rest."""

    @staticmethod
    def forward(ctx, q, k, v, offsets, kernel, scale):
        off = q.new_empty(0) if offsets is None else offsets
        out, lse = extension().forward(q, k, v, off, *kernel, scale)
        ctx.save_for_backward(q, k, v, off, out, lse)
        ctx.kernel, ctx.scale, ctx.has_offsets = kernel, scale, offsets is not None
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, off, out, lse = ctx.saved_tensors
        dq, dk, dv, doff = extension().backward(q, k, v, off, out, lse, grad_out, *ctx.kernel, ctx.scale)
        return dq, dk, dv, (doff if ctx.has_offsets else None), None, None


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # The kernel has float32 and float64 code; half types compute in float32 and are cast back.
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


def slide_attention_cpp(q, k, v, kernel: Triple, offsets=None, scale: float | None = None) -> torch.Tensor:
    """Compiled slide attention; arguments as `functional.slide_attention` (already checked), CPU tensors."""
    if q.device.type != "cpu":
        raise UserError(f"backend='cpp' needs CPU tensors; got q on {q.device} (use backend='auto')")
    if extension() is None:
        return slide_attention_cpu(q, k, v, kernel, offsets, scale)
    # A non-finite offset would become a garbage grid index in C++; refuse it here.
    if offsets is not None and not torch.isfinite(offsets.detach()).all():
        raise UserError("offsets must be finite; got inf or nan")
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    dtype = _compute_dtype(q.dtype)
    qc, kc, vc = (x.to(dtype).contiguous() for x in (q, k, v))
    off = None if offsets is None else offsets.to(dtype).contiguous()
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, offsets))
    if needs_grad:
        out = SlideCppFunction.apply(qc, kc, vc, off, kernel, scale)
    else:
        out = extension().forward(qc, kc, vc, qc.new_empty(0) if off is None else off, *kernel, scale)[0]
    return out.to(q.dtype)
