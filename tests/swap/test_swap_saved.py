"""A swapped diffusers model through save and load, and against a subset of diffusers' own Wan model
tests (tests/models/transformers/test_models_transformer_wan.py and the shared ModelTesterMixin:
save/load round trip, output shape, determinism, NaN propagation from inf LoRA weights, gradient
flow), each run on the stock and on the swapped model. The offset network is built for the clamped
window."""

import pytest
import torch
from diffusers import WanTransformer3DModel
from safetensors.torch import load_file

from slidefusion.swap import restore_attention, use_slide_attention
from slidefusion.swap.persist import CONFIG_KEY, NOTE
from slidefusion.testing.tiny import TINY, tiny_latents, tiny_model, tiny_text

KERNEL = (3, 3, 5)  # smaller than the (2, 3, 5) token grid below on no axis but time: the window matters


def _inputs(model):
    text = tiny_text(model, batch=1)
    return dict(hidden_states=tiny_latents(model, batch=1, thw=(2, 6, 10)), timestep=torch.tensor([500.0]),
                encoder_hidden_states=text.states, return_dict=False)


def _run(model, inputs):
    with torch.no_grad():
        return model(**inputs)[0]


def _swapped(seed: int = 0, **options):
    """A tiny Wan with slide attention whose offset networks hold non-zero ("trained") weights."""
    model = tiny_model("wan", seed)
    handle = use_slide_attention(model, kernel_size=KERNEL, **options)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".slide_offsets." in name:
                param.add_(torch.randn(param.shape, generator=generator) * 0.3)
    return model, handle


def _offset_count(model) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if ".slide_offsets." in n)


# ---------------------------------------------------------------- save and load
def test_save_pretrained_after_a_swap_restores_with_its_trained_offsets(tmp_path):
    from slidefusion.pretrained import load_transformer

    model, handle = _swapped()
    inputs = _inputs(model)
    expected = _run(model, inputs)
    assert (expected - _run(tiny_model("wan"), inputs)).abs().max() > 1e-3  # the offsets change the output
    model.save_pretrained(tmp_path)
    assert any(".slide_offsets." in k for k in load_file(tmp_path / "diffusion_pytorch_model.safetensors"))

    restored = WanTransformer3DModel.from_pretrained(tmp_path)
    use_slide_attention(restored, from_pretrained=tmp_path)
    assert torch.equal(_run(restored, inputs), expected)
    assert torch.equal(_run(load_transformer(tmp_path), inputs), expected)  # slidefusion's loader, one step

    handle.remove()  # the stock model again, and its config without the swap
    assert CONFIG_KEY not in model.config
    assert torch.equal(_run(model, inputs), _run(tiny_model("wan"), inputs))


def test_plain_diffusers_warns_that_the_offsets_are_absent_and_runs_stock_attention(tmp_path):
    import logging

    model, _ = _swapped()
    model.save_pretrained(tmp_path)
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("diffusers")  # diffusers' own loggers sit under it
    logger.addHandler(handler)
    try:
        loaded = WanTransformer3DModel.from_pretrained(tmp_path)
    finally:
        logger.removeHandler(handler)
    err = "\n".join(records)
    # What diffusers says, exactly: the swap's config entry (our note inside) and the offset weights are ignored.
    assert f"The config attributes {{'{CONFIG_KEY}'" in err and NOTE in err, err
    assert "were not used when initializing WanTransformer3DModel" in err and "slide_offsets" in err
    inputs = _inputs(model)
    assert torch.equal(_run(loaded, inputs), _run(tiny_model("wan"), inputs))  # the stock dense model


