"""The engine on a real GPU (copy streams, events, page-locked memory): skipped where CUDA is not available."""

import copy
import warnings

import pytest
import torch

from slidefusion.models import build_model, preset
from slidefusion.offload import OffloadEngine, OffloadPolicy
from slidefusion.optim import OptimConfig
from slidefusion.testing.delays import inject_delays

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    x, t, context = torch.randn(2, 3, 2, 8, 8, generator=g), torch.rand(2, generator=g), torch.randn(2, 5, 16, generator=g)
    x, t, context = x.cuda(), t.cuda(), context.cuda()
    return (model(x, t, context) - x.flip(0)).pow(2).mean()


def _model():
    torch.manual_seed(0)
    model = build_model(preset("dit3d-tiny", depth=4, text_dim=16))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model


def _engine(model, max_grad_norm=None, **options):
    optim = OptimConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=max_grad_norm, warmup_steps=0, ema_decay=None)
    return OffloadEngine(model, model.blocks, OffloadPolicy(device="cuda", optim=optim, **{"compute_dtype": torch.float32, **options}))


@pytest.mark.parametrize("delays, max_grad_norm, resident_blocks", [(0.0, None, 0), (0.002, None, 0), (0.002, 0.05, 0),
                                                                    (0.002, None, 2), (0.002, 0.05, 4)])
def test_cuda_engine_tracks_resident_adamw(delays, max_grad_norm, resident_blocks):
    model = _model()
    reference = copy.deepcopy(model).cuda()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
    engine = _engine(model, max_grad_norm, resident_blocks=resident_blocks)
    inject_delays(engine, delays, seed=1)
    for step in range(20):
        optimizer.zero_grad()
        loss = _loss(reference, step)
        loss.backward()
        if max_grad_norm:
            torch.nn.utils.clip_grad_norm_(reference.parameters(), max_grad_norm)
        optimizer.step()
        assert engine.train_step(lambda m, s=step: _loss(m, s)) == pytest.approx(loss.item(), rel=1e-4)
    weights = engine.model_state_dict()
    for name, value in reference.state_dict().items():
        error = (weights[name].cuda() - value).norm() / value.norm().clamp_min(1e-12)
        assert error < 1e-3, name  # GPU kernels are not bitwise reproducible across graphs
    block = max(sum(p.numel() for p in b.parameters()) for b in model.blocks) * 4
    assert engine.stats.peak_device_param_bytes <= (2 + resident_blocks) * block + sum(p.numel() for p in model.parameters()) * 4
    assert engine.stats.pinned_bytes > 0 and engine.stats.pageable_copy_bytes == 0
    engine.close()


@pytest.mark.parametrize("master, moments", [("bf16", "int8"), ("fp32", "bf16")])
def test_cuda_lean_state_tracks_the_fp32_engine(master, moments):
    fp32_model, lean_model = _model(), _model()
    fp32, lean = _engine(fp32_model, compute_dtype=torch.bfloat16), _engine(lean_model, compute_dtype=torch.bfloat16,
                                                                           master=master, moments=moments)
    expected = [fp32.train_step(lambda m, s=s: _loss(m, s)) for s in range(20)]
    got = [lean.train_step(lambda m, s=s: _loss(m, s)) for s in range(20)]
    assert got[-1] == pytest.approx(expected[-1], rel=0.03) and got[-1] < got[0]
    assert lean.stats.host_bytes_per_param < fp32.stats.host_bytes_per_param


def test_cuda_pin_budget_zero_is_pageable_and_the_same_run():
    pinned_model, pageable_model = _model(), _model()
    pinned = _engine(pinned_model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pageable = _engine(pageable_model, pin_budget=0)
    assert len(caught) == 1 and "pin_budget" in str(caught[0].message)
    assert pageable.stats.pinned_bytes == 0 and pageable.stats.pageable_copy_bytes > 0
    for step in range(5):
        assert pinned.train_step(lambda m, s=step: _loss(m, s)) == pytest.approx(
            pageable.train_step(lambda m, s=step: _loss(m, s)), rel=1e-5)


@pytest.mark.parametrize("tile, spill", [(1, False), (1, True), (None, True)])
def test_cuda_tiles_and_spill_track_whole_blocks(tmp_path, tile, spill):
    """Tiled blocks and spilled checkpoints on the device against whole blocks with checkpoints kept
    (issue 12): the same losses and weights within GPU rounding; spilled bytes go to disk and back."""
    def loss(model, step):
        g = torch.Generator().manual_seed(step)
        x, t, context = torch.randn(2, 3, 5, 16, 16, generator=g), torch.rand(2, generator=g), torch.randn(2, 5, 16, generator=g)
        return (model(x.cuda(), t.cuda(), context.cuda()) - x.cuda().flip(0)).pow(2).mean()

    torch.manual_seed(0)
    model = build_model(preset("dit3d-tiny", depth=3, text_dim=16, attention="slide", attention_options={"kernel_size": (3, 3, 3)}))
    reference = _engine(copy.deepcopy(model))
    engine = _engine(model, tile=tile, **({"spill_dir": str(tmp_path), "spill_after": 0} if spill else {}))
    for step in range(3):
        assert engine.train_step(lambda m, s=step: loss(m, s)) == pytest.approx(
            reference.train_step(lambda m, s=step: loss(m, s)), rel=1e-4)
    got, expected = engine.model_state_dict(), reference.model_state_dict()
    for name, value in expected.items():
        assert (got[name] - value).norm() <= 1e-4 * value.norm().clamp_min(1e-12), name
    if spill:
        assert engine.checkpoints.bytes_written > 0 and engine.checkpoints.bytes_read > 0
    engine.close()
    reference.close()
