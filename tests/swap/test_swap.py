"""`use_slide_attention` on tiny random models of every covered family.

- stock vs swapped: a window covering the grid with zero offsets computes what the stock model does
  (fp32, 1e-5), a smaller window does not, and `remove` gives the stock output back bitwise;
- the layout: in a one-layer model a perturbed token changes exactly the outputs whose window
  holds it (so the token order, the text side of joint blocks and the batch rows are right);
- a swapped model trains its offsets, resident and on the offload engine (equal to each other);
- torch.compile traces a swapped model in one graph;
- bad input is one UserError line.
"""

import pytest
import torch

from slidefusion import restore_attention, use_slide_attention
from slidefusion.families import adapter_for
from slidefusion.errors import UserError
from slidefusion.testing.tiny import family_latent_thw, tiny_latents, tiny_model, tiny_text

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")  # Mochi's RoPE asks for fp32 autocast

# family -> offsets mode it is tested with (every mode is zero at the start)
COVERED = {"wan": "sample", "latte": "sample", "cogvideox": "shift", "cogvideox1.5": "sample",
           "hunyuanvideo": "sample", "mochi": "shift", "ltx": None, "dit3d": "sample", "stdit": "shift"}


def _case(family, seed=0):
    model = tiny_model(family, seed)
    adapter = adapter_for(model)
    x = tiny_latents(model, 2, family_latent_thw(family))
    t = torch.tensor([0.7, 0.3]) * adapter.objective.scale
    text = tiny_text(model, 2, 8, lengths=[5, 8])  # a padded prompt: the joint models mask it
    return model, adapter, lambda m: adapter.predict(m, x, t, text)


@pytest.mark.parametrize("family", list(COVERED))
def test_swap_equals_stock_when_the_window_covers_the_grid(family):
    model, adapter, predict = _case(family)
    keys, hooks = set(model.state_dict()), len(model._forward_pre_hooks)
    with torch.no_grad():
        stock = predict(model)
        # 11 covers every tiny grid (at most 2..4 x 6 x 10 tokens): clamped, each axis is attended whole
        handle = use_slide_attention(model, kernel_size=11, offsets=COVERED[family], temporal="slide")
        assert handle.paths == [s.path for s in adapter.attention_sites(model)]
        whole = predict(model)
        handle.remove()
        use_slide_attention(model, kernel_size=(1, 3, 3), offsets=COVERED[family], temporal="slide")
        local = predict(model)
        restore_attention(model)
        back = predict(model)
    assert (whole - stock).abs().max() <= 1e-5 * max(1.0, stock.abs().max())
    assert (local - stock).abs().max() > 1e-2  # the swapped path runs
    assert torch.equal(back, stock)
    assert set(model.state_dict()) == keys and len(model._forward_pre_hooks) == hooks


# One layer each: attention is then the only way one video token's input reaches another's output.
ONE_LAYER = {"wan": dict(num_layers=1), "cogvideox": dict(num_layers=1), "cogvideox1.5": dict(num_layers=1),
             "hunyuanvideo": dict(num_layers=1, num_single_layers=0), "mochi": dict(num_layers=1),
             "ltx": dict(num_layers=1), "latte": dict(num_layers=1), "dit3d": dict(depth=1), "stdit": dict(depth=1)}


