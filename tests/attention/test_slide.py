"""Slide / neighbourhood attention: the reference, the tiled PyTorch path, modules, registry, model."""

import pytest
import torch

from slidefusion.attention import (
    NeighborhoodAttention3d,
    SlideAttention3d,
    build_attention,
    neighborhood_attention,
    slide_attention,
)
from slidefusion.attention.backends import tiled
from slidefusion.attention.reference import (
    dense_attention_reference,
    neighborhood_attention_reference,
    slide_attention_reference,
    window_starts,
)
from slidefusion.errors import UserError
from attention_inputs import assert_low_precision_matches_reference, qkv, random_offsets, tiled_op

TOL = 1e-10


# ---------------------------------------------------------------------------------------------
# The specification.


def test_window_starts_follow_the_border_rule():
    assert window_starts(7, 3).tolist() == [0, 0, 1, 2, 3, 4, 4]
    assert window_starts(5, 5).tolist() == [0] * 5
    assert window_starts(4, 1).tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("grid, kernel", [((3, 5, 7), (3, 3, 5)), ((4, 6, 5), (1, 5, 3)), ((2, 3, 4), (1, 3, 3))])
def test_gathering_reference_with_zero_offsets_is_the_masked_neighbourhood(grid, kernel):
    q, k, v = qkv(grid)
    expected = neighborhood_attention_reference(q, k, v, kernel)
    zeros = torch.zeros(*q.shape[:5], 1, 3, dtype=q.dtype)
    torch.testing.assert_close(slide_attention_reference(q, k, v, kernel), expected, rtol=TOL, atol=TOL)
    torch.testing.assert_close(slide_attention_reference(q, k, v, kernel, zeros), expected, rtol=TOL, atol=TOL)


def test_reference_interpolates_between_tokens():
    # One query, window 1, offset 0.25 along W: key and value are 3/4 of token 0 plus 1/4 of token 1.
    q, k, v = qkv((1, 1, 2), batch=1, heads=1)
    off = torch.zeros(1, 1, 1, 2, 1, 1, 3, dtype=q.dtype)
    off[0, 0, 0, 0, 0, 0, 2] = 0.25
    out = slide_attention_reference(q, k, v, (1, 1, 1), off)
    torch.testing.assert_close(out[0, 0, 0, 0], 0.75 * v[0, 0, 0, 0] + 0.25 * v[0, 0, 0, 1], rtol=TOL, atol=TOL)


# ---------------------------------------------------------------------------------------------
# Fast vs reference, on shapes no tile divides.

CASES = [
    # grid, kernel, tile (None = default)
    ((3, 5, 7), (3, 3, 5), None),
    ((3, 5, 7), (3, 3, 5), (2, 2, 3)),  # no tile divides the grid
    ((4, 9, 6), (1, 5, 3), (3, 4, 4)),  # window 1 on T
    ((5, 6, 7), (3, 1, 3), (2, 5, 2)),  # window 1 on H
    ((3, 5, 7), (3, 5, 7), (2, 2, 3)),  # window == grid: dense attention
    ((1, 1, 1), (1, 1, 1), None),  # a single token
]


@pytest.mark.parametrize("grid, kernel, tile", CASES)
@pytest.mark.parametrize("mode", ["none", "sample", "shift"])
def test_tiled_matches_reference(monkeypatch, grid, kernel, tile, mode):
    q, k, v = qkv(grid)
    K = kernel[0] * kernel[1] * kernel[2]
    off = None if mode == "none" else random_offsets(q, K if mode == "sample" else 1)
    out = tiled_op(monkeypatch, tile)(q, k, v, kernel, off)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, slide_attention_reference(q, k, v, kernel, off), rtol=TOL, atol=TOL)


