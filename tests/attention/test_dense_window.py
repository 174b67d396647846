"""Dense and window attention: fast ops vs the reference and vs classic Swin; modules; registry."""

import pytest
import torch

from slidefusion.attention import (
    DenseAttention3d,
    GridAttention,
    WindowAttention3d,
    available_attention,
    build_attention,
    dense_attention,
    window_attention,
)
from slidefusion.attention.functional import _window_mask
from slidefusion.attention.reference import (
    dense_attention_reference,
    window_attention_reference,
    window_segments,
)
from slidefusion.core.errors import UserError
from attention_inputs import qkv

TOL = 1e-10


# ---------------------------------------------------------------------------------------------
# The specification itself: boundaries at shift + k*window.


def test_window_segments_follow_the_boundary_rule():
    # L=10, w=4, s=3: boundaries at 3 and 7 -> [0,3) | [3,7) | [7,10).
    assert window_segments(10, 4, 3).tolist() == [-1, -1, -1, 0, 0, 0, 0, 1, 1, 1]
    assert window_segments(7, 3, 0).tolist() == [0, 0, 0, 1, 1, 1, 2]
    # A window covering the axis is clamped and loses its shift.
    assert window_segments(5, 5, 2).tolist() == [0] * 5
    assert window_segments(5, 9, 4).tolist() == [0] * 5


# ---------------------------------------------------------------------------------------------
# Fast vs reference.

WINDOW_CASES = [
    # grid, window, shift
    ((3, 5, 7), (2, 2, 3), (0, 0, 0)),  # no window divides the grid
    ((3, 5, 7), (2, 3, 4), (1, 1, 2)),  # shifted on all axes, padded on all axes
    ((3, 5, 7), (1, 4, 4), (0, 2, 0)),  # window 1 on T
    ((3, 5, 7), (8, 2, 9), (3, 1, 5)),  # window > grid on T and W: clamped, shift dropped
    ((5, 9, 6), (2, 4, 3), (1, 0, 0)),  # shift on T only
    ((5, 9, 6), (2, 4, 3), (0, 3, 0)),  # shift on H only
    ((5, 9, 6), (2, 4, 3), (0, 0, 2)),  # shift on W only
    ((5, 9, 6), (3, 4, 4), (2, 3, 3)),  # segment [0, s) meets padding inside the last window
    ((5, 9, 6), (5, 9, 6), (4, 8, 5)),  # window == grid: clamped, shift dropped
    ((5, 9, 6), (1, 1, 1), (0, 0, 0)),  # every token alone
    ((4, 8, 6), (2, 4, 3), (1, 2, 1)),  # divisible grid, shifted
    ((1, 1, 1), (2, 4, 4), (1, 2, 2)),  # a single token
]


@pytest.mark.parametrize("grid, window, shift", WINDOW_CASES)
def test_window_matches_reference(grid, window, shift):
    q, k, v = qkv(grid)
    out = window_attention(q, k, v, window, shift)
    ref = window_attention_reference(q, k, v, window, shift)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=TOL, atol=TOL)


def test_window_matches_reference_with_scale_and_float32():
    q, k, v = qkv((3, 5, 7), dtype=torch.float32)
    out = window_attention(q, k, v, (2, 3, 4), (1, 2, 3), scale=0.7)
    ref = window_attention_reference(q, k, v, (2, 3, 4), (1, 2, 3), scale=0.7)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_dense_matches_reference():
    q, k, v = qkv((3, 5, 7))
    out = dense_attention(q, k, v)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, dense_attention_reference(q, k, v), rtol=TOL, atol=TOL)
    torch.testing.assert_close(
        dense_attention(q, k, v, scale=0.3), dense_attention_reference(q, k, v, scale=0.3), rtol=TOL, atol=TOL
    )


@pytest.mark.parametrize("window, shift", [((3, 5, 7), (0, 0, 0)), ((9, 9, 9), (4, 4, 4))])
def test_window_covering_the_grid_is_dense(window, shift):
    q, k, v = qkv((3, 5, 7))
    out = window_attention(q, k, v, window, shift)
    torch.testing.assert_close(out, dense_attention(q, k, v), rtol=TOL, atol=TOL)


