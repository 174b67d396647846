"""Autoencoders: identity, and the diffusers adapter on a tiny randomly initialised AutoencoderKLWan."""

import os

import pytest
import torch

from slidefusion.core.errors import UserError
from slidefusion.vae import DiffusersVideoAutoencoder, IdentityAutoencoder, build_autoencoder
from slidefusion.vae.base import latent_normalisation, video_vae_factors

os.environ["HF_HUB_OFFLINE"] = "1"

# Wan 2.1's topology (3 spatial levels, temporal downsampling in the last two) at 8 base channels:
# ~0.2 M parameters, factors 4 (time) and 8 (space), tens of milliseconds per call on one core.
TINY_WAN = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                temperal_downsample=[False, True, True],
                latents_mean=[0.1, -0.2, 0.3, 0.0], latents_std=[1.5, 0.5, 2.0, 1.0])


def video(*shape, seed=0):
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


@pytest.fixture(scope="module")
def tiny_wan():
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    return AutoencoderKLWan(**TINY_WAN).eval()


@pytest.fixture(scope="module")
def wrapped(tiny_wan):
    return DiffusersVideoAutoencoder(tiny_wan)


# ---------------------------------------------------------------- identity

def test_identity_round_trip():
    ae = build_autoencoder("identity")
    assert isinstance(ae, IdentityAutoencoder)
    x = video(2, 3, 7, 9, 11)
    assert ae.latent_shape(7, 9, 11) == (3, 7, 9, 11)
    assert torch.equal(ae.encode(x), x) and torch.equal(ae.decode(ae.encode(x)), x)
    assert ae.decode(torch.full((1, 3, 1, 2, 2), 3.0)).max() == 1.0


# ---------------------------------------------------------------- diffusers Wan

def test_wan_factors_and_frozen(wrapped):
    assert (wrapped.latent_channels, wrapped.temporal_factor, wrapped.spatial_factor) == (4, 4, 8)
    assert all(not p.requires_grad for p in wrapped.parameters())
    wrapped.train()
    assert not any(m.training for m in wrapped.modules())


@pytest.mark.parametrize("frames,height,width,expected",
                         [(5, 16, 16, (4, 2, 2, 2)), (9, 32, 24, (4, 3, 4, 3)), (1, 8, 8, (4, 1, 1, 1))])
def test_wan_encode_shape_matches_latent_shape(wrapped, frames, height, width, expected):
    assert wrapped.latent_shape(frames, height, width) == expected  # Wan: T' = 1 + (T - 1) / 4
    z = wrapped.encode(video(2, 3, frames, height, width))
    assert z.shape == (2, *expected) and z.dtype == torch.float32


def test_wan_decode_shape_and_range(wrapped):
    out = wrapped.decode(wrapped.encode(video(2, 3, 5, 16, 16)))
    assert out.shape == (2, 3, 5, 16, 16) and out.dtype == torch.float32
    assert out.min() >= -1 and out.max() <= 1


def test_wan_normalisation_applied_and_inverted(tiny_wan, wrapped):
    x = video(1, 3, 5, 16, 16)
    with torch.no_grad():
        raw = tiny_wan.encode(x).latent_dist.mean
        direct = tiny_wan.decode(raw).sample
    mean = torch.tensor(TINY_WAN["latents_mean"]).view(1, -1, 1, 1, 1)
    std = torch.tensor(TINY_WAN["latents_std"]).view(1, -1, 1, 1, 1)
    z = wrapped.encode(x)
    torch.testing.assert_close(z, (raw - mean) / std)
    torch.testing.assert_close(wrapped.decode(z), direct, atol=1e-5, rtol=1e-5)


def test_wan_posterior_sample_with_generator(wrapped):
    x = video(1, 3, 5, 16, 16)
    a = wrapped.encode(x, generator=torch.Generator().manual_seed(1))
    b = wrapped.encode(x, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.allclose(a, wrapped.encode(x))


def test_bad_sizes_are_user_errors(wrapped):
    with pytest.raises(UserError, match=r"frames=6 .*1 \+ 4k"):
        wrapped.latent_shape(6, 16, 16)
    with pytest.raises(UserError, match=r"height=20 .*multiples of 8"):
        wrapped.latent_shape(5, 20, 16)
    with pytest.raises(UserError, match="frames=4"):
        wrapped.encode(video(1, 3, 4, 16, 16))  # Wan itself would silently drop the last 3 frames
    with pytest.raises(UserError, match=r"\(B, 3, T, H, W\)"):
        wrapped.encode(video(1, 4, 5, 16, 16))


def test_factors_come_from_the_architecture():
    from diffusers import AutoencoderKLWan

    # Two spatial levels; the config's scale_factor_spatial keeps its default 8, which is wrong here.
    vae = AutoencoderKLWan(**{**TINY_WAN, "dim_mult": [1, 1, 1], "temperal_downsample": [True, True]})
    ae = DiffusersVideoAutoencoder(vae)
    assert (ae.temporal_factor, ae.spatial_factor) == (4, 4)
    assert ae.encode(video(1, 3, 5, 16, 16)).shape == (1, *ae.latent_shape(5, 16, 16)) == (1, 4, 2, 4, 4)


@pytest.mark.parametrize("config,expected", [
    (dict(dim_mult=[1, 2, 4, 4], temperal_downsample=[False, True, True], patch_size=2), (4, 16)),  # Wan 2.2
    (dict(dim_mult=[1, 1], temperal_downsample=[True, False]), (2, 2)),
    (dict(temporal_compression_ratio=4, spatial_compression_ratio=8), (4, 8)),  # HunyuanVideo
    (dict(temporal_compression_ratio=4, block_out_channels=[128, 256, 256, 512]), (4, 8)),  # CogVideoX
    (dict(), (None, None)),
])
def test_video_vae_factors(config, expected):
    assert video_vae_factors(config) == expected


def test_scaling_factor_normalisation():
    shift, scale = latent_normalisation(dict(scaling_factor=0.5, shift_factor=0.1), channels=3)
    assert shift.tolist() == pytest.approx([0.1] * 3) and scale.tolist() == [0.5] * 3
    with pytest.raises(UserError, match="latents_mean"):
        latent_normalisation(dict(latents_mean=[0.0] * 16, latents_std=[1.0] * 16), channels=4)


def test_build_from_local_folder(tmp_path, tiny_wan, wrapped):
    tiny_wan.save_pretrained(tmp_path / "pipe" / "vae")
    x = video(1, 3, 5, 16, 16)
    for path in (tmp_path / "pipe" / "vae", tmp_path / "pipe"):  # a VAE folder, or a pipeline folder
        ae = build_autoencoder(str(path))
        assert isinstance(ae, DiffusersVideoAutoencoder)
        torch.testing.assert_close(ae.encode(x), wrapped.encode(x))


def test_unknown_vae_is_user_error(tmp_path):
    for name in (str(tmp_path / "missing"), str(tmp_path), "no-such-org/no-such-vae"):
        with pytest.raises(UserError, match=r"vae=.*not available offline.*'identity'"):
            build_autoencoder(name)
    with pytest.raises(UserError, match="'identity'"):
        build_autoencoder("")
