"""Log-sum-exp output and extra (global) keys: every backend against the float64 reference.

The reference itself is checked against masked dense attention: with a window that covers the
grid and no offsets, joint attention is dense attention over [grid tokens ; extra keys].
"""

import pytest
import torch
import torch.nn.functional as F

from slidefusion.attention import joint_attention, merge_attention, slide_attention
from slidefusion.attention.backends import cpp
from slidefusion.attention.reference import slide_attention_reference
from attention_inputs import extra_kv, qkv, random_offsets

TOL = 1e-10
CPU_BACKENDS = ["tiled", "cpp"]


def dense_over(q, keys, values, mask=None):
    """softmax over every key: q (B, N, heads, D), keys (B, M, heads, D) -> out (B, N, heads, D), lse (B, N, heads)."""
    s = torch.einsum("bnhd,bmhd->bhnm", q, keys) * q.shape[-1] ** -0.5
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    out = torch.einsum("bhnm,bmhd->bnhd", s.softmax(-1), values)
    return out, torch.logsumexp(s, -1).transpose(1, 2)


def test_reference_joint_with_whole_grid_window_is_dense_over_grid_and_extra_keys():
    q, k, v = qkv((2, 3, 4))
    ek, ev, mask = extra_kv(q, 5, masked=[(0, 1), (1, 4)])
    out, lse = slide_attention_reference(q, k, v, (2, 3, 4), None, None, ek, ev, mask, return_lse=True)
    B, heads, D = q.shape[0], q.shape[4], q.shape[5]
    flat = lambda x: x.reshape(B, -1, heads, D)  # noqa: E731
    keys, values = torch.cat([flat(k), ek], 1), torch.cat([flat(v), ev], 1)
    full_mask = torch.cat([torch.ones(B, 24, dtype=torch.bool), mask], 1)
    ref_out, ref_lse = dense_over(flat(q), keys, values, full_mask)
    torch.testing.assert_close(flat(out), ref_out, rtol=TOL, atol=TOL)
    torch.testing.assert_close(lse.reshape(B, -1, heads), ref_lse, rtol=TOL, atol=TOL)


