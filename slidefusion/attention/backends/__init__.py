"""Backend dispatch for slide / neighbourhood attention.

Four implementations of one contract (see `functional.slide_attention`):
  * "reference": `reference.slide_attention_reference`, the gather-then-softmax specification;
  * "cpu": `cpu.py`, tiled plain PyTorch with a recomputing backward; runs on any device;
  * "cpp": `cpp.py`, a compiled C++ kernel for CPU tensors, built on first use; where it cannot be
    built it warns once and runs "cpu" instead;
  * "triton": `triton.py`, fused CUDA kernels (forward and backward).
"auto" picks Triton for CUDA tensors when triton is installed, "cpp" for CPU tensors, else "cpu".
"""

import torch

from slidefusion.attention.backends.cpu import slide_attention_cpu
from slidefusion.errors import UserError

BACKENDS = ("auto", "reference", "cpu", "cpp", "triton")


def triton_available() -> bool:
    """True when the triton package imports (it may still lack a GPU; see `triton.py`)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose(q: torch.Tensor) -> str:
    if q.is_cuda and triton_available():
        return "triton"
    return "cpp" if q.device.type == "cpu" else "cpu"


def slide(q, k, v, kernel, offsets=None, scale=None, backend: str = "auto") -> torch.Tensor:
    """Run slide attention on checked arguments with the named backend."""
    if backend not in BACKENDS:
        raise UserError(f"backend={backend!r} is unknown; valid: {', '.join(BACKENDS)}")
    backend = choose(q) if backend == "auto" else backend
    if backend == "reference":
        from slidefusion.attention.reference import slide_attention_reference

        return slide_attention_reference(q, k, v, kernel, offsets, scale)
    if backend == "triton":
        from slidefusion.attention.backends.triton import slide_attention_triton

        return slide_attention_triton(q, k, v, kernel, offsets, scale)
    if backend == "cpp":
        from slidefusion.attention.backends.cpp import slide_attention_cpp

        return slide_attention_cpp(q, k, v, kernel, offsets, scale)
    return slide_attention_cpu(q, k, v, kernel, offsets, scale)
