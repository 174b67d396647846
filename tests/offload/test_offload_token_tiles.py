"""Diffusers blocks on packed tokens tiled along frames (`offload.tile`, `tile_blocks`): Wan 2.1, Wan
2.2 TI2V (per-token timestep modulation) and LTX-Video (per-sample and per-token timesteps), forward
and checkpointed backward equal to whole blocks within 1e-5 in float32 on awkward tiles (1 frame; 2
of 5 frames, not dividing), the self-attention really sees tiles, the offload engine trains tiled as
resident training does, and what cannot be tiled is refused in one line."""

import copy
from functools import partial

import pytest
import torch

from slidefusion.families import adapter_for
from slidefusion.core.errors import UserError
from slidefusion.offload import OffloadEngine, OffloadPolicy
from slidefusion.offload.tiling.tile_runner import tile_blocks, untile_blocks
from slidefusion.offload import engine_blocks
from slidefusion.optim import OptimConfig
from slidefusion.swap import use_slide_attention
from slidefusion.testing.tiny import tiny_latents, tiny_model, tiny_text

# case -> (tiny family, adapter options, one timestep per token); tokens per frame: Wan patches 1x2x2, LTX 1x1x1
CASES = {"wan": ("wan", {}, False), "wan2.2-ti2v": ("wan2.2-ti2v", {"expand_timesteps": True}, False),
         "ltx": ("ltx", {}, False), "ltx, per-token timesteps": ("ltx", {}, True)}
THW, PER_FRAME = (5, 4, 6), {"wan": 2 * 3, "wan2.2-ti2v": 2 * 3, "ltx": 4 * 6}


def _model(case: str):
    return tiny_model(CASES[case][0]).train()


def _loss(model, case: str, step: int = 0, batch: int = 2) -> torch.Tensor:
    _, options, per_token = CASES[case]
    adapter = adapter_for(model, **options)
    x = tiny_latents(model, batch, THW, seed=step)
    t = torch.tensor([300.0, 700.0])[:batch] + 10 * step
    if per_token:  # LTX's image-to-video conditioning passes (B, N) timesteps
        t = t[:, None] + torch.arange(adapter.tokens(model, x.shape)) / 10
    return (adapter.predict(model, x, t, tiny_text(model, batch, seed=step)) - x.flip(0)).pow(2).mean()


def _grads(model, case: str, batch: int = 2) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = _loss(model, case, batch=batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _error(got: dict, expected: dict) -> float:
    """Largest error of any gradient, relative to that gradient's largest value."""
    assert got.keys() == expected.keys()
    return max(((got[n] - e).abs().max() / e.abs().max().clamp_min(1e-30)).item() for n, e in expected.items())


def _tokens_seen(module, args, kwargs, seen: list) -> None:
    seen.append((args[0] if args else kwargs["hidden_states"]).shape[1])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("frames", [1, 2])
def test_tiled_blocks_equal_whole_blocks(case, frames):
    model = _model(case)
    loss, grads = _grads(copy.deepcopy(model), case)
    seen = []  # the tokens each self-attention call received
    for site in adapter_for(model).attention_sites(model):
        model.get_submodule(site.path).register_forward_pre_hook(partial(_tokens_seen, seen=seen), with_kwargs=True)
    tile_blocks(model, frames)
    tiled_loss, tiled = _grads(model, case)
    assert max(seen) == frames * PER_FRAME[CASES[case][0]]  # tiles, not the clip's 5 frames
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=0)
    assert _error(tiled, grads) <= 1e-5
    with torch.no_grad():  # the tiled forward alone, no graph
        torch.testing.assert_close(_loss(model, case), loss, rtol=1e-6, atol=0)
    untile_blocks(model)
    assert all("forward" not in block.__dict__ for block in adapter_for(model).blocks(model))
    assert not model._forward_pre_hooks


@pytest.mark.parametrize("case", list(CASES))
def test_tiled_blocks_equal_whole_blocks_at_batch_one(case):
    """At batch 1 autograd hands Wan's modulation table and temb one gradient tensor (an add of
    equal shapes): the per-tile sums must copy it, not add into it twice."""
    model = _model(case)
    loss, grads = _grads(copy.deepcopy(model), case, batch=1)
    tile_blocks(model, 2)
    tiled_loss, tiled = _grads(model, case, batch=1)
    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=0)
    assert _error(tiled, grads) <= 1e-5


@pytest.mark.parametrize("case", ["wan", "wan2.2-ti2v", "ltx"])
def test_offloaded_training_with_tiles_equals_resident_training(case):
    model = _model(case)
    reference = copy.deepcopy(model)
    optim = OptimConfig(lr=3e-3, eps=0.1, max_grad_norm=None, warmup_steps=0, ema_decay=None)  # eps: see test_offload_tiling
    engine = OffloadEngine(model, engine_blocks(model), OffloadPolicy(device="cpu", compute_dtype=torch.float32,
                                                                      zero_copy=False, tile=2, optim=optim))
    optimizer = torch.optim.AdamW(reference.parameters(), lr=3e-3, eps=0.1, weight_decay=0.0, fused=True)
    for step in range(2):
        loss = engine.train_step(lambda m, s=step: _loss(m, case, s))
        optimizer.zero_grad()
        expected = _loss(reference, case, step)
        expected.backward()
        optimizer.step()
        assert loss == pytest.approx(expected.item(), rel=1e-5)
    state = engine.model_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-5 * value.abs().max().item(), msg=name)
    engine.close()
    assert not model._forward_pre_hooks  # the grid hook went with the engine


def test_what_cannot_be_tiled_is_refused_in_one_line():
    optim = OptimConfig(lr=1e-3, max_grad_norm=None, warmup_steps=0, ema_decay=None)
    cog = tiny_model("cogvideox")
    with pytest.raises(UserError, match=r"^offload.tile=2: CogVideoXTransformer3DModel's blocks are not declared "
                                        r"tileable \(tileable: .*WanTransformer3DModel.*\); use offload.tile=off$"):
        OffloadEngine(cog, engine_blocks(cog), OffloadPolicy(device="cpu", tile=2, optim=optim))
    wan = tiny_model("wan")
    use_slide_attention(wan, kernel_size=3)
    with pytest.raises(UserError, match=r"^tile=1: blocks.0.attn1 runs SlideWanAttnProcessor; tiling "
                                        r"WanTransformer3DModel's blocks needs its stock WanAttnProcessor"):
        tile_blocks(wan, 1)
    assert all("forward" not in block.__dict__ for block in wan.blocks)
