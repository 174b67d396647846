"""Generation from a diffusers folder across spawned gloo ranks equals one process: the folder's text
encoder, scheduler loop and VAE; only rank 0 writes; bad input is a one-line UserError before any
rank starts."""

import time

import pytest
import torch
from safetensors.torch import load_file

from slidefusion.errors import UserError
from slidefusion.parallel import ParallelConfig
from slidefusion.parallel import decode_video
from slidefusion.pipeline import generate_pretrained
from slidefusion.pretrained import PretrainedParts, Request, sample_latents

REQUEST = dict(frames=5, height=48, width=80, steps=2, guidance=4.0, seed=3)


def test_generate_pretrained_equals_one_process(tiny_wan_dir, tmp_path):
    parts = PretrainedParts.load(tiny_wan_dir)
    single = sample_latents(parts, Request("a red circle moving left", **REQUEST))
    video = decode_video(parts.vae, single)[0]
    assert single.abs().max() > 0.5 and video.shape == (3, 5, 48, 80)
    out, saved = tmp_path / "v.gif", tmp_path / "lat.safetensors"
    latents, parallel_video = generate_pretrained(tiny_wan_dir, "a red circle moving left", 2,
                                                  ParallelConfig("ulysses", 2, cfg_parallel=False, timeout_s=60),
                                                  out=out, save_latents=saved, **REQUEST)
    assert (latents - single).abs().max() <= 1e-5
    assert (parallel_video - video).abs().max() <= 1e-5  # decoded split over the two ranks
    assert torch.equal(load_file(saved)["latents"], latents)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lat.safetensors", "v.gif"]


@pytest.mark.parametrize("config, world, extra, message", [
    (ParallelConfig("dsp"), 2, {}, "valid for WanTransformer3DModel: ulysses"),
    (ParallelConfig("scalefusion", 2), 2, {}, "valid for WanTransformer3DModel: ulysses"),
    (ParallelConfig("ulysses"), 3, {}, "3 ranks > 2 heads of WanTransformer3DModel"),
    (ParallelConfig("ulysses", cfg_parallel=True), 3, {}, "cfg_parallel needs an even number of ranks"),
    (ParallelConfig("ulysses"), 2, {"frames": 6}, "frames=6 is not allowed by this VAE; valid: 1 + 4k"),
    (ParallelConfig("ulysses"), 2, {"height": 44}, "must be multiples of the VAE's 8-pixel latent cell"),
])
def test_bad_input_is_a_user_error_before_any_rank(tiny_wan_dir, config, world, extra, message):
    start = time.monotonic()
    with pytest.raises(UserError) as info:
        generate_pretrained(tiny_wan_dir, "a cat", world, config, **{**REQUEST, **extra})
    assert message in str(info.value) and "\n" not in str(info.value)
    assert time.monotonic() - start < 5  # no rank was spawned


def test_a_model_without_a_plan_names_the_supported_ones(tmp_path):
    from slidefusion.testing.tiny import save_tiny_transformer

    folder = save_tiny_transformer(tmp_path / "cog", "cogvideox")
    from slidefusion.parallel.plan import check_fit
    from slidefusion.pretrained import build_on_meta

    with pytest.raises(UserError, match="CogVideoXTransformer3DModel has no parallel plan; supported: DiT3D, STDiT, "
                                        "LatteTransformer3DModel, WanTransformer3DModel"):
        check_fit(build_on_meta(folder), ParallelConfig("ulysses"), 2)


ARGS = ["--prompt", "a red circle moving left", "--frames", "5", "--height", "48", "--width", "80", "--steps", "2",
        "--guidance", "4", "--seed", "3", "--quiet"]


def _torchrun(folder, out, schedule, slices):
    """The real CLI under torchrun: `generate --pretrained DIR --parallel SCHEDULE`."""
    import os
    import subprocess
    import sys

    from slidefusion.parallel.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "slidefusion", "generate", "--pretrained", str(folder), *ARGS, "--out", f"{out}/v.gif",
           "--save-latents", f"{out}/l.safetensors", "--parallel", schedule, "--slices", str(slices), "--timeout", "120"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_torchrun_on_a_folder_equals_one_process(tiny_wan_dir, tmp_path):
    from slidefusion.cli import main

    result = _torchrun(tiny_wan_dir, tmp_path, "ulysses", 2)
    assert result.returncode == 0, "\n".join(l for l in result.stderr.splitlines() if "rror" in l)
    single = tmp_path / "single"
    assert main(["generate", "--pretrained", str(tiny_wan_dir), *ARGS, "--out", str(single / "v.gif"),
                 "--save-latents", str(single / "l.safetensors")]) == 0
    parallel, alone = load_file(tmp_path / "l.safetensors")["latents"], load_file(single / "l.safetensors")["latents"]
    assert alone.abs().max() > 0.5 and (parallel - alone).abs().max() <= 1e-5
    assert (tmp_path / "v.gif").stat().st_size > 0 and "exposed communication" in result.stdout
    bad = _torchrun(tiny_wan_dir, tmp_path / "bad", "dsp", 1)  # before any process group: rank 0 says it, once
    assert bad.returncode != 0 and bad.stderr.count("slidefusion generate: error:") == 1
    assert "valid for WanTransformer3DModel: ulysses" in bad.stderr and not (tmp_path / "bad").exists()
