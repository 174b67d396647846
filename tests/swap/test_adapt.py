"""Adapting a dense model to slide attention (the MegaSlide workflow) on our own models:
`slidefusion train CONFIG --init-from DENSE_CHECKPOINT model.attention=slide`, resident and with
--offload. The slide model starts where the dense one is: with a window covering the grid its
prediction equals the dense checkpoint's."""

import json

import pytest
import torch
from safetensors.torch import load_file

from slidefusion.cli import main
from slidefusion.models import build_model
from slidefusion.training import Trainer, load_config
from slidefusion.io.checkpoint import load_checkpoint

# data 2 x 8 x 8 frames/pixels -> a latent token grid no larger than 2 x 8 x 8: [3, 9, 9] covers it
WHOLE = "model.attention_options={kernel_size: [3, 9, 9]}"


def _config(tmp_path, *overrides):
    return load_config(None, [
        "model.preset=dit3d-tiny", "data.frames=2", "data.height=8", "data.width=8", "run.batch_size=2",
        "run.log_every=1", "run.save_every=1", f"run.output_dir={tmp_path}", "optim.warmup_steps=1", *overrides,
    ])


@pytest.fixture(scope="module")
def dense_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dense")
    trainer = Trainer(_config(tmp, "run.steps=1", "run.name=dense", "optim.ema_decay=null"), quiet=True)
    with torch.no_grad():  # adaLN-Zero starts every block as the identity: wake the attention up
        for param in trainer.model.parameters():
            param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
    return trainer.train().last_checkpoint, trainer.config.model


@pytest.mark.parametrize("offload", [False, True])
def test_init_from_dense_starts_the_slide_model_where_the_dense_one_is(tmp_path, dense_checkpoint, offload):
    extra = ["offload.enabled=true"] if offload else []
    slide = Trainer(_config(tmp_path, "run.steps=1", "run.name=slide", "model.attention=slide", WHOLE, *extra),
                    quiet=True)
    path, dense_config = dense_checkpoint
    loaded, skipped = slide.init_from(path)
    assert loaded and all(".attn.offset_" in name for name in skipped), skipped
    weights = slide.optimizer.model_state_dict() if offload else slide.model.state_dict()
    dense = load_checkpoint(path)
    assert all(torch.equal(weights[name], dense.sampling_weights[name]) for name in loaded)

    # Same prediction: the dense checkpoint's model vs a slide model holding what the run will train from.
    dense_model = build_model(dense_config).eval()
    dense_model.load_state_dict(dense.sampling_weights)
    slide_model = build_model(slide.config.model).eval()
    slide_model.load_state_dict(weights)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, dense_config.in_channels, 2, 8, 8, generator=g)
    t, text = torch.rand(2, generator=g), torch.randn(2, 5, dense_config.text_dim, generator=g)
    with torch.no_grad():
        expected, got = dense_model(x, t, text), slide_model(x, t, text)
    assert (got - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max())
    if offload:
        slide.optimizer.close()