def _window_holds(j: int, i: int, k: int, n: int) -> bool:
    """Does query i's window (NATTEN's border rule) on an axis of n tokens hold key j?"""
    start = min(max(i - k // 2, 0), n - k)
    return start <= j < start + k


@pytest.mark.parametrize("family", list(ONE_LAYER))
def test_a_token_reaches_exactly_the_queries_whose_window_holds_it(family):
    # Layout check (token order, text side, batch rows): a (1, 1, 3) window along W only; Latte's and
    # STDiT's temporal blocks stay dense, so there a token also reaches every frame.
    model = tiny_model(family, **ONE_LAYER[family])
    adapter = adapter_for(model)
    x = tiny_latents(model, 2, family_latent_thw(family))
    t, text = torch.tensor([0.7, 0.3]) * adapter.objective.scale, tiny_text(model, 2, 8, lengths=[5, 8])
    use_slide_attention(model, kernel_size=(1, 1, 3))
    grid, (pt, ph, pw) = adapter.token_grid(model, x.shape), adapter.patch_size(model)
    t0, h0, w0 = (n // 2 for n in grid)
    y = x.clone()
    y[0, :, t0 * pt:(t0 + 1) * pt, h0 * ph:(h0 + 1) * ph, w0 * pw:(w0 + 1) * pw] += 1.0
    with torch.no_grad():
        change = (adapter.predict(model, y, t, text) - adapter.predict(model, x, t, text)).abs()
    b, c = change.shape[:2]
    reached = change.reshape(b, c, grid[0], pt, grid[1], ph, grid[2], pw).amax(dim=(1, 3, 5, 7)) > 1e-6
    every_frame = family in ("latte", "stdit")
    expected = torch.zeros_like(reached)
    for ti in range(grid[0]):
        for wi in range(grid[2]):
            expected[0, ti, h0, wi] = (every_frame or ti == t0) and _window_holds(w0, wi, 3, grid[2])
    assert torch.equal(reached, expected)
    restore_attention(model)


def test_latte_temporal_blocks_stay_dense_by_default():
    model, adapter, predict = _case("latte")
    handle = use_slide_attention(model, kernel_size=(3, 3, 3))
    sites = adapter.attention_sites(model)
    assert handle.paths == [s.path for s in sites if s.kind == "spatial"]
    for site in sites:
        processor = type(model.get_submodule(site.path).processor).__name__
        assert processor == ("SlideAttnProcessor2_0" if site.kind == "spatial" else "AttnProcessor2_0")
    kernel = model.get_submodule(sites[0].path).slide_offsets.kernel_size
    assert kernel == (1, 3, 3)  # a 2D window in each frame
    handle.remove()


def test_a_swapped_dit3d_reads_like_one_built_with_slide_attention():
    from slidefusion.models import build_model, preset

    model = tiny_model("dit3d")
    use_slide_attention(model, kernel_size=(3, 5, 5))
    built = build_model(preset("dit3d-tiny", attention="slide", attention_options={"kernel_size": [3, 5, 5]}))
    ours, theirs = model.state_dict(), built.state_dict()
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    restore_attention(model)


# ---------------------------------------------------------------- training the offsets
def _wan_loss(model, step):
    adapter = adapter_for(model)
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2, 4, 2, 6, 10, generator=g)
    text = tiny_text(model, 2, 8, seed=step)
    return (adapter.predict(model, x, torch.tensor([700.0, 300.0]), text) - x.flip(0)).pow(2).mean()


def _swapped_wan():
    model = tiny_model("wan").train()
    use_slide_attention(model, kernel_size=(1, 3, 3), offsets="sample")
    return model


def _offsets(model):
    return {n: p.detach().clone() for n, p in model.named_parameters() if ".slide_offsets." in n}


def test_training_moves_the_offsets_resident_and_offloaded_alike():
    from slidefusion.offload import OffloadEngine, OffloadPolicy
    from slidefusion.optim import OptimConfig

    resident, offloaded = _swapped_wan(), _swapped_wan()
    start = _offsets(resident)
    assert len(start) == 2 * 4 and all(not v.any() for n, v in start.items() if "offset_linear" in n)
    optimizer = torch.optim.AdamW(resident.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    losses = []
    for step in range(2):
        optimizer.zero_grad()
        loss = _wan_loss(resident, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    moved = _offsets(resident)
    assert all(not torch.equal(moved[n], start[n]) for n in start)

    # The offsets are block parameters: the engine streams them and its host AdamW updates them.
    optim = OptimConfig(lr=1e-2, weight_decay=0.0, warmup_steps=0, ema_decay=None)
    policy = OffloadPolicy(device="cpu", compute_dtype=torch.float32, optim=optim)
    engine = OffloadEngine(offloaded, adapter_for(offloaded).blocks(offloaded), policy)
    engine_losses = [engine.train_step(lambda m, s=step: _wan_loss(m, s)) for step in range(2)]
    weights = engine.model_state_dict()
    engine.close()
    # Not bitwise: the engine's gradients of a stock tiny Wan already differ from resident ones
    # by float rounding (1e-7), which Adam's first steps amplify.
    assert engine_losses[0] == losses[0] and engine_losses[1] == pytest.approx(losses[1], rel=1e-5)
    assert all(not torch.equal(weights[name], start[name]) for name in start)


# ---------------------------------------------------------------- torch.compile
def test_torch_compile_traces_a_swapped_model_in_one_graph():
    torch._dynamo.reset()
    model, adapter, predict = _case("wan")
    use_slide_attention(model, kernel_size=(1, 3, 3))
    with torch.no_grad():
        eager = predict(model)
        compiled = predict(torch.compile(model, backend="aot_eager", fullgraph=True))
    assert torch.allclose(compiled, eager, atol=1e-5)
    restore_attention(model)
    torch._dynamo.reset()


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize("model, options, message", [
    (torch.nn.Linear(2, 2), {}, "model class 'Linear' is not supported; supported: DiT3D"),
    ("wan", {"kernel_size": (2, 3, 3)}, "kernel_size must be odd and >= 1"),
    ("wan", {"kernel_size": 0}, "kernel_size must be odd and >= 1"),
    ("wan", {"kernel_size": (3, -1, 3)}, "kernel_size must be odd and >= 1"),
    ("wan", {"kernel_size": (3, 3)}, "kernel_size must be 3 ints"),
    ("wan", {"offsets": "learned"}, "offsets='learned' is unknown; valid: sample, shift, None"),
    ("wan", {"temporal": "window"}, "temporal='window' is unknown; valid: dense, slide"),
    ("wan", {"max_offset": 0}, "max_offset=0 must be a finite number > 0"),
    ("wan", {"backend": "cuda"}, "backend='cuda' is unknown"),
])
def test_bad_input_is_one_user_error_line(model, options, message):
    model = tiny_model(model) if isinstance(model, str) else model
    with pytest.raises(UserError, match=message) as error:
        use_slide_attention(model, **options)
    assert "\n" not in str(error.value)
    assert not any(type(m.processor).__name__.startswith("Slide") for m in model.modules() if hasattr(m, "processor"))


def test_swapping_twice_or_restoring_a_stock_model_is_a_user_error():
    model = tiny_model("wan")
    with pytest.raises(UserError, match="does not use swapped slide attention"):
        restore_attention(model)
    use_slide_attention(model)
    with pytest.raises(UserError, match="already uses slide attention; call restore_attention"):
        use_slide_attention(model)
    restore_attention(model)


def test_a_window_larger_than_the_grid_is_clamped_to_it():
    model, adapter, predict = _case("wan")  # token grid 2 x 3 x 5
    with torch.no_grad():
        handle = use_slide_attention(model, kernel_size=(3, 3, 9))
        clamped = predict(model)
        handle.remove()
        use_slide_attention(model, kernel_size=(3, 3, 5))
        exact = predict(model)
    restore_attention(model)
    assert torch.equal(clamped, exact)


def test_the_old_offset_mode_key_configures_the_same_swap_with_one_deprecation_line():
    from slidefusion.swap import configured_options

    with pytest.warns(FutureWarning, match="model.attention_options.offset_mode is deprecated"):
        old = configured_options("slide", {"offset_mode": "shift", "kernel_size": 3})
    assert old == configured_options("slide", {"offsets": "shift", "kernel_size": 3})
