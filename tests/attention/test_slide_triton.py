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


def test_triton_lse_and_extra_keys_match_reference_with_gradients():
    # The Triton kernel's log-sum-exp output and its gradient (through delta - dlse), and extra
    # keys merged by log-sum-exp, one of them masked.
    g = torch.Generator().manual_seed(1)
    grid, kernel = (2, 3, 5), (1, 3, 3)
    q, k, v = (torch.randn(2, *grid, 2, 4, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    off = ((torch.rand(2, *grid, 2, 9, 3, generator=g) * 2 - 1) * 1.3 + 0.01).to(DEVICE).requires_grad_()
    ek, ev = (torch.randn(2, 3, 2, 4, generator=g).to(DEVICE).requires_grad_() for _ in range(2))
    mask = torch.tensor([[True, False, True], [True, True, True]], device=DEVICE)
    inputs = (q, k, v, off, ek, ev)
    out, lse = slide_attention(q, k, v, kernel, off, extra_k=ek, extra_v=ev, extra_mask=mask, return_lse=True,
                               backend="triton")
    ref, ref_lse = slide_attention_reference(q, k, v, kernel, off, None, ek, ev, mask, return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:5]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    go, gl = torch.randn(q.shape, generator=g).to(DEVICE), torch.randn(q.shape[:5], generator=g).to(DEVICE)
    fast = torch.autograd.grad((out * go).sum() + (lse * gl).sum(), inputs)
    slow = torch.autograd.grad((ref * go).sum() + (ref_lse * gl).sum(), inputs)
    for name, a, b in zip("q k v offsets extra_k extra_v".split(), fast, slow):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"d{name}: {m}")


def test_triton_nan_offsets_give_nan_outputs_there_only():
    q, k, v = (torch.randn(1, 2, 3, 4, 1, 4).to(DEVICE) for _ in range(3))
    off = torch.zeros(1, 2, 3, 4, 1, 1, 3, device=DEVICE)
    off[0, 1, 2, 3, 0, 0, 1] = float("nan")
    out = slide_attention(q, k, v, (1, 3, 3), off, backend="triton")
    assert torch.isnan(out[0, 1, 2, 3]).all()
    out[0, 1, 2, 3] = 0
    assert torch.isfinite(out).all()