def test_tiled_matches_reference_with_large_offsets_and_scale(monkeypatch):
    # Offsets up to 4 tokens: the halo grows by 5 per side and clamps to the grid.
    q, k, v = qkv((4, 7, 9))
    off = random_offsets(q, 27, reach=4.0)
    out = tiled_op(monkeypatch, (2, 3, 4))(q, k, v, (3, 3, 3), off, 0.3)
    torch.testing.assert_close(out, slide_attention_reference(q, k, v, (3, 3, 3), off, 0.3), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("mode", ["none", "sample"])
def test_tiled_chunks_agree_with_one_chunk(monkeypatch, mode):
    # A tiny chunk budget forces chunks of one h-tile row, then of one t-tile row.
    q, k, v = qkv((5, 6, 7))
    off = None if mode == "none" else random_offsets(q, 27)
    expected = slide_attention_reference(q, k, v, (3, 3, 3), off)
    op = tiled_op(monkeypatch, (2, 2, 3))
    for budget in (1, 3000):
        monkeypatch.setattr(tiled, "CHUNK_ELEMENTS", budget)
        out = op(q, k, v, (3, 3, 3), off)
        torch.testing.assert_close(out, expected, rtol=TOL, atol=TOL)


def test_whole_grid_window_is_dense_and_zero_offsets_are_neighbourhood():
    q, k, v = qkv((3, 5, 7))
    torch.testing.assert_close(
        neighborhood_attention(q, k, v, (3, 5, 7)), dense_attention_reference(q, k, v), rtol=TOL, atol=TOL
    )
    zeros = torch.zeros(*q.shape[:5], 45, 3, dtype=q.dtype)
    torch.testing.assert_close(
        slide_attention(q, k, v, (3, 3, 5), zeros), neighborhood_attention(q, k, v, (3, 3, 5)), rtol=TOL, atol=TOL
    )


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_low_precision_keeps_the_dtype(dtype, tol):
    assert_low_precision_matches_reference(slide_attention, dtype, tol, slots=1)


# ---------------------------------------------------------------------------------------------
# Gradients (float64, offsets away from integer points).


@pytest.mark.parametrize("mode", ["none", "sample", "shift"])
def test_tiled_gradcheck(monkeypatch, mode):
    # Window 1 on W and tiles (2, 3, 2) that divide nothing: padding, halo clamping and offsets at once.
    q, k, v = (x.requires_grad_() for x in qkv((3, 4, 5), batch=1, heads=1, head_dim=3))
    off = None if mode == "none" else random_offsets(q, 9 if mode == "sample" else 1).requires_grad_()
    inputs = (q, k, v) if off is None else (q, k, v, off)
    tiled_slide = tiled_op(monkeypatch, (2, 3, 2))

    def op(*args):
        return tiled_slide(*args[:3], (3, 3, 1), args[3] if len(args) > 3 else None)

    assert torch.autograd.gradcheck(op, inputs, atol=1e-7)


def test_tiled_gradients_match_reference_on_a_larger_window(monkeypatch):
    q, k, v = (x.requires_grad_() for x in qkv((4, 6, 7), head_dim=4))
    off = random_offsets(q, 45, reach=2.3).requires_grad_()
    g = torch.randn(q.shape, dtype=q.dtype)
    op = tiled_op(monkeypatch, (2, 4, 3))
    fast = torch.autograd.grad((op(q, k, v, (3, 3, 5), off) * g).sum(), (q, k, v, off))
    ref = torch.autograd.grad((slide_attention_reference(q, k, v, (3, 3, 5), off) * g).sum(), (q, k, v, off))
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# Errors.


def test_bad_arguments_name_the_parameter():
    q, k, v = qkv((3, 5, 7))
    with pytest.raises(UserError, match="kernel_size must be odd"):
        slide_attention(q, k, v, (2, 3, 3))
    with pytest.raises(UserError, match="kernel_size must be 3 ints"):
        slide_attention(q, k, v, (3, 3))
    with pytest.raises(UserError, match="offsets must be None or"):
        slide_attention(q, k, v, (3, 3, 3), torch.zeros(*q.shape[:5], 5, 3, dtype=q.dtype))
    with pytest.raises(UserError, match="offsets must be a floating"):
        slide_attention(q, k, v, (3, 3, 3), torch.zeros(*q.shape[:5], 1, 3, dtype=torch.long))
    with pytest.raises(UserError, match="share one floating dtype"):
        slide_attention(q, k.float(), v, (3, 3, 3))
    with pytest.raises(UserError, match="share one floating dtype"):
        slide_attention(*(x.long() for x in (q, k, v)), (3, 3, 3))
    with pytest.raises(UserError, match="q must be 6-D"):
        slide_attention(q[0], k[0], v[0], (3, 3, 3))
    with pytest.raises(UserError, match="offsets='free' is unknown; valid: sample, shift"):
        SlideAttention3d(12, 3, offsets="free")
    with pytest.raises(UserError, match="kernel_size"):
        build_attention("neighborhood", 12, 3, kernel_size=(3, 4, 3))
    with pytest.raises(UserError, match="max_offset"):
        build_attention("slide", 12, 3, window_size=(2, 4, 4))


# ---------------------------------------------------------------------------------------------
# Modules, registry, model.


@pytest.mark.parametrize("mode", ["sample", "shift"])
def test_slide_module_starts_as_neighbourhood_and_learns_offsets(mode):
    torch.manual_seed(0)
    slide = SlideAttention3d(12, 4, (3, 3, 5), offsets=mode).double()
    nbhd = NeighborhoodAttention3d(12, 4, (3, 3, 5)).double()
    nbhd.load_state_dict(slide.state_dict(), strict=False)
    x = torch.randn(2, 3, 5, 7, 12, dtype=torch.float64)
    torch.testing.assert_close(slide(x), nbhd(x), rtol=TOL, atol=TOL)
    slide(x).square().sum().backward()
    assert slide.offset_linear.weight.grad.abs().sum() > 0  # zero-init, but not dead
    with torch.no_grad():
        slide.offset_linear.bias.fill_(5.0)
    off = slide.predict_offsets(torch.randn(2, 3, 5, 7, 4, 3, dtype=torch.float64), (3, 3, 5))
    assert off.shape == (2, 3, 5, 7, 4, 45 if mode == "sample" else 1, 3)
    assert off.abs().max() <= slide.max_offset


def test_modules_fit_their_window_to_small_grids():
    x = torch.randn(1, 1, 2, 6, 12)
    assert SlideAttention3d(12, 3, (3, 7, 7))(x).shape == x.shape
    assert NeighborhoodAttention3d(12, 3, (3, 7, 7))(x).shape == x.shape


def test_registry_builds_slide_and_neighborhood():
    slide = build_attention("slide", 12, 3, block_index=1, kernel_size=[3, 5, 5], offsets="shift")
    assert isinstance(slide, SlideAttention3d) and slide.kernel_size == (3, 5, 5) and slide.slots == 1
    assert isinstance(build_attention("neighborhood", 12, 3), NeighborhoodAttention3d)


@pytest.mark.parametrize("mode", ["sample", "shift"])
def test_dit3d_trains_with_slide_attention(mode):
    from slidefusion.models import build_model, preset

    torch.manual_seed(0)
    config = preset("dit3d-tiny", attention="slide", attention_options={"kernel_size": [3, 3, 3], "offsets": mode})
    model = build_model(config)
    assert all(isinstance(block.attn, SlideAttention3d) for block in model.blocks)
    x, t, context = torch.randn(2, 3, 3, 6, 10), torch.rand(2), torch.randn(2, 5, config.text_dim)
    out = model(x, t, context)
    assert out.shape == x.shape
    out.sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_the_old_offset_mode_key_still_builds_with_one_deprecation_line():
    torch.manual_seed(0)
    new = build_attention("slide", 12, 3, kernel_size=[3, 3, 3], offsets="shift")
    with pytest.warns(FutureWarning, match=r"^model.attention_options.offset_mode is deprecated; write "
                                           r"model.attention_options.offsets \(same values\)$"):
        old = build_attention("slide", 12, 3, kernel_size=[3, 3, 3], offset_mode="shift")
    assert old.offsets == new.offsets == "shift" and old.state_dict().keys() == new.state_dict().keys()
    with pytest.raises(UserError, match="gives both offset_mode and offsets"):
        build_attention("slide", 12, 3, offset_mode="shift", offsets="sample")
