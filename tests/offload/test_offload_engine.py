"""Offloaded vs resident training: every parameter and loss, with and without injected delays."""

import copy

import pytest
import torch
from torch import nn

from slidefusion.core.errors import UserError
from slidefusion.models import build_model, preset
from slidefusion.offload import OffloadEngine, OffloadPolicy, engine_plan, require_fit
from slidefusion.optim import OptimConfig
from slidefusion.testing.delays import inject_delays

LR, WD = 3e-3, 0.1


def _dit(arch: str) -> nn.Module:
    torch.manual_seed(0)
    model = build_model(preset(f"{arch}-tiny", depth=3 if arch == "dit3d" else 2, text_dim=16))
    with torch.no_grad():  # adaLN-Zero starts every block as the identity: wake them up
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model


def _wan() -> nn.Module:
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
                                 out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32)


MODELS = {"dit3d": lambda: _dit("dit3d"), "stdit": lambda: _dit("stdit"), "wan": _wan}


def _loss(kind: str, model: nn.Module, step: int) -> torch.Tensor:
    """A regression loss on a batch that is a function of the step alone."""
    g = torch.Generator().manual_seed(step)
    channels = 4 if kind == "wan" else 3
    x = torch.randn(2, channels, 2, 4, 4, generator=g)
    context = torch.randn(2, 5, 16, generator=g)
    if kind == "wan":
        out = model(x, torch.randint(0, 1000, (2,), generator=g), context, return_dict=False)[0]
    else:
        out = model(x, torch.rand(2, generator=g), context)
    return (out - x.flip(0)).pow(2).mean()


def _resident(kind, model, steps, max_grad_norm=None, autocast=False):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, fused=True)
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = _loss(kind, model, step)
        loss.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


def _policy(compute_dtype=torch.float32, max_grad_norm=None, **options) -> OffloadPolicy:
    optim = OptimConfig(lr=LR, weight_decay=WD, max_grad_norm=max_grad_norm, warmup_steps=0, ema_decay=None)
    options.setdefault("zero_copy", False)  # the copy threads of a real device, where races could hide
    return OffloadPolicy(device="cpu", compute_dtype=compute_dtype, optim=optim, **options)


def _engine(model, **options):
    return OffloadEngine(model, model.blocks, _policy(**options))


def _offloaded(kind, engine, steps, first=0):
    return [engine.train_step(lambda m, s=step: _loss(kind, m, s)) for step in range(first, first + steps)]


def _assert_same(engine, reference: nn.Module, rtol=1e-5):
    weights = engine.model_state_dict()
    expected = reference.state_dict()
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=rtol, atol=rtol * value.abs().max().item(), msg=name)


@pytest.mark.parametrize("kind", ["dit3d", "stdit", "wan"])
def test_offloaded_training_equals_resident_adamw(kind):
    model = MODELS[kind]()
    reference = copy.deepcopy(model)
    engine = _engine(model)
    losses = _offloaded(kind, engine, 20)
    expected, _ = _resident(kind, reference, 20)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    _assert_same(engine, reference)
    engine.close()


@pytest.mark.parametrize("kind, prefetch, checkpoint", [("dit3d", 1, True), ("wan", 2, True), ("stdit", 0, True),
                                                        ("dit3d", 1, False)])
def test_random_delays_in_transfers_and_optimizer_change_nothing(kind, prefetch, checkpoint):
    model = MODELS[kind]()
    reference = copy.deepcopy(model)
    engine = _engine(model, prefetch=prefetch, checkpoint=checkpoint)
    inject_delays(engine, 0.002, seed=prefetch)
    losses = _offloaded(kind, engine, 20)
    expected, _ = _resident(kind, reference, 20)
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    _assert_same(engine, reference)


@pytest.mark.parametrize("delays", [0.0, 0.002])
def test_clipped_training_equals_clip_grad_norm_then_adamw(delays):
    model = MODELS["dit3d"]()
    reference = copy.deepcopy(model)
    engine = _engine(model, max_grad_norm=0.05)
    inject_delays(engine, delays, seed=3)
    losses = _offloaded("dit3d", engine, 20)
    expected, norms = _resident("dit3d", reference, 20, max_grad_norm=0.05)
    assert sum(n > 0.05 for n in norms) >= 10  # clipping is active on most steps
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    _assert_same(engine, reference)