@pytest.mark.parametrize("offload", [[], ["--offload", "--device", "cpu"]])
def test_cli_adapts_a_dense_checkpoint_to_slide_attention(tmp_path, dense_checkpoint, offload, capsys):
    code = main(["train", "configs/tiny.yaml", "--init-from", str(dense_checkpoint[0]), "model.attention=slide",
                 "model.attention_options={kernel_size: [3, 5, 5], offsets: shift}", "data.frames=2",
                 "data.height=8", "data.width=8", "run.batch_size=2", "run.steps=2", "run.save_every=2",
                 f"run.output_dir={tmp_path}", *offload, "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "left as initialised" in out and "blocks.0.attn.offset_linear.weight (not in checkpoint)" in out
    weights = load_file(tmp_path / "tiny" / "checkpoint-2" / "model.safetensors")
    assert weights["blocks.0.attn.offset_linear.weight"].abs().max() > 0  # trained away from zero


# ---------------------------------------------------------------- a pretrained diffusers folder
def test_a_meta_model_swapped_and_loaded_into_the_engine_equals_the_resident_swap(tmp_path):
    # What a fine-tune of model.pretrained=DIR with model.attention=slide does on each path.
    from itertools import chain

    from slidefusion.families import adapter_for
    from slidefusion.offload import OffloadEngine, OffloadPolicy
    from slidefusion.pretrained import build_on_meta, iter_weights, load_transformer
    from slidefusion.swap import slide_offset_weights, use_configured_attention
    from slidefusion.testing.tiny import save_tiny_transformer, tiny_text

    folder = save_tiny_transformer(tmp_path / "wan", "wan")
    options = {"kernel_size": [1, 3, 3], "offsets": "shift"}
    resident = load_transformer(folder, dtype=torch.float32)
    use_configured_attention(resident, "slide", options)
    offsets = slide_offset_weights(resident, seed=3)
    assert offsets.keys() == {n for n in resident.state_dict() if ".slide_offsets." in n} and len(offsets) == 8
    resident.load_state_dict(offsets, strict=False)

    meta = build_on_meta(folder)
    use_configured_attention(meta, "slide", options)
    assert next(meta.blocks[0].attn1.slide_offsets.parameters()).is_meta
    engine = OffloadEngine(meta, adapter_for(meta).blocks(meta), OffloadPolicy(device="cpu", compute_dtype=torch.float32))
    engine.load_weights(chain(iter_weights(folder), slide_offset_weights(meta, seed=3).items()))
    weights = engine.model_state_dict()
    assert all(torch.equal(weights[name], value) for name, value in resident.state_dict().items())

    adapter, x = adapter_for(resident), torch.randn(1, 4, 2, 6, 10, generator=torch.Generator().manual_seed(0))
    text = tiny_text(resident, 1)

    def loss(model):
        return adapter.predict(model, x, torch.tensor([500.0]), text).square().mean()

    assert engine.train_step(loss) == loss(resident).item()
    engine.close()


def test_configured_attention_names_and_options():
    from slidefusion.errors import UserError
    from slidefusion.swap import slide_attention_handle, use_configured_attention
    from slidefusion.testing.tiny import tiny_model

    model = tiny_model("wan")
    assert use_configured_attention(model, "dense", {}) is None and slide_attention_handle(model) is None
    handle = use_configured_attention(model, "neighborhood", {"kernel_size": [1, 3, 3]})
    assert handle.options.offsets is None and not any(".slide_offsets." in n for n in model.state_dict())
    handle.remove()
    for attention, options, message in [("window", {}, "model.attention='window' is not available"),
                                        ("slide", {"window_size": 3}, "has no 'window_size'"),
                                        ("dense", {"kernel_size": 3}, "need model.attention=slide"),
                                        ("slide", {"kernel_size": [4, 3, 3]}, "kernel_size must be odd")]:
        with pytest.raises(UserError, match=message):
            use_configured_attention(model, attention, options)


# ---------------------------------------------------------------- train model.pretrained=DIR model.attention=slide
def _finetune(folder, out, name, *extra):
    """`slidefusion train` of the tiny Wan folder (token grid 2 x 3 x 5) adapted to slide attention;
    (logged losses, last checkpoint's weights, stdout)."""
    from slidefusion.testing.pipelines import PIXELS

    frames, height, width = PIXELS["wan"]
    code = main(["train", "configs/wan-finetune.yaml", f"model.pretrained={folder}", "model.attention=slide",
                 "data.kind=shapes", "data.num_samples=3", f"data.frames={frames}", f"data.height={height}",
                 f"data.width={width}", "run.device=cpu", "run.batch_size=2", "run.log_every=1", "run.save_every=1",
                 f"run.output_dir={out}", f"run.name={name}", "optim.lr=1e-3", "optim.warmup_steps=0",
                 "offload.compute_dtype=float32", *extra])
    assert code == 0
    losses = [json.loads(line)["loss"] for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    last = max((out / name).glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    return losses, load_file(last / "model.safetensors"), last


@pytest.mark.parametrize("lora", [[], ["lora.rank=4"]], ids=["full", "lora"])
def test_a_wan_folder_adapts_to_slide_attention_offloaded_as_resident(tiny_wan_dir, tmp_path, lora):
    window = ["model.attention_options={kernel_size: [1, 3, 3], offsets: shift}", "run.steps=3", "--quiet", *lora]
    resident = _finetune(tiny_wan_dir, tmp_path, "resident", *window)
    offloaded = _finetune(tiny_wan_dir, tmp_path, "offloaded", "--offload", *window)
    torch.testing.assert_close(offloaded[0], resident[0], rtol=1e-5, atol=0)
    assert resident[1].keys() == offloaded[1].keys()
    offsets = [k for k in resident[1] if ".slide_offsets." in k]
    assert len(offsets) == 8  # 2 blocks x (conv weight, bias, linear weight, bias)
    if lora:  # the checkpoint: LoRA's adapters and the offset networks, which train although the base is frozen
        assert all(".lora_" in k or ".slide_offsets." in k for k in resident[1])
    for name, value in resident[1].items():
        # offloaded = resident up to the engine's summation order (see tests/training/test_finetune.py)
        assert (offloaded[1][name] - value).abs().max() <= 6e-3 + 1e-5 * value.abs().max(), name
    for weights in (resident[1], offloaded[1]):  # the offsets' last layer starts at zero and moved
        assert all(weights[k].abs().max() > 1e-4 for k in offsets if "offset_linear" in k)


def test_step_0_of_an_adapted_run_is_the_dense_model_when_the_window_covers_the_grid(tiny_wan_dir, tmp_path, capsys):
    from slidefusion.testing.pipelines import PIXELS

    frames, height, width = PIXELS["wan"]
    dense = ["train", "configs/wan-finetune.yaml", f"model.pretrained={tiny_wan_dir}", "data.kind=shapes",
             "data.num_samples=3", f"data.frames={frames}", f"data.height={height}", f"data.width={width}",
             "run.device=cpu", "run.batch_size=2", "run.steps=1", f"run.output_dir={tmp_path}", "run.name=dense",
             "--quiet"]
    assert main(dense) == 0
    expected = json.loads((tmp_path / "dense" / "metrics.jsonl").read_text())["loss"]
    capsys.readouterr()
    cover = ["model.attention_options={kernel_size: [3, 3, 7]}", "run.steps=1"]  # grid 2 x 3 x 5: wider along T, W
    for name, extra in (("resident", []), ("offloaded", ["--offload", "offload.compute_dtype=float32"])):
        losses = _finetune(tiny_wan_dir, tmp_path, name, *cover, *extra)[0]
        assert losses[0] == pytest.approx(expected, rel=1e-5, abs=0)
        out = capsys.readouterr().out
        assert ("model.attention_options.kernel_size [3, 3, 7] is wider than the token grid [2, 3, 5] along T, W: "
                "slide attention attends those axes whole") in out


def test_a_slide_adapted_run_samples_as_trained_and_is_not_exported_as_a_stock_folder(tiny_wan_dir, tmp_path, capsys):
    from slidefusion.pipeline import VideoPipeline
    from slidefusion.swap import slide_attention_handle

    _, weights, checkpoint = _finetune(tiny_wan_dir, tmp_path, "slide", "run.steps=1", "--quiet",
                                       "model.attention_options={kernel_size: [1, 3, 3]}")
    pipe = VideoPipeline.from_checkpoint(checkpoint)
    model = pipe.parts.transformer
    assert slide_attention_handle(model).options.kernel_size == (1, 3, 3)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in weights.items() if ".slide_offsets." in k)
    capsys.readouterr()
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(out), "--format", "diffusers"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--format diffusers cannot hold slide attention" in err, err
    assert not out.exists()


def test_a_bf16_offloaded_lora_adaptation_keeps_finite_offset_gradients(tiny_wan_dir, tmp_path):
    # The README's command: bf16 compute, clipping, LoRA. Before the offset net's conv input was made
    # contiguous, torch's CPU depthwise Conv3d backward sometimes gave its weight a garbage gradient
    # under the engine's recompute (about half of such runs on a loaded machine stopped at step 1).
    losses, weights, _ = _finetune(tiny_wan_dir, tmp_path, "bf16", "--offload", "offload.compute_dtype=bfloat16",
                                   "lora.rank=4", "run.steps=2", "--quiet",
                                   "model.attention_options={kernel_size: [1, 3, 3]}")
    assert len(losses) == 2 and all(torch.isfinite(v).all() for v in weights.values())