# ---------------------------------------------------------------------------------------------
# Independent check: the classic Swin construction (roll, partition, region labels by slices).


def swin_window_attention(q, k, v, window, shift):
    """Shifted-window attention the way Swin writes it; the grid must be divisible by the window."""
    B, T, H, W, heads, D = q.shape
    wt, wh, ww = window
    Nw = wt * wh * ww

    def partition(x):  # (B, T, H, W, ...) -> (B, nWin, Nw, ...)
        n, rest = x.shape[0], x.shape[4:]
        x = x.view(n, T // wt, wt, H // wh, wh, W // ww, ww, *rest)
        x = x.permute(0, 1, 3, 5, 2, 4, 6, *range(7, 7 + len(rest)))
        return x.reshape(n, -1, Nw, *rest)

    rolled = [torch.roll(x, (-shift[0], -shift[1], -shift[2]), (1, 2, 3)) for x in (q, k, v)]
    qw, kw, vw = (partition(x).transpose(2, 3) for x in rolled)  # (B, nWin, heads, Nw, D)

    def regions(w, s):
        return (slice(0, -w), slice(-w, -s), slice(-s, None)) if s else (slice(None),)

    labels = torch.zeros(1, T, H, W)
    count = 0
    for ts in regions(wt, shift[0]):
        for hs in regions(wh, shift[1]):
            for ws in regions(ww, shift[2]):
                labels[:, ts, hs, ws] = count
                count += 1
    labels = partition(labels)  # (1, nWin, Nw)
    allowed = labels[..., :, None] == labels[..., None, :]  # (1, nWin, Nw, Nw)

    scores = qw @ kw.transpose(-1, -2) * D**-0.5  # (B, nWin, heads, Nw, Nw)
    scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
    out = (scores.softmax(-1) @ vw).transpose(2, 3)  # (B, nWin, Nw, heads, D)
    out = out.reshape(B, T // wt, H // wh, W // ww, wt, wh, ww, heads, D)
    out = out.permute(0, 1, 4, 2, 5, 3, 6, 7, 8).reshape(B, T, H, W, heads, D)
    return torch.roll(out, shift, (1, 2, 3))


@pytest.mark.parametrize("shift", [(0, 0, 0), (1, 2, 1), (1, 0, 0), (0, 2, 0), (0, 0, 2)])
def test_window_matches_classic_swin(shift):
    q, k, v = qkv((4, 8, 6))
    out = window_attention(q, k, v, (2, 4, 3), shift)
    expected = swin_window_attention(q, k, v, (2, 4, 3), shift)
    torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)


# ---------------------------------------------------------------------------------------------
# Gradients.


def test_window_gradcheck_with_padding_and_shift():
    # T=5, window 4, shift 1 leaves a window part that holds only padding: its rows must stay finite.
    q, k, v = (x.requires_grad_() for x in qkv((5, 3, 2), batch=1, heads=1, head_dim=2))
    def op(a, b, c):
        return window_attention(a, b, c, (4, 2, 2), (1, 1, 1))

    assert torch.autograd.gradcheck(op, (q, k, v))


def test_window_mask_rows_are_never_empty():
    # CPU SDPA returns 0 for a row with no visible key, but other backends may return NaN, whose
    # gradient would reach k and v. The mask must give every query (padding included) some key.
    grid, window, shift = (5, 3, 2), (4, 2, 2), (1, 1, 1)  # T: padding alone in part of a window
    mask = _window_mask(grid, window, shift, torch.device("cpu"))  # (nWin, 1, Nw, Nw)
    assert mask.any(dim=-1).all()


def test_window_gradients_are_finite_in_float32():
    q, k, v = (x.requires_grad_() for x in qkv((5, 9, 6), dtype=torch.float32))
    window_attention(q, k, v, (3, 4, 4), (2, 3, 3)).square().sum().backward()
    assert all(x.grad.isfinite().all() for x in (q, k, v))


# ---------------------------------------------------------------------------------------------
# Modules and registry.


@pytest.mark.parametrize("module", [DenseAttention3d(12, 3), WindowAttention3d(12, 3, (2, 3, 4), (1, 1, 2))])
def test_module_keeps_grid_shape(module):
    x = torch.randn(2, 3, 5, 7, 12)
    assert module(x).shape == x.shape
    assert isinstance(module, GridAttention)


def test_window_module_matches_reference_math():
    # heads=4 != 3, so a (heads, 3) vs (3, heads) mix-up in the qkv split cannot go unseen.
    torch.manual_seed(0)
    module = WindowAttention3d(12, 4, (2, 3, 4), (1, 2, 3)).double()
    x = torch.randn(2, 3, 5, 7, 12, dtype=torch.float64)
    q, k, v = module.qkv(x).reshape(2, 3, 5, 7, 3, 4, 3).unbind(dim=4)  # (3 x) (B, T, H, W, heads, D)
    expected = module.proj(window_attention_reference(q, k, v, (2, 3, 4), (1, 2, 3)).reshape(x.shape))
    torch.testing.assert_close(module(x), expected, rtol=TOL, atol=TOL)


def test_registry_builds_dense_and_window():
    assert {"dense", "window"} <= set(available_attention())
    assert isinstance(build_attention("dense", 12, 3, block_index=1), DenseAttention3d)
    even = build_attention("window", 12, 3, block_index=0, window_size=[2, 4, 4])
    odd = build_attention("window", 12, 3, block_index=3, window_size=[2, 4, 4])
    assert (even.window_size, even.shift) == ((2, 4, 4), (0, 0, 0))
    assert (odd.window_size, odd.shift) == ((2, 4, 4), (1, 2, 2))
    assert build_attention("window", 12, 3, block_index=1).shift == (1, 2, 2)  # default (2, 4, 4)
    assert build_attention("window", 12, 3, block_index=1, window_size=(1, 3, 5)).shift == (0, 1, 2)
    x = torch.randn(1, 3, 5, 7, 12)
    assert odd(x).shape == x.shape


def test_registry_rejects_unknown_names_and_options():
    with pytest.raises(UserError, match="attention='nope'.*dense.*window"):
        build_attention("nope", 12, 3)
    with pytest.raises(UserError, match="window_size"):
        build_attention("dense", 12, 3, window_size=(2, 4, 4))
    with pytest.raises(UserError, match="window_size"):
        build_attention("window", 12, 3, window_size=(0, 4, 4))


@pytest.mark.parametrize(
    "window, shift, name",
    [
        ((0, 4, 4), (0, 0, 0), "window_size"),
        ((2, 4), (0, 0, 0), "window_size"),
        ((2.0, 4, 4), (0, 0, 0), "window_size"),
        ((2, 4, 4), (2, 0, 0), r"shift\[0\]"),
        ((2, 4, 4), (0, -1, 0), r"shift\[1\]"),
        ((2, 4, 4), (0, 0), "shift"),
    ],
)
def test_bad_window_args_name_the_parameter(window, shift, name):
    q, k, v = qkv((3, 5, 7))
    with pytest.raises(UserError, match=name):
        window_attention(q, k, v, window, shift)
    with pytest.raises(UserError, match=name):
        WindowAttention3d(12, 3, window, shift)


def test_bad_tensors_and_dims_name_the_parameter():
    q, k, v = qkv((3, 5, 7))
    with pytest.raises(UserError, match="q must be 6-D"):
        dense_attention(q[0], k[0], v[0])
    with pytest.raises(UserError, match="k must"):
        window_attention(q, k[:, :2], v)
    with pytest.raises(UserError, match="heads"):
        DenseAttention3d(10, 3)
    with pytest.raises(UserError, match="x must"):
        DenseAttention3d(12, 3)(torch.randn(2, 3, 5, 12))
