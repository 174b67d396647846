import pytest
import torch

from slidefusion.errors import UserError
from slidefusion.models import PRESETS, DiT3D, STDiT, build_model, preset
from slidefusion.models.layers import sincos_3d, unpatchify


def _inputs(config, shape, batch=2, text_len=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, config.in_channels, *shape, generator=g)
    context = torch.randn(batch, text_len, config.text_dim, generator=g)
    mask = torch.ones(batch, text_len, dtype=torch.bool)
    mask[1, 3:] = False
    return x, torch.rand(batch, generator=g), context, mask


@pytest.mark.parametrize("name", ["dit3d-tiny", "stdit-tiny"])
@pytest.mark.parametrize("attention", ["dense", "window"])
@pytest.mark.parametrize("shape", [(1, 2, 2), (3, 6, 10), (5, 4, 14)])
def test_output_shape_on_odd_sizes(name, attention, shape):
    config = preset(name, attention=attention)
    model = build_model(config)
    x, t, context, mask = _inputs(config, shape)
    assert model(x, t, context, mask).shape == x.shape


def test_tiny_presets_are_small_and_blocks_are_a_module_list():
    for name in ("dit3d-tiny", "stdit-tiny"):
        model = build_model(preset(name))
        assert sum(p.numel() for p in model.parameters()) < 1_000_000
        assert isinstance(model.blocks, torch.nn.ModuleList)
    stdit = build_model(preset("stdit-tiny"))
    assert [b.kind for b in stdit.blocks] == ["spatial", "temporal"] * preset("stdit-tiny").depth
    assert isinstance(build_model(preset("dit3d-tiny")), DiT3D) and isinstance(stdit, STDiT)


@pytest.mark.parametrize("name, billions", [("dit3d-1b", 1.0), ("dit3d-28b", 28.0), ("dit3d-105b", 105.0)])
def test_paper_scale_presets_build_on_meta(name, billions):
    model = build_model(preset(name), device="meta")
    count = sum(p.numel() for p in model.parameters())
    assert abs(count / 1e9 - billions) / billions < 0.05
    assert all(p.is_meta for p in model.parameters())


def test_zero_init_makes_the_untrained_model_predict_zero():
    # adaLN-Zero and the zero final layer: every block starts as the identity, output is exactly 0.
    config = preset("dit3d-tiny")
    model = build_model(config)
    x, t, context, mask = _inputs(config, (2, 4, 4))
    assert torch.count_nonzero(model(x, t, context, mask)) == 0


def _perturb(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def test_text_mask_hides_padding_tokens():
    config = preset("dit3d-tiny")
    model = _perturb(build_model(config))
    x, t, context, mask = _inputs(config, (2, 4, 4))
    changed = context.clone()
    changed[1, 3:] += 5.0  # only masked-out tokens of sample 1
    out, out2 = model(x, t, context, mask), model(x, t, changed, mask)
    torch.testing.assert_close(out, out2)
    changed[1, 0] += 5.0  # a real token must matter
    assert not torch.allclose(out[1], model(x, t, changed, mask)[1])


def test_stdit_spatial_blocks_do_not_mix_frames():
    # With the temporal blocks removed, changing frame 0 must leave frame 2's output unchanged.
    config = preset("stdit-tiny")
    model = _perturb(build_model(config))
    model.blocks = torch.nn.ModuleList(b for b in model.blocks if b.kind == "spatial")
    x, t, context, mask = _inputs(config, (3, 4, 4))
    y = x.clone()
    y[:, :, 0] += 1.0
    torch.testing.assert_close(model(x, t, context, mask)[:, :, 2], model(y, t, context, mask)[:, :, 2])


def test_size_not_divisible_by_patch_names_the_axis():
    config = preset("dit3d-tiny", patch_size=(2, 2, 2))
    model = build_model(config)
    x, t, context, mask = _inputs(config, (3, 4, 4))
    with pytest.raises(UserError, match="frames=3 must be a positive multiple of DiT3D.s patch size 2"):
        model(x, t, context, mask)


def test_bad_config_is_a_user_error():
    with pytest.raises(UserError, match="model.hidden=30 must be divisible by model.heads=4"):
        preset("dit3d-tiny", hidden=30, heads=4)
    with pytest.raises(UserError, match="unknown"):
        preset("no-such-model")
    with pytest.raises(UserError, match="attention='nope' is unknown"):
        build_model(preset("dit3d-tiny", attention="nope"))


def test_unpatchify_inverts_the_patch_layout():
    x = torch.randn(2, 3, 4, 6, 8)
    p = (2, 3, 2)
    patches = x.view(2, 3, 2, 2, 2, 3, 4, 2).permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(2, 2, 2, 4, -1)
    torch.testing.assert_close(unpatchify(patches, p, 3), x)


def test_sincos_positions_distinguish_every_token():
    pos = sincos_3d((3, 5, 7), 48).reshape(-1, 48)
    assert pos.shape == (105, 48)
    assert torch.cdist(pos, pos).add(torch.eye(105) * 10).min() > 1e-3
    assert set(PRESETS) >= {"dit3d-tiny", "stdit-tiny", "dit3d-1b", "dit3d-28b", "dit3d-105b"}


def test_pooled_text_is_off_by_default_and_starts_as_the_model_without_it():
    plain = preset("dit3d-tiny")
    assert not plain.pooled_text and not any("text_pool" in k for k in build_model(plain).state_dict())
    pooled = preset("dit3d-tiny", pooled_text=True)
    base = _perturb(build_model(plain))
    model = build_model(pooled)
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert not unexpected and missing and all(k.startswith("text_pool.") for k in missing)
    x, t, context, mask = _inputs(pooled, (2, 4, 4))
    torch.testing.assert_close(model(x, t, context, mask), base(x, t, context, mask))  # zero-init last layer
    _perturb(model.text_pool)
    assert not torch.allclose(model(x, t, context, mask), base(x, t, context, mask))


@pytest.mark.parametrize("name", ["dit3d-tiny", "stdit-tiny"])
def test_pooled_text_reads_only_real_tokens_and_infers_padding_without_a_mask(name):
    config = preset(name, pooled_text=True)
    model = _perturb(build_model(config))
    x, t, context, mask = _inputs(config, (2, 4, 4))
    context[1, 3:] = 0.0  # padding is zero, as the text encoders return it
    out = model(x, t, context, mask)
    _, c, _ = model.embed(x, t, context, mask)
    torch.testing.assert_close(model.embed(x, t, context)[1], c)  # without a mask: padding found from the zeros
    shorter = model(x[1:], t[1:], context[1:, :3], mask[1:, :3])
    torch.testing.assert_close(shorter, out[1:], rtol=1e-4, atol=1e-4)  # padding length does not matter
    changed = context.clone()
    changed[1, 0] += 1.0
    assert not torch.allclose(model.embed(x, t, changed, mask)[1][1], c[1])  # a real token matters


def test_pooled_text_must_be_a_bool():
    with pytest.raises(UserError, match="model.pooled_text='yes' must be true or false"):
        preset("dit3d-tiny", pooled_text="yes")
