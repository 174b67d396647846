"""A fine-tune back into diffusers: `export --format diffusers` writes a pipeline folder (or LoRA weights)
that the family's own diffusers pipeline loads and samples exactly as slidefusion samples the run
(`generate --checkpoint RUN`), for Wan, CogVideoX and Latte."""

import pytest
import torch
from safetensors.torch import load_file

from slidefusion.cli import main
from slidefusion.testing.pipelines import PIXELS

PROMPT = ["--prompt", "a red circle moving left", "--steps", "2", "--guidance", "4", "--seed", "3", "--quiet"]


def _train(folder, family, out, name, *extra):
    frames, height, width = PIXELS[family]
    args = ["train", "configs/wan-finetune.yaml", f"model.pretrained={folder}", "data.kind=shapes", "data.num_samples=2",
            f"data.frames={frames}", f"data.height={height}", f"data.width={width}", "run.device=cpu", "run.steps=2",
            "run.batch_size=2", f"run.output_dir={out}", f"run.name={name}", "optim.lr=1e-2", "optim.warmup_steps=0",
            "--quiet", *extra]
    assert main(args) == 0
    return out / name


def _generate(family, out, *source):
    frames, height, width = PIXELS[family]
    path = out / "latents.safetensors"
    assert main(["generate", *source, *PROMPT, "--frames", str(frames), "--height", str(height), "--width", str(width),
                 "--out", str(out / "v.gif"), "--save-latents", str(path)]) == 0
    return load_file(path)["latents"]


def _diffusers_latents(pipe, family):
    frames, height, width = PIXELS[family]
    pipe.set_progress_bar_config(disable=True)
    sizes = dict(video_length=frames, clean_caption=False) if family == "latte" else dict(num_frames=frames)
    out = pipe("a red circle moving left", height=height, width=width, num_inference_steps=2, guidance_scale=4.0,
               output_type="latent", generator=torch.Generator().manual_seed(3), **sizes).frames
    return out.transpose(1, 2) if family == "cogvideox" else out


@pytest.mark.parametrize("family", ["wan", "cogvideox", "latte"])
def test_export_reloads_in_diffusers_and_samples_the_fine_tuned_model(tiny_pipeline_dir, tmp_path, family):
    import diffusers

    folder = tiny_pipeline_dir(family)
    run = _train(folder, family, tmp_path, "run")
    shard = ["--max-shard-size", "20KB"] if family == "wan" else []
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "out"), "--format", "diffusers",
                 *shard]) == 0
    cls = getattr(diffusers, {"wan": "WanPipeline", "cogvideox": "CogVideoXPipeline", "latte": "LattePipeline"}[family])
    pipe = cls.from_pretrained(tmp_path / "out")
    trained = load_file(run / "checkpoint-2" / "model.safetensors")
    state = pipe.transformer.state_dict()
    assert state.keys() == trained.keys() and all(torch.equal(state[k], trained[k]) for k in trained)
    if family == "wan":
        assert len(list((tmp_path / "out" / "transformer").glob("*-of-*.safetensors"))) > 1
        assert diffusers.DiffusionPipeline.from_pretrained(tmp_path / "out").__class__ is cls
    theirs = _diffusers_latents(pipe, family)
    ours = _generate(family, tmp_path / "ours", "--checkpoint", str(run))
    base = _generate(family, tmp_path / "base", "--pretrained", str(folder))
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    assert (ours - base).abs().max() > 1e-3  # the fine-tuned weights are what sampled


def test_lora_export_loads_with_load_lora_weights(tiny_pipeline_dir, tmp_path):
    import diffusers

    import hashlib

    folder = tiny_pipeline_dir("wan")
    digest = lambda: {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}  # noqa: E731
    before = digest()
    run = _train(folder, "wan", tmp_path, "lora", "lora.rank=4", "lora.alpha=8")
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "out"), "--format", "diffusers"]) == 0
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["pytorch_lora_weights.safetensors"]
    pipe = diffusers.WanPipeline.from_pretrained(folder)
    pipe.load_lora_weights(tmp_path / "out")
    assert pipe.transformer.blocks[0].attn1.to_q.scaling == {"default_0": 2.0}  # alpha / rank from the metadata
    theirs = _diffusers_latents(pipe, "wan")
    ours = _generate("wan", tmp_path / "ours", "--checkpoint", str(run))
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()
    assert digest() == before  # training and export never touched the source folder


def test_export_refuses_what_it_cannot_write(tiny_pipeline_dir, tmp_path, capsys):
    from slidefusion.models import build_model, preset
    from slidefusion.io.checkpoint import save_checkpoint

    ours = save_checkpoint(tmp_path / "ours", 1, {"model": {"preset": "dit3d-tiny"}},
                           build_model(preset("dit3d-tiny")).state_dict())
    assert main(["export", "--checkpoint", str(ours), "--out", str(tmp_path / "o"), "--format", "diffusers"]) == 2
    err = capsys.readouterr().err
    assert "needs a checkpoint of a diffusers fine-tune" in err and err.count("\n") == 1
    run = _train(tiny_pipeline_dir("wan"), "wan", tmp_path, "run", "run.steps=1")
    assert main(["export", "--checkpoint", str(run), "--out", str(run / "inside"), "--format", "diffusers"]) == 2
    assert "inside the checkpoint or run folder" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (run / "inside").exists()
