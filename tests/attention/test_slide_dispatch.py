"""The dispatch layer: backend choice, the custom op on meta tensors and under torch.compile, bad input."""

import pytest
import torch

from slidefusion.attention import (
    NeighborhoodAttention3d,
    SlideAttention3d,
    build_attention,
    dense_attention,
    neighborhood_attention,
    slide_attention,
)
from slidefusion.attention import backends
from slidefusion.attention.backends import cpp
from slidefusion.attention.reference import dense_attention_reference, slide_attention_reference
from slidefusion.core.errors import UserError
from attention_inputs import extra_kv, grads, qkv, random_offsets

TOL = 1e-10


def test_auto_chooses_by_device_and_named_backends_check_it(monkeypatch):
    assert backends.choose("auto", torch.device("cpu")) == "cpp"
    assert backends.choose("auto", torch.device("meta")) == "tiled"
    assert backends.choose("tiled", torch.device("cpu")) == "tiled"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match="backend='triton' needs cuda tensors"):
        backends.choose("triton", torch.device("cpu"))
    with pytest.raises(UserError, match="backend='fast' is unknown; valid: auto, reference, tiled, cpp, triton"):
        slide_attention(*qkv((2, 3, 3)), (1, 3, 3), backend="fast")


@pytest.mark.parametrize("backend", ["reference", "tiled", "cpp"])
def test_every_backend_through_the_public_op(backend):
    q, k, v = qkv((3, 4, 5))
    off = random_offsets(q, 27)
    fast = grads(lambda *a: slide_attention(*a[:3], (3, 3, 3), a[3], backend=backend), q, k, v, off)
    ref = grads(lambda *a: slide_attention_reference(*a[:3], (3, 3, 3), a[3]), q, k, v, off)
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.skipif(cpp.extension() is None, reason="the C++ extension does not build here")
@pytest.mark.parametrize("batch, heads", [(1, 4), (1, 3)])  # whole planes per thread; shared planes with buffers
def test_cpp_two_threads_both_splits(batch, heads):
    q, k, v = qkv((3, 5, 6), batch=batch, heads=heads)
    off = random_offsets(q, 27)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = grads(lambda *a: slide_attention(*a[:3], (3, 3, 3), a[3], backend="cpp"), q, k, v, off)
    finally:
        torch.set_num_threads(threads)
    ref = grads(lambda *a: slide_attention_reference(*a[:3], (3, 3, 3), a[3]), q, k, v, off)
    for a, b in zip(two, ref):
        torch.testing.assert_close(a, b, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("dtype, lse_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                              (torch.float64, torch.float64)])
def test_meta_tensors_plan_through_the_op(dtype, lse_dtype):
    q, k, v = (torch.empty(2, 4, 8, 8, 3, 16, device="meta", dtype=dtype) for _ in range(3))
    off = torch.empty(2, 4, 8, 8, 3, 27, 3, device="meta", dtype=dtype, requires_grad=True)
    ek, ev = (torch.empty(2, 7, 3, 16, device="meta", dtype=dtype, requires_grad=True) for _ in range(2))
    mask = torch.ones(2, 7, dtype=torch.bool, device="meta")
    for backend in ("auto", "tiled", "cpp"):
        out, lse = slide_attention(q, k, v, (3, 3, 3), off, extra_k=ek, extra_v=ev, extra_mask=mask,
                                   return_lse=True, backend=backend)
        assert out.device.type == "meta" and out.shape == q.shape and out.dtype == dtype
        assert lse.shape == q.shape[:5] and lse.dtype == lse_dtype
        d_off, d_ek = torch.autograd.grad(out.sum() + lse.sum(), (off, ek))
        assert d_off.shape == off.shape and d_ek.shape == ek.shape and d_off.device.type == "meta"


def _tiny_slide_dit():
    from slidefusion.models import build_model, preset

    torch.manual_seed(0)
    config = preset("dit3d-tiny", attention="slide", attention_options={"kernel_size": [3, 3, 3]})
    model = build_model(config)
    with torch.no_grad():  # non-zero offsets, so the compiled graph really samples between tokens
        for block in model.blocks:
            block.attn.offset_linear.bias.uniform_(-1, 1)
    inputs = (torch.randn(1, 3, 3, 6, 10), torch.rand(1), torch.randn(1, 5, config.text_dim))
    return model, inputs


def test_torch_compile_traces_dit3d_with_slide_attention_forward_and_backward():
    # aot_eager: dynamo and AOT autograd trace the custom op through its fake implementation and
    # registered backward, in one graph (fullgraph: no break at the op), without inductor's build time.
    model, inputs = _tiny_slide_dit()
    eager = model(*inputs)
    eager_grads = torch.autograd.grad(eager.square().sum(), list(model.parameters()))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = compiled(*inputs)
    out_grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    for a, b in zip(out_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_torch_compile_default_backend_runs_the_model():
    model, inputs = _tiny_slide_dit()
    with torch.no_grad():
        eager = model(*inputs)
        torch._dynamo.reset()
        out = torch.compile(model, fullgraph=True)(*inputs)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Bad input: one UserError line naming the parameter.

BAD_KERNELS = [(2, 3, 3), (3, 3, 4), (0, 3, 3), (3, -1, 3), (3, 3), (3.0, 3, 3), "3x3x3"]


@pytest.mark.parametrize("kernel", BAD_KERNELS)
def test_bad_kernel_size_is_one_line_naming_kernel_size(kernel):
    q, k, v = qkv((3, 5, 7))
    calls = [
        lambda: slide_attention(q, k, v, kernel),
        lambda: neighborhood_attention(q, k, v, kernel),
        lambda: SlideAttention3d(12, 3, kernel),
        lambda: NeighborhoodAttention3d(12, 3, kernel),
        lambda: build_attention("slide", 12, 3, kernel_size=kernel),
    ]
    for call in calls:
        with pytest.raises(UserError) as info:
            call()
        message = str(info.value)
        assert message.startswith("kernel_size") and "\n" not in message


def test_window_larger_than_the_grid_is_clamped_to_it():
    q, k, v = qkv((2, 3, 5))
    # Larger on T and H only: the clamped window (2, 3, 3), even on T.
    torch.testing.assert_close(
        neighborhood_attention(q, k, v, (3, 7, 3)), slide_attention_reference(q, k, v, (2, 3, 3)), rtol=TOL, atol=TOL
    )
    # Larger on every axis: dense attention.
    for backend in ("reference", "tiled", "cpp"):
        torch.testing.assert_close(
            neighborhood_attention(q, k, v, (5, 7, 9), backend=backend), dense_attention(q, k, v), rtol=TOL, atol=TOL
        )
    # Per-sample offsets count the clamped window's slots.
    off = random_offsets(q, 2 * 3 * 3)
    torch.testing.assert_close(
        slide_attention(q, k, v, (3, 7, 3), off), slide_attention_reference(q, k, v, (2, 3, 3), off), rtol=TOL, atol=TOL
    )
    with pytest.raises(UserError, match=r"K counts the window \(2, 3, 3\) clamped to the grid"):
        slide_attention(q, k, v, (3, 7, 3), random_offsets(q, 63))


def test_modules_clamp_their_window_on_small_grids_and_cover_them_whole():
    # A module built for (3, 7, 7) on a 1x2x6 grid attends densely: dense attention with its projections.
    torch.manual_seed(0)
    x = torch.randn(1, 1, 2, 6, 12, dtype=torch.float64)
    slide = SlideAttention3d(12, 3, (3, 7, 7)).double()
    dense = build_attention("dense", 12, 3).double()
    dense.load_state_dict(slide.state_dict(), strict=False)
    torch.testing.assert_close(slide(x), dense(x), rtol=TOL, atol=TOL)
    assert torch.isfinite(NeighborhoodAttention3d(12, 3, (3, 7, 7))(x.float())).all()


def test_bad_extra_keys_and_options_name_the_parameter():
    q, k, v = qkv((2, 3, 4))
    ek, ev, mask = extra_kv(q, 3)
    cases = [
        (dict(extra_k=ek), "extra_v must be"),
        (dict(extra_mask=mask), "extra_mask needs extra_k and extra_v"),
        (dict(extra_k=ek[:, :, :2], extra_v=ev), "extra_k must be"),
        (dict(extra_k=ek, extra_v=ev[:, :2]), "extra_v must have the shape of extra_k"),
        (dict(extra_k=ek.float(), extra_v=ev), "extra_k must have q's dtype"),
        (dict(extra_k=ek, extra_v=ev, extra_mask=mask.long()), "extra_mask must be a bool"),
        (dict(extra_k=ek, extra_v=ev, extra_mask=mask[:, :2]), "extra_mask must be a bool"),
        (dict(return_lse=1), "return_lse must be True or False"),
    ]
    for options, match in cases:
        with pytest.raises(UserError, match=match):
            slide_attention(q, k, v, (1, 3, 3), **options)
    with pytest.raises(UserError, match="scale must be None or a number"):
        slide_attention(q, k, v, (1, 3, 3), scale=True)


def test_dense_reference_sanity_for_the_clamp_test():
    q, k, v = qkv((2, 3, 5))
    torch.testing.assert_close(dense_attention(q, k, v), dense_attention_reference(q, k, v), rtol=TOL, atol=TOL)
