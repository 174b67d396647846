"""Fine-tuning image-to-video Wan folders: each clip's first frame conditions it (cached once, as the
latents are), the run samples with `generate --checkpoint RUN --image PATH` what diffusers'
WanImageToVideoPipeline samples from its export, offloaded and tiled training equal resident, LoRA
works, and diffusion.image_dropout is a key."""

import json

import pytest
import torch
from safetensors.torch import load_file

from slidefusion.cli import main
from slidefusion.testing.i2v import save_tiny_wan_i2v_pipeline, tiny_image

PROMPT = "a red circle moving left"
SIZES = {"2.1-i2v": (5, 48, 80), "2.2-ti2v": (5, 32, 64)}


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory):
    return save_tiny_wan_i2v_pipeline(tmp_path_factory.mktemp("tiny-wan-i2v-train") / "wan")


def _train(folder, variant, out, name, *extra, steps=2):
    frames, height, width = SIZES[variant]
    assert main(["train", "configs/wan-finetune.yaml", f"model.pretrained={folder}", "data.kind=shapes",
                 "data.num_samples=2", f"data.frames={frames}", f"data.height={height}", f"data.width={width}",
                 "run.device=cpu", f"run.steps={steps}", "run.batch_size=2", f"run.output_dir={out}", f"run.name={name}",
                 "run.log_every=1", "optim.lr=1e-2", "optim.warmup_steps=0", "--quiet", *extra]) == 0
    losses = [json.loads(line)["loss"] for line in (out / name / "metrics.jsonl").read_text().splitlines()]
    return out / name, losses


def _sample(out, variant, image_path, *source):
    frames, height, width = SIZES[variant]
    path = out / "latents.safetensors"
    assert main(["generate", *source, "--image", str(image_path), "--prompt", PROMPT, "--frames", str(frames),
                 "--height", str(height), "--width", str(width), "--steps", "2", "--guidance", "4", "--seed", "3",
                 "--quiet", "--out", str(out / "v.gif"), "--save-latents", str(path)]) == 0
    return load_file(path)["latents"]


def _diffusers(folder, image, variant):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    frames, height, width = SIZES[variant]
    pipe = WanImageToVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    text = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler,
                       transformer=None)  # WanImageToVideoPipeline's own prompt encoding needs ftfy
    cond, uncond = text.encode_prompt(PROMPT, negative_prompt="", do_classifier_free_guidance=True,
                                      max_sequence_length=512)
    return pipe(image=image, prompt_embeds=cond, negative_prompt_embeds=uncond, num_frames=frames, height=height,
                width=width, num_inference_steps=2, guidance_scale=4.0, output_type="latent",
                generator=torch.Generator().manual_seed(3)).frames


@pytest.mark.parametrize("variant", ["2.1-i2v", "2.2-ti2v"])
def test_an_image_to_video_fine_tune_samples_what_diffusers_samples_from_its_export(variant, i2v_dir,
                                                                                    tiny_wan_variant_dir, tmp_path):
    folder = i2v_dir if variant == "2.1-i2v" else tiny_wan_variant_dir("2.2-ti2v")
    run, losses = _train(folder, variant, tmp_path, "i2v")
    assert len(losses) == 2 and len(list((run / "cache" / "image").iterdir())) == 2  # one condition per clip
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "out"), "--format", "diffusers"]) == 0
    image = tiny_image(4)
    image.save(tmp_path / "first.png")
    ours = _sample(tmp_path, variant, tmp_path / "first.png", "--checkpoint", str(run))
    theirs = _diffusers(tmp_path / "out", image, variant)
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    base = _diffusers(folder, image, variant)
    assert (ours - base).abs().max() > 1e-3 * base.abs().max()  # the fine-tuned weights sampled
    if variant == "2.1-i2v":  # its image projection and image keys in Wan's original names, read back by diffusers
        from diffusers import WanTransformer3DModel

        assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "comfy"), "--format", "comfyui",
                     "--dtype", "float32"]) == 0
        single = WanTransformer3DModel.from_single_file(str(tmp_path / "comfy" / "i2v_fp32.safetensors"),
                                                        config=str(folder), subfolder="transformer").state_dict()
        trained = load_file(run / "checkpoint-2" / "model.safetensors")
        assert single.keys() == trained.keys() and all(torch.equal(single[k], trained[k]) for k in trained)
    _, without = _train(folder, variant, tmp_path, "dropped", "diffusion.image_dropout=0.999")
    assert without[0] != losses[0]  # the same draws, but no image: the condition is what training saw


def test_offloaded_and_tiled_image_to_video_training_equals_resident(i2v_dir, tmp_path):
    _, resident = _train(i2v_dir, "2.1-i2v", tmp_path, "resident", "offload.compute_dtype=float32")
    _, offloaded = _train(i2v_dir, "2.1-i2v", tmp_path, "offloaded", "--offload", "offload.compute_dtype=float32",
                          "offload.tile=1")
    torch.testing.assert_close(offloaded, resident, rtol=1e-5, atol=0)
    lora, losses = _train(i2v_dir, "2.1-i2v", tmp_path, "lora", "lora.rank=2", "--offload",
                          "offload.compute_dtype=float32", "diffusion.image_dropout=0.5")
    assert all(".lora_" in k for k in load_file(lora / "checkpoint-2" / "model.safetensors"))
    tiny_image().save(tmp_path / "first.png")
    assert torch.isfinite(_sample(tmp_path, "2.1-i2v", tmp_path / "first.png", "--checkpoint", str(lora))).all()


def test_image_dropout_is_refused_for_a_text_to_video_folder(tiny_wan_dir, tmp_path, capsys):
    assert main(["train", "configs/wan-finetune.yaml", f"model.pretrained={tiny_wan_dir}", "data.kind=shapes",
                 "data.frames=5", "data.height=48", "data.width=80", "run.device=cpu", f"run.output_dir={tmp_path}",
                 "diffusion.image_dropout=0.1", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "diffusion.image_dropout=0.1 applies to image-to-video folders" in err and err.count("\n") == 1
