"""Image-to-video with Wan folders: `generate --pretrained DIR --image PATH` (and `FolderPipeline(...,
image=)`) samples what diffusers' `WanImageToVideoPipeline` samples for the same generator, for Wan
2.1 I2V (CLIP states + mask and first-frame latents beside the latents) and Wan 2.2 TI2V's image
mode (the first latent frame is the image's); bad input is one line."""

import pytest
import torch
from safetensors.torch import load_file

from slidefusion.cli import main
from slidefusion.testing.i2v import save_tiny_wan_i2v_pipeline, tiny_image

PROMPT = "a red circle moving left"
SIZES = {"2.1-i2v": (5, 48, 80), "2.2-ti2v": (5, 32, 64)}


@pytest.fixture(scope="module")
def i2v_dir(tmp_path_factory):
    return save_tiny_wan_i2v_pipeline(tmp_path_factory.mktemp("tiny-wan-i2v") / "wan")


def _folder(variant, i2v_dir, tiny_wan_variant_dir):
    return i2v_dir if variant == "2.1-i2v" else tiny_wan_variant_dir("2.2-ti2v")


def _diffusers_latents(folder, image, variant, guidance=4.0):
    """WanImageToVideoPipeline on the folder; the prompt states from WanPipeline's encode_prompt (the
    image pipeline's own needs ftfy, which this environment lacks; the two encode alike)."""
    from diffusers import WanImageToVideoPipeline, WanPipeline

    frames, height, width = SIZES[variant]
    pipe = WanImageToVideoPipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    text = WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae,
                       scheduler=pipe.scheduler, transformer=None)
    cond, uncond = text.encode_prompt(PROMPT, negative_prompt="", do_classifier_free_guidance=True,
                                      max_sequence_length=512)  # what the pipelines call it with
    return pipe(image=image, prompt_embeds=cond, negative_prompt_embeds=uncond, num_frames=frames, height=height,
                width=width, num_inference_steps=2, guidance_scale=guidance, output_type="latent",
                generator=torch.Generator().manual_seed(3)).frames


@pytest.mark.parametrize("variant", ["2.1-i2v", "2.2-ti2v"])
def test_image_to_video_samples_what_diffusers_samples(variant, i2v_dir, tiny_wan_variant_dir, tmp_path):
    folder = _folder(variant, i2v_dir, tiny_wan_variant_dir)
    image = tiny_image(1)
    image.save(tmp_path / "first.png")
    theirs = _diffusers_latents(folder, image, variant)
    frames, height, width = SIZES[variant]
    out = tmp_path / "latents.safetensors"
    assert main(["generate", "--pretrained", str(folder), "--image", str(tmp_path / "first.png"), "--prompt", PROMPT,
                 "--frames", str(frames), "--height", str(height), "--width", str(width), "--steps", "2",
                 "--guidance", "4", "--seed", "3", "--quiet", "--out", str(tmp_path / "v.gif"),
                 "--save-latents", str(out)]) == 0
    ours = load_file(out)["latents"]
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    other = _diffusers_latents(folder, tiny_image(2), variant)
    assert (other - theirs).abs().max() > 1e-3 * theirs.abs().max()  # the image is what conditions it


@pytest.mark.parametrize("case, message", [
    ("not-an-image", "is not an image this program can read"),
    ("text-to-video", "holds a text-to-video WanTransformer3DModel; an image conditions"),
    ("missing-image", "is an image-to-video model (Wan 2.1 I2V): give --image PATH"),
    ("no-pretrained", "--image applies to image-to-video Wan folders (--pretrained DIR) and fine-tunes of them"),
    ("parallel", "--image does not run under --parallel yet"),
])
def test_bad_image_input_is_one_line(case, message, i2v_dir, tiny_wan_dir, tmp_path, capsys):
    (tmp_path / "notes.png").write_text("not an image")
    tiny_image().save(tmp_path / "first.png")
    image = ["--image", str(tmp_path / ("notes.png" if case == "not-an-image" else "first.png"))]
    source = ["--pretrained", str(tiny_wan_dir if case == "text-to-video" else i2v_dir)]
    extra = []
    if case == "missing-image":
        image = []
    if case == "no-pretrained":
        source = ["--checkpoint", "bundled"]
    if case == "parallel":
        extra = ["--parallel", "ulysses"]
    args = ["generate", *source, *image, "--prompt", PROMPT, "--frames", "5", "--height", "48", "--width", "80",
            "--steps", "1", "--quiet", "--out", str(tmp_path / "v.gif"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert not (tmp_path / "v.gif").exists()
