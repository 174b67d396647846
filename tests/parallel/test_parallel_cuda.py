"""Sliced Ulysses' CUDA piece (log-sum-exp attention) against the reference; skipped without a GPU.
Run by benchmarks/gpu/parallel.sh when a GPU is lent."""

import pytest
import torch

from slidefusion.parallel.chunked import attention_lse, attention_lse_reference, merge

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("mq, mk", [(1, 1), (37, 200), (1000, 77)])
def test_cuda_lse_attention_matches_the_reference(dtype, tol, mq, mk):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, m, 3, 64, device="cuda", dtype=dtype, generator=g) for m in (mq, mk, mk))
    out, lse = attention_lse(q, k, v)
    ref_out, ref_lse = attention_lse_reference(*(t.double() for t in (q, k, v)))
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert (out.double() - ref_out).abs().max() < tol and (lse.double() - ref_lse).abs().max() < tol
    halves = merge(attention_lse(q, k[:, : mk // 2 + 1], v[:, : mk // 2 + 1]),
                   attention_lse(q, k[:, mk // 2 + 1:], v[:, mk // 2 + 1:]))
    assert (halves[0].double() - ref_out).abs().max() < tol
