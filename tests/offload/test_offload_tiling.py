"""Tiled blocks equal whole blocks (outputs and every gradient), each declared halo is exact and one
frame less is not, and training tiled (engine or resident) equals training whole."""

import copy
import dataclasses

import pytest
import torch
from torch import nn

from slidefusion.attention import GridAttention, build_attention
from slidefusion.attention.functional import dense_attention
from slidefusion.errors import UserError
from slidefusion.models import build_model, preset
from slidefusion.models.dit import FrameAttention, TimeAttention
from slidefusion.models.layers import DiTBlock
from slidefusion.offload import OffloadEngine, OffloadPolicy
from slidefusion.offload.tiling.tile_runner import TiledBlock, tile_blocks, untile_blocks
from slidefusion.optim import OptimConfig

C, GRID = 16, (7, 3, 4)  # 7 frames: no tile size below it but 1 and 7 divides it
ATTENTIONS = {
    "dense": ("dense", 0, {}),
    "window": ("window", 0, {"window_size": (2, 2, 3)}),  # H=3, W=4: padded on both
    "window shifted": ("window", 1, {"window_size": (2, 2, 3)}),
    "neighborhood": ("neighborhood", 0, {"kernel_size": (3, 3, 3)}),
    "slide": ("slide", 0, {"kernel_size": (3, 3, 3)}),
    "slide shift, wide": ("slide", 0, {"kernel_size": (5, 3, 3), "offsets": "shift", "max_offset": 1.5}),
}


def _awake(module: nn.Module, scale: float = 0.3, offsets: float = 3.0) -> nn.Module:
    """Random weights everywhere (adaLN-Zero and the offset head start at zero); by default slide
    offsets pushed to their bounds, so sample points reach past the window's edge frames."""
    torch.manual_seed(0)
    with torch.no_grad():
        for param in module.parameters():
            param.add_(scale * torch.randn_like(param))
        for sub in module.modules():
            if hasattr(sub, "offset_linear"):
                sub.offset_linear.weight.normal_(0, offsets)
                sub.offset_linear.bias.normal_(0, offsets)
    return module


def _block(attention: str) -> DiTBlock:
    name, index, options = ATTENTIONS[attention]
    return _awake(DiTBlock(C, 2, 2.0, build_attention(name, C, 2, block_index=index, **options)))


def _inputs(grid=GRID, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, *grid, C, generator=g, requires_grad=True)
    c = torch.randn(2, C, generator=g, requires_grad=True)
    context = torch.randn(2, 5, C, generator=g, requires_grad=True)
    mask = torch.tensor([[True, True, True, False, False], [True] * 5])
    return (x, c, context, mask), torch.randn(2, *grid, C, generator=g)


def _whole(block, args, grad_out):
    weights = list(block.parameters())
    out = block(*args)
    grads = torch.autograd.grad(out, [*args[:3], *weights], grad_out, allow_unused=True)
    return [out, *grads]


def _tiled(block, args, grad_out, frames):
    runner, weights = TiledBlock(frames), list(block.parameters())
    with torch.no_grad():
        out = runner.forward(block, None, args, {})
    inputs, weight_grads = runner.grads(block, None, args, {}, [grad_out], weights)
    assert inputs[3] is None  # the mask
    return [out, *inputs[:3], *weight_grads]


def _error(got: list, expected: list) -> float:
    """Largest error of any output or gradient, relative to that tensor's largest value."""
    errors = [0.0 if e is None and g is None else ((g - e).abs().max() / e.abs().max()).item() for g, e in zip(got, expected)]
    return max(errors)


@pytest.mark.parametrize("attention", list(ATTENTIONS))
@pytest.mark.parametrize("frames", [1, 3])  # 1-frame tiles (halos wider than a tile), a size that does not divide T
def test_a_tiled_block_equals_the_whole_block(attention, frames):
    block = _block(attention)
    args, grad_out = _inputs()
    assert _error(_tiled(block, args, grad_out, frames), _whole(block, args, grad_out)) <= 1e-5


@pytest.mark.parametrize("attention", ["slide", "slide shift, wide"])
def test_slide_offsets_get_their_gradients_tiled(attention):
    """The offset head's gradients are not zero, and tiled equals whole on them too."""
    block = _block(attention)
    args, grad_out = _inputs()
    names = [name for name, _ in block.named_parameters()]
    expected, got = _whole(block, args, grad_out)[4:], _tiled(block, args, grad_out, 2)[4:]
    for name in ("attn.offset_linear.weight", "attn.offset_linear.bias"):
        i = names.index(name)
        assert expected[i].abs().max() > 1e-3
        assert ((got[i] - expected[i]).abs().max() / expected[i].abs().max()).item() <= 1e-5


@pytest.mark.parametrize("attention", [a for a in ATTENTIONS if a != "dense"])
def test_one_frame_less_halo_breaks_the_result(attention):
    """The derived halos are tight: each is needed, at 1-frame tiles (the grid's edges)."""
    block = _block(attention)
    args, grad_out = _inputs()
    expected = _whole(block, args, grad_out)
    rule = block.attn.tile_rule(GRID)
    assert _error(_tiled(block, args, grad_out, 1), expected) <= 1e-5
    block.attn.tile_rule = lambda grid: dataclasses.replace(rule, halo=rule.halo - 1)
    assert _error(_tiled(block, args, grad_out, 1), expected) > 1e-3
    if rule.align > 1:  # window attention: the context must also start on a window boundary
        block.attn.tile_rule = lambda grid: dataclasses.replace(rule, align=1)
        assert _error(_tiled(block, args, grad_out, 1), expected) > 1e-3