def test_a_slide_fine_tune_saved_as_a_pipeline_samples_as_its_checkpoint(tiny_wan_dir, tmp_path):
    from safetensors.torch import load_file as read

    from slidefusion.cli import main
    from slidefusion.pipeline import VideoPipeline
    from slidefusion.testing.pipelines import PIXELS

    frames, height, width = PIXELS["wan"]
    sizes = [f"data.frames={frames}", f"data.height={height}", f"data.width={width}"]
    assert main(["train", "configs/wan-finetune.yaml", f"model.pretrained={tiny_wan_dir}", "data.kind=shapes",
                 "data.num_samples=2", *sizes, "run.device=cpu", "run.steps=1", "run.batch_size=2",
                 f"run.output_dir={tmp_path}", "run.name=slide", "optim.lr=1e-2", "optim.warmup_steps=0",
                 "model.attention=slide", "model.attention_options={kernel_size: [3, 3, 3]}", "--quiet"]) == 0
    VideoPipeline.from_checkpoint(tmp_path / "slide").save_pretrained(tmp_path / "saved")
    sample = ["--prompt", "a red circle", "--steps", "2", "--seed", "1", "--quiet", "--frames", str(frames),
              "--height", str(height), "--width", str(width)]
    latents = {}
    for name, source in (("run", ["--checkpoint", str(tmp_path / "slide")]),
                         ("saved", ["--pretrained", str(tmp_path / "saved")])):
        path = tmp_path / f"{name}.safetensors"
        assert main(["generate", *source, *sample, "--out", str(tmp_path / f"{name}.gif"), "--save-latents",
                     str(path)]) == 0
        latents[name] = read(path)["latents"]
    assert torch.equal(latents["saved"], latents["run"])


# ---------------------------------------------------------------- diffusers' tests, stock and swapped
@pytest.fixture(params=["stock", "swapped"])
def subject(request):
    return tiny_model("wan") if request.param == "stock" else _swapped()[0]


def test_output_has_the_input_shape(subject):
    inputs = _inputs(subject)
    assert _run(subject, inputs).shape == inputs["hidden_states"].shape


def test_determinism(subject):
    inputs = _inputs(subject)
    assert torch.equal(_run(subject, inputs), _run(subject, inputs))


def test_save_load_round_trip(subject, tmp_path):
    from slidefusion.pretrained import load_transformer

    inputs = _inputs(subject)
    subject.save_pretrained(tmp_path)
    assert (_run(load_transformer(tmp_path), inputs) - _run(subject, inputs)).abs().max() <= 5e-5


def test_inf_lora_weights_propagate_nan_without_raising(subject):
    """diffusers' test_lora_fuse_nan: an inf in one LoRA weight makes every output NaN."""
    from peft import LoraConfig, inject_adapter_in_model

    inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"]), subject)
    with torch.no_grad():
        subject.blocks[0].attn1.to_q.lora_A["default"].weight.fill_(float("inf"))
        subject.blocks[0].attn1.to_q.lora_B["default"].weight.fill_(1.0)
    assert torch.isnan(_run(subject, _inputs(subject))).all()


def test_gradients_reach_every_trainable_weight(subject):
    subject.train()
    inputs = _inputs(subject)
    out = subject(**inputs)[0]
    torch.nn.functional.mse_loss(out, torch.randn_like(out)).backward()
    missing = [n for n, p in subject.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing[:5]
    offsets = [p.grad for n, p in subject.named_parameters() if n.endswith("slide_offsets.offset_linear.weight")]
    assert all(g.abs().sum() > 0 and torch.isfinite(g).all() for g in offsets)


# ---------------------------------------------------------------- the offset network's size
def test_a_window_wider_than_the_grid_builds_the_offset_network_for_the_grid():
    wide = tiny_model("wan")
    handle = use_slide_attention(wide, kernel_size=(63, 63, 63), grid=(2, 3, 5))
    assert handle.options.kernel_size == (3, 3, 5)  # the next odd sizes covering (2, 3, 5)
    built = tiny_model("wan")
    use_slide_attention(built, kernel_size=(3, 3, 5))
    assert _offset_count(wide) == _offset_count(built) < 20_000  # not 2 x (63**3 * 2 heads * 3) * 17 = 51 M
    inputs = _inputs(wide)
    assert (_run(wide, inputs) - _run(tiny_model("wan"), inputs)).abs().max() <= 1e-5  # covers the grid: dense
    with torch.device("meta"):  # no grid given: Wan's own bound, rope_max_seq_len = 32 per axis here
        bounded = WanTransformer3DModel(**TINY["wan"][1])
    assert use_slide_attention(bounded, kernel_size=(63, 63, 63)).options.kernel_size == (33, 33, 33)
    restore_attention(wide)
