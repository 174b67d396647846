"""Sampling a LoRA: `generate --pretrained DIR --lora FILE_OR_DIR [--lora-scale S]` reads both layouts
slidefusion exports and samples what `generate --checkpoint RUN` and diffusers' own pipeline with
`load_lora_weights` sample; a LoRA for another model is one line. `generate --checkpoint bundled`
samples the demo model."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from wan_runs import train

from slidefusion.cli import main
from slidefusion.testing.pipelines import PIXELS

FRAMES, HEIGHT, WIDTH = PIXELS["wan"]
SIZES = ["--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]
SAMPLE = ["--prompt", "a red circle moving left", "--steps", "2", "--guidance", "4", "--seed", "3", "--quiet", *SIZES]


def _latents(out, *source):
    path = out / "latents.safetensors"
    assert main(["generate", *source, *SAMPLE, "--out", str(out / "v.gif"), "--save-latents", str(path)]) == 0
    return load_file(path)["latents"]


@pytest.fixture(scope="module")
def exports(tiny_wan_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("lora-sampling")
    run = train(tiny_wan_dir, out, "moves", "lora.rank=4", "lora.alpha=8",
                "lora.target_modules=[to_q,to_k,to_v,to_out.0,ffn.net.0.proj,condition_embedder.time_proj]")
    for fmt in ("diffusers", "comfyui"):
        assert main(["export", "--checkpoint", str(run), "--out", str(out / fmt), "--format", fmt]) == 0
    return run, out


def test_both_layouts_sample_what_the_run_samples(exports, tiny_wan_dir, tmp_path):
    run, out = exports
    trained = _latents(tmp_path / "run", "--checkpoint", str(run))
    base = _latents(tmp_path / "base", "--pretrained", str(tiny_wan_dir))
    scale = trained.abs().max()
    for source in (out / "diffusers", out / "comfyui", out / "comfyui" / "moves.safetensors"):
        ours = _latents(tmp_path / source.name, "--pretrained", str(tiny_wan_dir), "--lora", str(source))
        assert (ours - trained).abs().max() <= 1e-5 * scale, source
    assert (trained - base).abs().max() > 1e-3 * scale  # the LoRA is what differs
    zero = _latents(tmp_path / "zero", "--pretrained", str(tiny_wan_dir), "--lora", str(out / "comfyui"),
                    "--lora-scale", "0")
    assert torch.equal(zero, base)


def test_lora_scale_weighs_as_diffusers_set_adapters_does(exports, tiny_wan_dir, tmp_path):
    from diffusers import WanPipeline

    _, out = exports
    pipe = WanPipeline.from_pretrained(tiny_wan_dir)
    pipe.load_lora_weights(out / "diffusers", adapter_name="moves")
    pipe.set_adapters(["moves"], [1.5])
    pipe.set_progress_bar_config(disable=True)
    theirs = pipe("a red circle moving left", num_frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
                  guidance_scale=4.0, output_type="latent", generator=torch.Generator().manual_seed(3)).frames
    ours = _latents(tmp_path, "--pretrained", str(tiny_wan_dir), "--lora", str(out / "comfyui"), "--lora-scale", "1.5")
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_generate_checkpoint_bundled_samples_the_demo_model(tmp_path):
    out = tmp_path / "bundled.gif"
    assert main(["generate", "--checkpoint", "bundled", "--prompt", "a red circle moving left", "--steps", "2",
                 "--frames", "4", "--quiet", "--out", str(out)]) == 0
    assert out.stat().st_size > 0


def _bad_files(tmp_path, exports):
    _, out = exports
    good = load_file(out / "diffusers" / "pytorch_lora_weights.safetensors")
    name = next(k for k in good if k.endswith("attn1.to_q.lora_A.weight"))
    wide = dict(good, **{name: torch.zeros(4, 32)})
    other = {k.replace("transformer.blocks.", "transformer.transformer_blocks."): v for k, v in good.items()}
    nan = dict(good, **{name: torch.full_like(good[name], float("nan"))})
    files = {}
    for key, state in (("wide", wide), ("other", other), ("nan", nan)):
        files[key] = tmp_path / f"{key}.safetensors"
        save_file(state, files[key])
    (tmp_path / "two").mkdir()
    for i in range(2):
        save_file(good, tmp_path / "two" / f"{i}.safetensors")
    files["two"] = tmp_path / "two"
    save_file({"text_model.weight": torch.zeros(2)}, tmp_path / "te.safetensors")
    files["foreign"] = tmp_path / "te.safetensors"
    return files


@pytest.mark.parametrize("case, extra, message", [
    ("wide", [], "in the LoRA but (16, 16) in the transformer; a LoRA for another model size?"),
    ("other", [], "the transformer has no module transformer_blocks.0.attn1.to_"),
    ("nan", [], "holds NaN or infinity"),
    ("two", [], "holds 2 .safetensors files; give the LoRA file itself"),
    ("foreign", [], "is not a LoRA in diffusers' layout"),
    ("a14b", [], "has two experts (transformer, transformer_2); name the LoRA file"),
    ("no-pretrained", [], "--lora FILE_OR_DIR applies to the transformer of a --pretrained DIR"),
    ("scale-alone", ["--lora-scale", "2"], "--lora-scale weighs a --lora FILE_OR_DIR"),
    ("scale-nan", ["--lora-scale", "nan"], "argument --lora-scale"),
    ("export-as-pretrained", [], "holds LoRA weights, not a model: give the base model's folder"),
])
def test_a_lora_that_does_not_fit_is_one_line(case, extra, message, exports, tiny_wan_dir, tiny_wan_variant_dir,
                                              tmp_path, capsys):
    files = _bad_files(tmp_path, exports)
    folder = tiny_wan_variant_dir("2.2-a14b") if case == "a14b" else tiny_wan_dir
    lora = ["--lora", str(files.get(case, exports[1] / "diffusers"))] if case != "scale-alone" else []
    source = ["--checkpoint", str(exports[0])] if case == "no-pretrained" else ["--pretrained", str(folder)]
    if case == "export-as-pretrained":
        source, lora = ["--pretrained", str(exports[1] / "diffusers")], []
    assert main(["generate", *source, *lora, *extra, *SAMPLE, "--out", str(tmp_path / "v.gif")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "v.gif").exists()