def test_merge_of_two_key_sets_is_the_softmax_over_their_union():
    g = torch.Generator().manual_seed(0)
    q, keys, values = (torch.randn(2, 5, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    a, b = dense_over(q, keys[:, :2], values[:, :2]), dense_over(q, keys[:, 2:], values[:, 2:])
    out, lse = merge_attention(*a, *b)
    ref = dense_over(q, keys, values)
    torch.testing.assert_close(out, ref[0], rtol=TOL, atol=TOL)
    torch.testing.assert_close(lse, ref[1], rtol=TOL, atol=TOL)


# grid, kernel, mode, L, masked (b, l) pairs; batch 2, 3 heads, D 5
JOINT_CASES = [
    ((3, 5, 7), (3, 3, 5), "sample", 4, [(0, 1)]),  # odd sizes, one masked key
    ((3, 5, 7), (1, 1, 1), "shift", 3, []),  # window 1
    ((2, 3, 4), (3, 5, 5), "none", 2, [(1, 0)]),  # window larger than the grid: clamped, dense
    ((2, 3, 4), (1, 3, 3), "sample", 1, []),  # one extra key
    ((2, 4, 3), (1, 3, 3), "sample", 3, [(1, 0), (1, 1), (1, 2)]),  # sample 1: every extra key masked
]


def _inputs(grid, kernel, mode, L, masked):
    q, k, v = qkv(grid)
    K = 1
    for kern, n in zip(kernel, grid):
        K *= min(kern, n)
    off = None if mode == "none" else random_offsets(q, K if mode == "sample" else 1)
    return (q, k, v, off, *extra_kv(q, L, masked))


def _joint_grads(fn, q, k, v, off, ek, ev, mask, seed=4):
    """Outputs and the gradients of a random combination of out and lse wrt every input."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v, ek, ev)]
    if off is not None:
        leaves.append(off.detach().requires_grad_())
    out, lse = fn(*leaves[:3], leaves[5] if off is not None else None, leaves[3], leaves[4], mask)
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)  # the same in every dtype
    gl = torch.randn(lse.shape, generator=g, dtype=torch.float64).to(lse.dtype)
    return (out, lse, *torch.autograd.grad((out * go).sum() + (lse * gl).sum(), leaves))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("grid, kernel, mode, L, masked", JOINT_CASES)
def test_joint_matches_reference_with_lse_and_gradients(backend, grid, kernel, mode, L, masked):
    args = _inputs(grid, kernel, mode, L, masked)

    def fast(q, k, v, off, ek, ev, mask):
        return slide_attention(q, k, v, kernel, off, 0.41, extra_k=ek, extra_v=ev, extra_mask=mask,
                               return_lse=True, backend=backend)

    def ref(q, k, v, off, ek, ev, mask):
        return slide_attention_reference(q, k, v, kernel, off, 0.41, ek, ev, mask, return_lse=True)

    names = ["out", "lse", "dq", "dk", "dv", "dextra_k", "dextra_v", "doffsets"]
    for name, a, b in zip(names, _joint_grads(fast, *args), _joint_grads(ref, *args)):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_all_extra_keys_masked_is_plain_slide_attention(backend):
    q, k, v = qkv((3, 4, 5))
    off = random_offsets(q, 27)
    ek, ev, _ = extra_kv(q, 3)
    none = torch.zeros(q.shape[0], 3, dtype=torch.bool)
    joint = slide_attention(q, k, v, (3, 3, 3), off, extra_k=ek, extra_v=ev, extra_mask=none, return_lse=True,
                            backend=backend)
    plain = slide_attention(q, k, v, (3, 3, 3), off, return_lse=True, backend=backend)
    for a, b in zip(joint, plain):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", ["none", "shift"])
def test_lse_gradcheck(backend, mode):
    q, k, v = (x.requires_grad_() for x in qkv((2, 3, 4), batch=1, heads=2, head_dim=3))
    off = None if mode == "none" else random_offsets(q, 1).requires_grad_()
    inputs = (q, k, v) if off is None else (q, k, v, off)

    def op(*a):
        return slide_attention(*a[:3], (1, 3, 3), a[3] if len(a) > 3 else None, return_lse=True, backend=backend)

    assert torch.autograd.gradcheck(op, inputs, atol=1e-7)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_joint_gradcheck(backend):
    q, k, v = (x.requires_grad_() for x in qkv((2, 3, 3), batch=2, heads=1, head_dim=3))
    off = random_offsets(q, 9).requires_grad_()
    ek, ev, mask = extra_kv(q, 2, masked=[(1, 0)])
    ek.requires_grad_(), ev.requires_grad_()

    def op(q, k, v, off, ek, ev):
        return slide_attention(q, k, v, (1, 3, 3), off, extra_k=ek, extra_v=ev, extra_mask=mask, return_lse=True,
                               backend=backend)

    assert torch.autograd.gradcheck(op, (q, k, v, off, ek, ev), atol=1e-7)


def test_joint_runs_in_chunks(monkeypatch):
    from slidefusion.attention import joint

    q, k, v, off, ek, ev, mask = _inputs((3, 4, 5), (3, 3, 3), "sample", 4, [(0, 2)])
    expected = _joint_grads(lambda *a: slide_attention_reference(*a[:3], (3, 3, 3), a[3], None, *a[4:], True),
                            q, k, v, off, ek, ev, mask)
    monkeypatch.setattr(joint, "CHUNK_ELEMENTS", 50)  # chunks of a few queries
    fast = _joint_grads(lambda *a: slide_attention(*a[:3], (3, 3, 3), a[3], extra_k=a[4], extra_v=a[5],
                                                   extra_mask=a[6], return_lse=True), q, k, v, off, ek, ev, mask)
    for a, b in zip(fast, expected):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_low_precision_joint_keeps_dtype_and_returns_float32_lse():
    q, k, v = qkv((3, 4, 5), dtype=torch.bfloat16)
    ek, ev, mask = extra_kv(q, 3, masked=[(0, 0)])
    out, lse = slide_attention(q, k, v, (3, 3, 3), extra_k=ek, extra_v=ev, extra_mask=mask, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    ref_out, ref_lse = slide_attention_reference(*(x.double() for x in (q, k, v)), (3, 3, 3), None, None,
                                                 ek.double(), ev.double(), mask, True)
    torch.testing.assert_close(out.double(), ref_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=1e-5)


def test_joint_attention_text_queries_stay_dense_and_whole_grid_is_stock_joint_attention():
    # CogVideoX-style block: with a window over the whole grid, it is dense attention over [text ; video].
    q, k, v = qkv((2, 3, 4))
    tq, tk, tv = (x.double() for x in qkv((1, 1, 4), seed=5)[:3])
    tq, tk, tv = (x.reshape(2, 4, 3, 5) for x in (tq, tk, tv))
    mask = torch.tensor([[True, True, True, False], [True, False, True, True]])
    video, text = joint_attention(q, k, v, tq, tk, tv, (3, 3, 5), text_mask=mask)
    B, heads, D = 2, 3, 5
    flat = lambda x: x.reshape(B, -1, heads, D)  # noqa: E731
    keys, values = torch.cat([tk, flat(k)], 1), torch.cat([tv, flat(v)], 1)
    seen = torch.cat([mask, torch.ones(B, 24, dtype=torch.bool)], 1)
    ref_video, _ = dense_over(flat(q), keys, values, seen)
    ref_text, _ = dense_over(tq, keys, values, seen)
    torch.testing.assert_close(flat(video), ref_video, rtol=TOL, atol=TOL)
    torch.testing.assert_close(text, ref_text, rtol=TOL, atol=TOL)


@pytest.mark.skipif(cpp.extension() is None, reason="the C++ extension does not build here")
@pytest.mark.parametrize("D", [16, 32, 64])
@pytest.mark.parametrize("mode", ["none", "sample", "shift"])
def test_cpp_float32_head_sizes_match_reference(D, mode):
    # D = 32 and 64 run the kernel's fixed-size vector rows, 16 the plain loops.
    q, k, v = qkv((3, 5, 6), batch=1, heads=2, head_dim=D, dtype=torch.float32)
    off = None if mode == "none" else random_offsets(q, 27 if mode == "sample" else 1, reach=1.5)
    fast = _joint_grads(lambda *a: slide_attention(*a[:3], (3, 3, 3), a[3], extra_k=a[4], extra_v=a[5],
                                                   extra_mask=a[6], return_lse=True, backend="cpp"),
                        q, k, v, off, *extra_kv(q, 2))
    ref = _joint_grads(lambda *a: slide_attention_reference(*a[:3], (3, 3, 3), a[3], None, *a[4:], True),
                       *(None if x is None else x.double() for x in (q, k, v, off)),
                       *(x if x.dtype == torch.bool else x.double() for x in extra_kv(q, 2)))
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a.double(), b, rtol=2e-5, atol=2e-5)


def test_sdpa_is_not_needed_for_masked_text_rows():
    # A padding text query still attends to the video tokens: no all-masked row, no NaN.
    q, k, v = qkv((1, 2, 2), batch=1)
    tq, tk, tv = (torch.randn(1, 2, 3, 5, dtype=q.dtype) for _ in range(3))
    _, text = joint_attention(q, k, v, tq, tk, tv, (1, 3, 3), text_mask=torch.tensor([[False, False]]))
    assert torch.isfinite(text).all()
    expected = F.scaled_dot_product_attention(tq.transpose(1, 2), k.reshape(1, 4, 3, 5).transpose(1, 2),
                                              v.reshape(1, 4, 3, 5).transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(text, expected, rtol=TOL, atol=TOL)
