"""Model adapters against the models themselves, on tiny random models of every family.

- `blocks` against the call order recorded by hooks on a real forward pass;
- `predict` against the transformer's output when the family's own diffusers pipeline calls it
  (the pipeline builds timesteps, RoPE, packing, guidance; the adapter must match it exactly);
- `token_grid` against the tokens each block actually receives;
- `attention_sites` against the self-attention modules that run over video tokens;
- the objectives against the schedulers that define them.
"""

import pytest
import torch
from torch import nn

from slidefusion.families import DIFFUSERS_CLASSES, TextConditioning, adapter_for, adapter_for_class
from slidefusion.errors import UserError
from slidefusion.testing.tiny import FAMILIES, TEXT_DIM, TINY, family_latent_thw, tiny_latents, tiny_model, tiny_text

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast")  # Mochi's RoPE asks for fp32 autocast


def _timesteps(adapter, batch=2):
    return torch.tensor([0.7, 0.3][:batch]) * adapter.objective.scale


def _run(family, batch=2, lengths=(5, 8)):
    model = tiny_model(family)
    adapter = adapter_for(model)
    x = tiny_latents(model, batch, family_latent_thw(family))
    text = tiny_text(model, batch, 8, lengths=list(lengths)[:batch])
    return model, adapter, x, text


