"""The Triton kernels (forward and backward) against the reference, on the CPU via TRITON_INTERPRET=1.

The interpreter must be chosen before triton compiles anything, so it is set at import time;
on a CUDA machine the same tests run the compiled kernels when TRITON_INTERPRET is unset there.
"""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from slidefusion.attention import slide_attention  # noqa: E402
from slidefusion.attention.reference import slide_attention_reference  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] != "1" else "cpu"


@pytest.mark.parametrize(
    "grid, kernel, mode",
    [
        ((3, 4, 5), (3, 3, 3), "none"),  # N=60 is not a multiple of the 32-query block
        ((2, 5, 4), (1, 3, 3), "sample"),  # window 1 on T
        ((3, 3, 4), (3, 3, 1), "shift"),  # window == grid on T and H
    ],
)
def test_triton_matches_reference_forward_and_backward(grid, kernel, mode):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, *grid, 2, 4, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    K = kernel[0] * kernel[1] * kernel[2]
    off = None
    if mode != "none":
        off = ((torch.rand(1, *grid, 2, K if mode == "sample" else 1, 3, generator=g) * 2 - 1) * 1.3 + 0.01)
        off = off.to(DEVICE).requires_grad_()
    inputs = (q, k, v) if off is None else (q, k, v, off)
    out = slide_attention(q, k, v, kernel, off, backend="triton")
    ref = slide_attention_reference(q, k, v, kernel, off)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(q.shape, generator=g).to(DEVICE)
    fast = torch.autograd.grad((out * grad).sum(), inputs)
    slow = torch.autograd.grad((ref * grad).sum(), inputs)
    for name, a, b in zip("q k v offsets".split(), fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")
