import torch

from slidefusion.diffusion import FlowConfig, flow_loss, interpolate, sample, sample_timesteps, timestep_schedule
from slidefusion.models import build_model, preset


def test_interpolation_endpoints_and_loss_of_the_exact_velocity():
    x0, noise = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    torch.testing.assert_close(interpolate(x0, noise, torch.zeros(3)), x0)
    torch.testing.assert_close(interpolate(x0, noise, torch.ones(3)), noise)
    # An oracle that knows the noise drawn from the same generator has zero loss.
    config = FlowConfig()
    g = torch.Generator().manual_seed(0)
    t = sample_timesteps(3, config, g)
    drawn = torch.randn(x0.shape, generator=g)
    oracle = lambda x, t_: drawn - x0  # noqa: E731
    assert flow_loss(oracle, x0, config, torch.Generator().manual_seed(0)).item() == 0.0
    assert flow_loss(lambda x, t_: torch.zeros_like(x), x0, config, torch.Generator().manual_seed(0)) > 0.5
    assert ((t > 0) & (t < 1)).all()


def test_logit_normal_timesteps_have_the_right_median():
    t = sample_timesteps(20000, FlowConfig(logit_mean=1.0), torch.Generator().manual_seed(0))
    assert abs(t.median().item() - torch.sigmoid(torch.tensor(1.0)).item()) < 0.01


def test_schedule_runs_from_noise_to_data():
    times = timestep_schedule(4)
    assert times[0] == 1.0 and times[-1] == 0.0 and (times.diff() < 0).all()
    assert (timestep_schedule(4, shift=3.0)[1:-1] > times[1:-1]).all()


def test_euler_integrates_a_constant_velocity_exactly():
    class Constant(torch.nn.Module):
        def forward(self, x, t, context, mask):
            return torch.full_like(x, 2.0)

    cond = (torch.zeros(1, 1, 4), torch.ones(1, 1, dtype=torch.bool))
    x = sample(Constant(), (1, 2, 3), cond, steps=5, seed=3, progress=False)
    noise = torch.randn((1, 2, 3), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(x, noise - 2.0)


def test_guidance_combines_conditional_and_unconditional():
    class TextIsVelocity(torch.nn.Module):
        def forward(self, x, t, context, mask):
            return context[:, 0, 0].view(-1, 1, 1) * torch.ones_like(x)

    cond = (torch.full((1, 2, 1), 3.0), torch.ones(1, 2, dtype=torch.bool))
    uncond = (torch.full((1, 1, 1), 1.0), torch.ones(1, 1, dtype=torch.bool))  # shorter: padded inside
    x = sample(TextIsVelocity(), (1, 2, 2), cond, uncond, steps=1, guidance=2.0, seed=0, progress=False)
    noise = torch.randn((1, 2, 2), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(x, noise - (1.0 + 2.0 * (3.0 - 1.0)))


def test_same_seed_same_video_bit_for_bit():
    torch.manual_seed(0)
    model = build_model(preset("dit3d-tiny"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    cond = (torch.randn(1, 4, 384), torch.ones(1, 4, dtype=torch.bool))
    uncond = (torch.randn(1, 2, 384), torch.ones(1, 2, dtype=torch.bool))
    run = lambda seed: sample(model, (1, 3, 2, 4, 4), cond, uncond, steps=3, seed=seed, progress=False)  # noqa: E731
    a, b = run(7), run(7)
    assert torch.equal(a, b)
    assert not torch.equal(a, run(8))


def test_direction_contrast_is_flow_loss_plus_the_hinge_on_rows_with_a_negative():
    from slidefusion.diffusion import contrastive_flow_loss

    x0 = torch.randn(3, 3, 2, 4, 4)
    config = FlowConfig(direction_contrast=2.0, contrast_margin=0.5)
    # The "model" reads the caption half from the batch row: rows 3..5 (negatives) predict worse by 0.25 on row 3.
    offsets = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.0, 0.0]).view(-1, 1, 1, 1, 1)
    velocity = lambda x, t: x * 0.5 + t.view(-1, 1, 1, 1, 1) + offsets  # noqa: E731
    plain = flow_loss(lambda x, t: x * 0.5 + t.view(-1, 1, 1, 1, 1), x0, config, torch.Generator().manual_seed(1))
    none = torch.zeros(3, dtype=torch.bool)
    assert torch.allclose(contrastive_flow_loss(velocity, x0, none, config, torch.Generator().manual_seed(1)), plain)
    # Rows 0 and 1 have negatives: row 0's negative errs by a constant 0.5 more (0.25 added to its
    # mean squared error plus the cross term), row 1's not at all, so its hinge is the whole margin.
    g = torch.Generator().manual_seed(1)
    t = sample_timesteps(3, config, g)
    noise = torch.randn(x0.shape, generator=g)
    x_t, target = interpolate(x0, noise, t), noise - x0
    base = x_t * 0.5 + t.view(-1, 1, 1, 1, 1)
    true = ((base - target) ** 2).flatten(1).mean(1)
    shifted = ((base + 0.5 - target) ** 2).flatten(1).mean(1)
    hinge = torch.relu(0.5 - (shifted[0] - true[0])) + 0.5
    expected = true.mean() + 2.0 * hinge / 2
    got = contrastive_flow_loss(velocity, x0, torch.tensor([True, True, False]), config, torch.Generator().manual_seed(1))
    assert torch.allclose(got, expected)
    assert got > plain  # the hinge is active: the negatives are not yet worse by the margin
    # Above every t drawn, no row is contrasted: the plain loss again.
    late = FlowConfig(direction_contrast=2.0, contrast_margin=0.5, contrast_min_t=float(t.max()) + 1e-6)
    rows = torch.tensor([True, True, True])
    assert torch.allclose(contrastive_flow_loss(velocity, x0, rows, late, torch.Generator().manual_seed(1)), plain)


def test_direction_contrast_settings_are_checked():
    import pytest

    from slidefusion.core.errors import UserError

    with pytest.raises(UserError, match=r"diffusion.direction_contrast=-1 must be in \[0, 100\]"):
        FlowConfig(direction_contrast=-1)
    with pytest.raises(UserError, match=r"diffusion.contrast_margin=0 must be in \(0, 10\]"):
        FlowConfig(contrast_margin=0)
    with pytest.raises(UserError, match=r"diffusion.contrast_min_t=1 must be in \[0, 1\)"):
        FlowConfig(contrast_min_t=1)