def _expected_blocks(model):
    c = model.config
    if hasattr(c, "num_single_layers"):
        return c.num_layers + c.num_single_layers  # HunyuanVideo: dual-stream, then single-stream
    if type(model).__name__ == "LatteTransformer3DModel":
        return 2 * c.num_layers  # spatial and temporal
    if hasattr(c, "depth"):
        return c.depth * (2 if c.arch == "stdit" else 1)
    return c.num_layers


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_are_every_block_once_in_call_order(family):
    model, adapter, x, text = _run(family)
    blocks = adapter.blocks(model)
    order = []
    hooks = [b.register_forward_pre_hook(lambda m, a, i=i: order.append(i)) for i, b in enumerate(blocks)]
    with torch.no_grad():
        adapter.predict(model, x, _timesteps(adapter), text)
    for h in hooks:
        h.remove()
    assert order == list(range(len(blocks)))
    assert len({id(b) for b in blocks}) == len(blocks) == _expected_blocks(model)
    kinds = adapter.block_kinds(model)
    assert len(kinds) == len(blocks) and set(kinds) <= {"full", "spatial", "temporal"}
    if family in ("latte", "stdit"):
        assert kinds == ["spatial", "temporal"] * (len(blocks) // 2)


@pytest.mark.parametrize("family", FAMILIES)
def test_token_grid_is_what_every_block_processes(family):
    model, adapter, x, text = _run(family)
    grid = adapter.token_grid(model, x.shape)
    seen = []

    def record(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        seen.append(hidden.numel() // (x.shape[0] * hidden.shape[-1]))  # video tokens per sample

    hooks = [b.register_forward_pre_hook(record, with_kwargs=True) for b in adapter.blocks(model)]
    with torch.no_grad():
        adapter.predict(model, x, _timesteps(adapter), text)
    for h in hooks:
        h.remove()
    assert seen == [grid[0] * grid[1] * grid[2]] * len(seen)
    pt, ph, pw = adapter.patch_size(model)
    assert grid == (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)


def _attention_calls(model, adapter, x, text):
    """Every attention module inside the blocks, as the forward calls it: path -> list of
    (video tokens per sample, got text states, returned a (video, text) pair)."""
    from diffusers.models.attention import AttentionModuleMixin
    from diffusers.models.attention_processor import Attention, MochiAttention

    from slidefusion.attention import GridAttention

    kinds = (Attention, AttentionModuleMixin, MochiAttention, GridAttention)
    prefixes = {spec.attr for spec in adapter.block_lists}
    calls, hooks = {}, []

    def record(path):
        def hook(module, args, kwargs, out):
            hidden = kwargs.get("hidden_states", args[0] if args else None)
            context = kwargs.get("encoder_hidden_states", args[1] if len(args) > 1 else None)
            tokens = hidden.numel() // (x.shape[0] * hidden.shape[-1])
            calls.setdefault(path, []).append((tokens, context is not None, isinstance(out, tuple)))
        return hook

    for name, module in model.named_modules():
        if name.split(".")[0] in prefixes and isinstance(module, kinds):
            hooks.append(module.register_forward_hook(record(name), with_kwargs=True))
    with torch.no_grad():
        adapter.predict(model, x, _timesteps(adapter), text)
    for h in hooks:
        h.remove()
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_sites_are_the_self_attention_over_video_tokens(family):
    model, adapter, x, text = _run(family)
    sites = adapter.attention_sites(model)
    assert [s.block for s in sites] == list(range(len(adapter.blocks(model))))
    assert [s.kind for s in sites] == adapter.block_kinds(model)
    calls = _attention_calls(model, adapter, x, text)
    # Cross-attention always takes text states and returns video outputs only; self-attention takes
    # none, joint attention takes them and returns (video, text) outputs.
    self_attention = {path for path, seen in calls.items() if all(not ctx or pair for _, ctx, pair in seen)}
    assert {s.path for s in sites} == self_attention
    t, h, w = adapter.token_grid(model, x.shape)
    for site in sites:
        assert calls[site.path] == [(t * h * w, site.joint, site.joint)], site


# ---------------------------------------------------------------- predict against the pipelines
def _capture(model):
    calls = []

    def hook(module, args, kwargs, out):
        calls.append((args, dict(kwargs), out[0] if isinstance(out, tuple) else out.sample))

    return calls, model.register_forward_hook(hook, with_kwargs=True)


def _pipeline_run(family, model):
    """Run the family's diffusers pipeline for 2 steps on given prompt states; returns the
    TextConditioning that says the same and the adapter options the pipeline config implies."""
    import diffusers

    from slidefusion.testing.tiny import wan_scheduler

    g = torch.Generator().manual_seed(0)
    states = torch.randn(1, 8, TEXT_DIM, generator=g)
    mask = torch.arange(8)[None] < 6
    common = dict(prompt_embeds=states, height=48, width=80, num_inference_steps=2, guidance_scale=1.0,
                  output_type="latent", generator=g)
    none = dict(tokenizer=None, text_encoder=None, vae=None, transformer=model)
    if family.startswith("wan"):
        ti2v = family == "wan2.2-ti2v"
        diffusers.WanPipeline(**none, scheduler=wan_scheduler(), expand_timesteps=ti2v)(num_frames=5, **common)
        return TextConditioning(states), {"expand_timesteps": ti2v}
    if family.startswith("cogvideox"):
        scheduler = diffusers.CogVideoXDDIMScheduler(prediction_type="v_prediction")
        diffusers.CogVideoXPipeline(**none, scheduler=scheduler)(num_frames=13 if family == "cogvideox1.5" else 9, **common)
        return TextConditioning(states), {}
    if family == "hunyuanvideo":
        pooled = torch.randn(1, 8, generator=g)
        pipe = diffusers.HunyuanVideoPipeline(**none, tokenizer_2=None, text_encoder_2=None,
                                              scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0))
        pipe(pooled_prompt_embeds=pooled, prompt_attention_mask=mask, num_frames=5, **{**common, "guidance_scale": 3.5})
        return TextConditioning(states, mask, pooled, guidance=3.5), {}
    if family == "ltx":
        diffusers.LTXPipeline(**none, scheduler=diffusers.FlowMatchEulerDiscreteScheduler())(
            prompt_attention_mask=mask, num_frames=9, frame_rate=24, **{**common, "height": 192, "width": 320})
        return TextConditioning(states, mask), {"rope_interpolation_scale": (8 / 24, 32, 32)}
    if family == "mochi":
        diffusers.MochiPipeline(**none, scheduler=diffusers.FlowMatchEulerDiscreteScheduler(invert_sigmas=True))(
            prompt_attention_mask=mask, num_frames=7, **common)
        return TextConditioning(states, mask), {}
    assert family == "latte"
    diffusers.LattePipeline(**none, scheduler=diffusers.DDIMScheduler())(video_length=3, mask_feature=False, **common)
    return TextConditioning(states), {}


def _to_bcthw(adapter, model, kwargs, tensor):
    from diffusers import LTXPipeline

    if adapter.input_layout == "BTCHW":
        return tensor.transpose(1, 2)
    if adapter.input_layout == "packed":
        pt, ph, _ = adapter.patch_size(model)
        return LTXPipeline._unpack_latents(tensor, kwargs["num_frames"], kwargs["height"], kwargs["width"], ph, pt)
    return tensor


@pytest.mark.parametrize("family", list(TINY))
def test_predict_equals_the_transformer_as_its_pipeline_calls_it(family):
    model = tiny_model(family)
    calls, hook = _capture(model)
    text, options = _pipeline_run(family, model)
    hook.remove()
    adapter = adapter_for(model, **options)
    assert len(calls) == 2
    for args, kwargs, out in calls:  # both steps: two different timesteps
        latents = _to_bcthw(adapter, model, kwargs, kwargs["hidden_states"])
        timestep = kwargs["timestep"]
        if timestep.ndim == 2:  # Wan 2.2 TI2V: the pipeline's per-token timesteps, all equal
            assert torch.equal(timestep, timestep[:, :1].expand_as(timestep))
            timestep = timestep[:, 0]
        with torch.no_grad():
            raw = adapter.raw_output(model, latents, timestep, text)
            prediction = adapter.predict(model, latents, timestep, text)
        expected = _to_bcthw(adapter, model, kwargs, out)
        assert torch.equal(raw, expected)
        assert adapter.grid_from_call(model, args, kwargs) == adapter.token_grid(model, latents.shape)
        assert prediction.shape == latents.shape
        channels = latents.shape[1]
        assert torch.equal(prediction, expected[:, :channels])  # Latte: the learned-sigma half dropped
    assert calls[0][1]["timestep"].flatten()[0] != calls[1][1]["timestep"].flatten()[0]


@pytest.mark.parametrize("family", ["dit3d", "stdit"])
def test_predict_is_our_models_forward(family):
    model, adapter, x, text = _run(family)
    t = torch.tensor([0.9, 0.2])
    with torch.no_grad():
        assert torch.equal(adapter.predict(model, x, t, text), model(x, t, text.states, text.mask))
        assert adapter.token_grid(model, x.shape) == model.token_grid(x.shape)


def test_latte_predict_drops_the_learned_sigma_channels():
    model, adapter, x, text = _run("latte")
    t = _timesteps(adapter)
    with torch.no_grad():
        raw, prediction = adapter.raw_output(model, x, t, text), adapter.predict(model, x, t, text)
    assert raw.shape[1] == 2 * x.shape[1] and torch.equal(prediction, raw[:, : x.shape[1]])


def test_wan_text_padding_is_zeroed_like_the_pipeline():
    model, adapter, x, text = _run("wan", lengths=(3, 8))
    t = _timesteps(adapter)
    garbage = text.states.clone()
    garbage[0, 3:] = 1e3  # whatever sits past the prompt must not matter
    with torch.no_grad():
        a = adapter.predict(model, x, t, text)
        b = adapter.predict(model, x, t, TextConditioning(garbage, text.mask))
        zeros = text.states * text.mask[..., None]
        c = model(hidden_states=x, timestep=t, encoder_hidden_states=zeros, return_dict=False)[0]
    assert torch.equal(a, b) and torch.equal(a, c)


# ---------------------------------------------------------------- objectives against schedulers
def _data(shape=(2, 4, 2, 4, 4)):
    g = torch.Generator().manual_seed(3)
    return torch.randn(shape, generator=g, dtype=torch.float64), torch.randn(shape, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("class_name, invert", [("HunyuanVideoTransformer3DModel", False),
                                                ("LTXVideoTransformer3DModel", False),
                                                ("MochiTransformer3DModel", True)])
def test_flow_objective_is_an_exact_euler_step_of_the_scheduler(class_name, invert):
    from diffusers import FlowMatchEulerDiscreteScheduler

    objective = adapter_for_class(class_name).objective
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, invert_sigmas=invert)
    scheduler.set_timesteps(4)
    x0, noise = _data()
    for i in range(2):
        sigma = scheduler.sigmas[i].double()
        noise_level = 1 - sigma if invert else sigma  # Mochi's scheduler holds 1 - the noise level
        s, s_next = noise_level.expand(2), (1 - scheduler.sigmas[i + 1] if invert else scheduler.sigmas[i + 1]).double()
        assert torch.allclose(objective.model_timesteps(s.float()), scheduler.timesteps[i].expand(2))
        x_t = objective.noisy(x0, noise, s)
        stepped = scheduler.step(objective.target(x0, noise, s), scheduler.timesteps[i], x_t).prev_sample
        assert torch.allclose(stepped, objective.noisy(x0, noise, s_next.expand(2)), atol=1e-6)


def test_wan_objective_recovers_x0_through_unipc():
    from slidefusion.testing.tiny import wan_scheduler

    objective, scheduler = adapter_for_class("WanTransformer3DModel").objective, wan_scheduler()
    scheduler.set_timesteps(4)
    scheduler._init_step_index(scheduler.timesteps[1])
    sigma = scheduler.sigmas[1].double().expand(2)
    x0, noise = _data()
    x_t = objective.noisy(x0, noise, sigma)
    assert torch.allclose(scheduler.convert_model_output(objective.target(x0, noise, sigma), sample=x_t), x0)
    assert abs(float(objective.model_timesteps(sigma)[0]) - float(scheduler.timesteps[1])) <= 1  # int timesteps


@pytest.mark.parametrize("class_name", ["CogVideoXTransformer3DModel", "LatteTransformer3DModel"])
def test_ddpm_objectives_match_the_scheduler(class_name):
    from diffusers import CogVideoXDDIMScheduler, DDIMScheduler

    objective = adapter_for_class(class_name).objective
    scheduler = CogVideoXDDIMScheduler(prediction_type="v_prediction") if objective.kind == "v" else DDIMScheduler()
    x0, noise = _data()
    t = torch.tensor([900, 37])
    a = scheduler.alphas_cumprod.double()
    assert torch.allclose(objective.noisy(x0, noise, t, a), scheduler.add_noise(x0, noise, t))
    expected = scheduler.get_velocity(x0, noise, t) if objective.kind == "v" else noise
    assert torch.allclose(objective.target(x0, noise, t, a), expected)
    assert torch.equal(objective.model_timesteps(t), t)


def test_our_objective_is_slidefusion_flow():
    from slidefusion.diffusion.flow import interpolate

    objective = adapter_for(tiny_model("dit3d")).objective
    x0, noise = _data()
    t = torch.tensor([0.25, 0.75], dtype=torch.float64)
    assert torch.equal(objective.noisy(x0, noise, t), interpolate(x0, noise, t))
    assert torch.equal(objective.target(x0, noise, t), noise - x0) and torch.equal(objective.model_timesteps(t), t)


# ---------------------------------------------------------------- bad input
def _one_line(excinfo):
    assert "\n" not in str(excinfo.value)
    return str(excinfo.value)


def test_an_unknown_class_names_the_supported_ones():
    with pytest.raises(UserError) as excinfo:
        adapter_for(nn.Linear(2, 2))
    message = _one_line(excinfo)
    assert "Linear" in message and all(name in message for name in DIFFUSERS_CLASSES + ("DiT3D", "STDiT"))
    with pytest.raises(UserError, match="FluxTransformer2DModel"):
        adapter_for_class("FluxTransformer2DModel")


def test_a_subclass_finds_its_base_record():
    from diffusers import WanTransformer3DModel

    class MyWan(WanTransformer3DModel):
        pass

    assert adapter_for(MyWan(num_layers=1, num_attention_heads=1, attention_head_dim=8)).family == "wan"


@pytest.mark.parametrize("family, change, match", [
    ("wan", lambda x, t: (x[:, :3], t), r"latents must be \(B, 4, T, H, W\)"),
    ("wan", lambda x, t: (x[..., :7], t), "latent width=7 must be a positive multiple of .* patch size 2"),
    ("cogvideox1.5", lambda x, t: (x[:, :, :3], t), "latent frames=3 must be a positive multiple"),
    ("latte", lambda x, t: (x[:, :, :2], t), "latent frames=2 must be 1 or this Latte's video_length=3"),
    ("mochi", lambda x, t: (x, t[:1].expand(3)), r"timesteps must be a scalar or \(2,\)"),
    ("cogvideox1.5", lambda x, t: (torch.cat([x, x], dim=4), t), "latent grid 3x10 exceeds .* rotary table 8x8"),
    ("wan", lambda x, t: (torch.cat([x] * 7, dim=4), t), "latent grid 2x3x35 exceeds this Wan's rotary table"),
])
def test_bad_latents_and_timesteps_are_one_line_user_errors(family, change, match):
    model, adapter, x, text = _run(family)
    x, t = change(x, _timesteps(adapter))
    with pytest.raises(UserError, match=match) as excinfo:
        adapter.predict(model, x, t, text)
    _one_line(excinfo)


def test_bad_text_is_a_one_line_user_error():
    model, adapter, x, text = _run("hunyuanvideo")
    with pytest.raises(UserError, match="text.pooled is required") as excinfo:
        adapter.predict(model, x, _timesteps(adapter), TextConditioning(text.states, text.mask))
    _one_line(excinfo)
    with pytest.raises(UserError, match="prefix"):
        adapter.predict(model, x, _timesteps(adapter), TextConditioning(text.states, text.mask.flip(1), text.pooled))
    model, adapter, x, text = _run("cogvideox-sincos")
    with pytest.raises(UserError, match="max_text_seq_length=8"):
        adapter.predict(model, x, _timesteps(adapter), TextConditioning(text.states[:, :5]))
    with pytest.raises(UserError, match=r"text.mask must be None or \(2, 8\)"):
        TextConditioning(text.states, torch.ones(2, 7, dtype=torch.bool))
    with pytest.raises(UserError, match="must be a slidefusion.families.TextConditioning"):
        adapter.predict(model, x, _timesteps(adapter), text.states)
    with pytest.raises(UserError, match=r"adapter option\(s\) \['shift'\] unknown .*valid: \['expand_timesteps'\]"):
        adapter_for(tiny_model("wan"), shift=3.0)