@pytest.mark.parametrize("inner", ["slide", "dense"])
def test_stdit_spatial_and_temporal_blocks_tile(inner):
    """Frame attention tiles frames (no halo); attention through time tiles rows, every frame."""
    spatial = build_attention(inner, C, 2, **({"kernel_size": (1, 3, 3)} if inner == "slide" else {}))
    for attn in (FrameAttention(spatial), TimeAttention(build_attention("dense", C, 2))):
        block = _awake(DiTBlock(C, 2, 2.0, attn))
        args, grad_out = _inputs()
        expected = _whole(block, args, grad_out)
        for frames in (1, 3):
            assert _error(_tiled(block, args, grad_out, frames), expected) <= 1e-5


def test_a_tile_larger_than_the_clip_is_clamped_with_a_note():
    block = _block("slide")
    args, grad_out = _inputs()
    with pytest.warns(UserWarning, match="offload.tile=9 frames is more than the clip's 7: clamped"):
        assert _error(_tiled(block, args, grad_out, 9), _whole(block, args, grad_out)) == 0.0


# -- training --------------------------------------------------------------------------------------

# Tiling changes summation orders, so gradients agree to rounding, not bitwise. At eps=1e-8 AdamW's
# first update is the gradient's sign, and an element that is zero up to rounding flips it by a
# whole lr; eps=0.1 keeps the update smooth in the gradient, so rounding stays rounding.
LR, EPS = 3e-3, 0.1


def _model(arch: str, attention: str = "slide") -> nn.Module:
    options = {"kernel_size": (3, 3, 3)} if attention == "slide" else {}
    config = preset(f"{arch}-tiny", depth=2, text_dim=8, attention=attention, attention_options=options)
    torch.manual_seed(0)
    return _awake(build_model(config), scale=0.05, offsets=0.5)  # a trainable regime (loss ~2), offsets at +-0.4


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2, 3, 5, 4, 6, generator=g)  # tokens 5 x 2 x 3
    out = model(x, torch.rand(2, generator=g), torch.randn(2, 4, 8, generator=g))
    return (out - x.flip(0)).pow(2).mean()


def _train(model, steps, engine=None):
    optimizer = None if engine else torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS, weight_decay=0.0, fused=True)
    losses = []
    for step in range(steps):
        if engine:
            losses.append(engine.train_step(lambda m, s=step: _loss(m, s)))
            continue
        optimizer.zero_grad()
        loss = _loss(model, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _assert_close(got: dict, expected: dict):
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-5 * value.abs().max().item(), msg=name)


@pytest.mark.parametrize("arch, attention, frames", [("dit3d", "slide", 2), ("dit3d", "dense", 1), ("stdit", "slide", 2)])
def test_offloaded_training_with_tiles_equals_resident_training(arch, attention, frames):
    model = _model(arch, attention)
    reference = copy.deepcopy(model)
    policy = OffloadPolicy(device="cpu", compute_dtype=torch.float32, zero_copy=False, tile=frames,
                           optim=OptimConfig(lr=LR, eps=EPS, max_grad_norm=None, warmup_steps=0, ema_decay=None))
    engine = OffloadEngine(model, model.blocks, policy)
    losses = _train(model, 3, engine)
    torch.testing.assert_close(losses, _train(reference, 3), rtol=1e-5, atol=0)
    _assert_close(engine.model_state_dict(), reference.state_dict())
    engine.close()


def test_a_resident_model_trains_tiled_without_the_engine():
    model = _model("dit3d")
    reference = copy.deepcopy(model)
    tile_blocks(model, 1)
    losses = _train(model, 3)
    torch.testing.assert_close(losses, _train(reference, 3), rtol=1e-5, atol=0)
    _assert_close(model.state_dict(), reference.state_dict())
    with torch.no_grad():  # no graph: the tiled forward alone
        torch.testing.assert_close(_loss(model, 7), _loss(reference, 7), rtol=1e-5, atol=0)
    untile_blocks(model)
    assert all("forward" not in block.__dict__ for block in model.blocks)


class _Unknown(GridAttention):  # an operator that does not declare its halo
    def attend(self, q, k, v):
        return dense_attention(q, k, v)


def test_bad_tiling_input_is_one_line():
    optim = OptimConfig(lr=LR, max_grad_norm=None, warmup_steps=0, ema_decay=None)
    for tile in (0, -2, 1.5, True):
        with pytest.raises(UserError, match=r"tile=.* must be a number of frames >= 1"):
            OffloadPolicy(device="cpu", tile=tile, optim=optim)
    with pytest.raises(UserError, match="needs checkpoint=True"):
        OffloadPolicy(device="cpu", tile=2, checkpoint=False, optim=optim)
    model = _model("dit3d")
    model.blocks[1].attn = _Unknown(model.config.hidden, model.config.heads)
    with pytest.raises(UserError, match=r"offload.tile=2: block 1 \(DiTBlock\) has no self-attention that declares its halo"):
        OffloadEngine(model, model.blocks, OffloadPolicy(device="cpu", tile=2, optim=optim))
    with pytest.raises(UserError, match=r"tile=2: block 1 .* declares its halo"):
        tile_blocks(model, 2)
