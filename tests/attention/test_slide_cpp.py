"""The compiled CPU kernel (`backends/cpp.py`) against the reference, and its fallback.

The extension is built once per process (the first test pays ~30 s on a cold cache; later runs
load it from torch's extensions folder) and shared by every test through `cpp.extension()`.
"""

import pytest
import torch

import functools

from slidefusion.attention import backends, slide_attention
from slidefusion.attention.backends import cpp
from slidefusion.attention.reference import slide_attention_reference
from attention_inputs import assert_low_precision_matches_reference, grads, qkv, random_offsets

TOL = 1e-10
slide_attention_cpp = functools.partial(slide_attention, backend="cpp")


@pytest.fixture(scope="module", autouse=True)
def extension():
    if cpp.extension() is None:
        pytest.skip(f"the C++ extension does not build here: {cpp._state['error']}")


CASES = [
    # grid, kernel, reach of the offsets
    ((3, 5, 7), (3, 3, 5), 1.4),
    ((4, 9, 6), (1, 5, 3), 1.4),  # window 1 on T
    ((5, 6, 7), (3, 1, 3), 1.4),  # window 1 on H
    ((3, 5, 7), (3, 5, 7), 1.4),  # window == grid: dense attention
    ((2, 1, 5), (1, 1, 3), 1.4),  # an axis of length 1: one corner there
    ((1, 1, 1), (1, 1, 1), 0.6),  # a single token
    ((4, 7, 9), (3, 3, 3), 4.0),  # far-flung points: the per-corner path instead of the box
]


@pytest.mark.parametrize("grid, kernel, reach", CASES)
@pytest.mark.parametrize("mode", ["none", "sample", "shift"])
def test_cpp_matches_reference_forward_and_backward(grid, kernel, reach, mode):
    q, k, v = qkv(grid)
    K = kernel[0] * kernel[1] * kernel[2]
    off = None if mode == "none" else random_offsets(q, K if mode == "sample" else 1, reach)
    fast = grads(lambda *a: slide_attention_cpp(*a[:3], kernel, a[3], 0.37), q, k, v, off)
    ref = grads(lambda *a: slide_attention_reference(*a[:3], kernel, a[3], 0.37), q, k, v, off)
    assert fast[0].shape == q.shape and fast[0].dtype == q.dtype
    for name, a, b in zip(("out", "dq", "dk", "dv", "doffsets"), fast, ref):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL, msg=lambda m: f"{name}: {m}")


def test_zero_offsets_match_reference_gradients_at_integer_points():
    # Zero-initialised offset networks start here: every point sits on a token, including the
    # grid's first and last positions, where the clamp's gradient rule decides.
    q, k, v = qkv((3, 4, 5))
    off = torch.zeros(*q.shape[:5], 27, 3, dtype=q.dtype)
    fast = grads(lambda *a: slide_attention_cpp(*a[:3], (3, 3, 3), a[3]), q, k, v, off)
    ref = grads(lambda *a: slide_attention_reference(*a[:3], (3, 3, 3), a[3]), q, k, v, off)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("mode", ["none", "sample", "shift"])
def test_cpp_gradcheck(mode):
    q, k, v = (x.requires_grad_() for x in qkv((2, 3, 4), batch=1, heads=2, head_dim=3))
    off = None if mode == "none" else random_offsets(q, 9 if mode == "sample" else 1).requires_grad_()
    inputs = (q, k, v) if off is None else (q, k, v, off)

    def op(*args):
        return slide_attention_cpp(*args[:3], (1, 3, 3), args[3] if len(args) > 3 else None)

    assert torch.autograd.gradcheck(op, inputs, atol=1e-7)


def test_threads_write_separate_gradient_buffers():
    # dk and dv are scatter-adds: with 2 threads each accumulates into its own buffer.
    q, k, v = qkv((3, 6, 7))
    off = random_offsets(q, 27)
    fn = lambda *a: slide_attention_cpp(*a[:3], (3, 3, 3), a[3])  # noqa: E731
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = grads(fn, q, k, v, off)
    finally:
        torch.set_num_threads(threads)
    ref = grads(lambda *a: slide_attention_reference(*a[:3], (3, 3, 3), a[3]), q, k, v, off)
    for a, b in zip(two, ref):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_computes_in_float32_and_keeps_the_dtype(dtype, tol):
    assert_low_precision_matches_reference(slide_attention_cpp, dtype, tol, slots=27)


def test_auto_dispatch_uses_the_compiled_kernel_on_cpu():
    q, k, v = qkv((3, 5, 7))
    assert backends.choose("auto", q.device) == "cpp"
    torch.testing.assert_close(
        slide_attention(q, k, v, (3, 3, 3)), slide_attention_reference(q, k, v, (3, 3, 3)), rtol=TOL, atol=TOL
    )


@pytest.mark.parametrize("backend", ["cpp", "tiled"])
def test_non_finite_offsets_behave_as_in_the_reference(backend):
    """A NaN offset gives NaN outputs for its query-head only, and NaN gradients flow back from
    them (a model with a NaN weight propagates NaN, as a stock one does); an infinite offset puts
    its point on the grid's edge. Nothing raises inside the forward."""
    q, k, v = qkv((3, 5, 7))
    off = random_offsets(q, 27)
    off[0, 0, 0, 0, 0, 0, 1] = float("nan")
    off[0, 1, 2, 3, 1, 4, 2], off[0, 2, 4, 6, 0, 1, 0] = float("inf"), float("-inf")
    q.requires_grad_(True)
    out = slide_attention(q, k, v, (3, 3, 3), off, backend=backend)
    ref = slide_attention_reference(q, k, v, (3, 3, 3), off)
    bad = torch.isnan(out).any(dim=-1)
    assert bad.nonzero().tolist() == [[0, 0, 0, 0, 0]] and torch.isnan(out[0, 0, 0, 0, 0]).all()
    torch.testing.assert_close(out.masked_fill(bad[..., None], 0), ref.masked_fill(bad[..., None], 0), rtol=TOL,
                               atol=TOL)
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert torch.isnan(grad).any()


def test_failed_build_warns_once_and_falls_back(monkeypatch):
    def broken_build():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(cpp, "_state", {"module": None, "error": None})
    monkeypatch.setattr(cpp, "build", broken_build)
    q, k, v = qkv((3, 5, 7))
    off = random_offsets(q, 27)
    with pytest.warns(RuntimeWarning, match="no C.. compiler found.*pure-PyTorch"):
        out = slide_attention_cpp(q, k, v, (3, 3, 3), off)
    torch.testing.assert_close(out, slide_attention_reference(q, k, v, (3, 3, 3), off), rtol=TOL, atol=TOL)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call is silent
        slide_attention_cpp(q, k, v, (3, 3, 3), off)