def test_bf16_compute_tracks_a_bf16_autocast_resident_run():
    model = MODELS["dit3d"]()
    reference = copy.deepcopy(model)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = _engine(model, compute_dtype=torch.bfloat16)
    losses = _offloaded("dit3d", engine, 8)
    expected, _ = _resident("dit3d", reference, 8, autocast=True)
    torch.testing.assert_close(losses, expected, rtol=3e-2, atol=0)
    # bf16 rounding flips the sign of a few near-zero Adam updates, so single elements may part by
    # up to 2 * steps * lr; in aggregate the two runs must move together, far closer than they moved.
    weights = engine.model_state_dict()
    moved = sum((value - initial[name]).abs().sum().item() for name, value in reference.state_dict().items())
    apart = sum((weights[name] - value).abs().sum().item() for name, value in reference.state_dict().items())
    assert apart <= 0.05 * moved, (apart, moved)  # measured: about 0.01
    for name, value in reference.state_dict().items():
        assert (weights[name] - value).abs().max().item() <= 2 * 8 * LR + 2e-2 * value.abs().max().item(), name


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_peak_device_parameter_bytes_stay_within_the_pool(prefetch):
    model = MODELS["dit3d"]()
    block_bytes = max(sum(p.numel() for p in block.parameters()) for block in model.blocks) * 4
    resident = (sum(p.numel() for p in model.parameters()) * 4 - sum(
        sum(p.numel() for p in block.parameters()) * 4 for block in model.blocks))
    engine = _engine(model, prefetch=prefetch)
    _offloaded("dit3d", engine, 2)
    peak = engine.stats.peak_device_param_bytes
    assert resident + block_bytes <= peak <= (prefetch + 1) * block_bytes + resident
    assert engine.stats.h2d_bytes > 0 and engine.stats.d2h_bytes > 0


def test_resumed_engine_repeats_the_loss_sequence():
    engine = _engine(MODELS["wan"](), max_grad_norm=1.0)
    head = _offloaded("wan", engine, 5)
    state = engine.state_dict()
    tail = _offloaded("wan", engine, 5, first=5)
    fresh = _wan()
    with torch.no_grad():
        for param in fresh.parameters():
            param.mul_(-1)  # different weights: everything must come from the state
    resumed = _engine(fresh, max_grad_norm=1.0)
    resumed.load_state_dict(state)
    assert _offloaded("wan", resumed, 5, first=5) == tail
    assert head != tail[:5]


class _Shared(nn.Module):
    def __init__(self, tie_rest=False):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.blocks[1].weight = self.blocks[0].weight
        if tie_rest:
            self.blocks[1] = nn.Linear(4, 4)
            self.head = nn.Linear(4, 4)
            self.head.weight = self.blocks[0].weight


def test_bad_inputs_are_one_line_user_errors():
    model = MODELS["dit3d"]()
    with pytest.raises(UserError, match="blocks must be a non-empty list of the model's blocks"):
        OffloadEngine(model, nn.ModuleList(), _policy())
    with pytest.raises(UserError, match="blocks must be a non-empty list of the model's blocks"):
        OffloadEngine(model, model, _policy())
    with pytest.raises(UserError, match=r"blocks\[0\] is not a submodule of model"):
        OffloadEngine(_Shared(), _Shared().blocks, _policy())
    shared = _Shared()
    with pytest.raises(UserError, match=r"blocks.1.weight is shared between blocks.0 and blocks.1"):
        OffloadEngine(shared, shared.blocks, _policy())
    tied = _Shared(tie_rest=True)
    with pytest.raises(UserError, match="head.weight is shared between blocks.0 and the rest"):
        OffloadEngine(tied, tied.blocks, _policy())
    with pytest.raises(UserError, match="prefetch=-1 must be an int >= 0"):
        _policy(prefetch=-1)
    with pytest.raises(UserError, match=r"does not fit: device needs .* but has 1 KB \(largest parts:"):
        require_fit(engine_plan(model, model.blocks, _policy(), device_memory="1KB"))
    with pytest.raises(UserError, match="does not fit: host needs"):
        require_fit(engine_plan(model, model.blocks, _policy(), host_memory=1000))
    with pytest.raises(UserError, match="device='tpu' is unsupported"):
        OffloadPolicy(device="tpu")


def test_blocks_run_out_of_order_is_a_user_error():
    model = MODELS["dit3d"]()
    engine = _engine(model)
    model.blocks[0].forward  # noqa: B018 - the hook is in place

    def backwards(m):
        x = torch.zeros(1, 2, 2, 32)
        for block in reversed(m.blocks):
            x = block(x, torch.zeros(1, 32), torch.zeros(1, 3, 32), None)
        return x.sum()

    with pytest.raises(UserError, match="block 2 ran at position 0"):
        engine.train_step(backwards)


def test_a_parameter_without_gradient_is_a_user_error():
    model = MODELS["dit3d"]()
    engine = _engine(model)

    def blocks_only(m):  # the embeddings and the head take no part: no gradient reaches them
        x = torch.randn(1, 2, 2, 2, 32)
        for block in m.blocks:
            x = block(x, torch.randn(1, 32), torch.randn(1, 3, 32), None)
        return x.square().mean()

    with pytest.raises(UserError, match=r"parameter patch_embed.weight got no gradient from loss_fn"):
        engine.train_step(blocks_only)
