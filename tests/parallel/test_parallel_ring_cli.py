"""The ring schedules through the real CLI under torchrun: a Wan 2.2 A14B folder (two experts) under
`--parallel ring` equals one process, and bad input ends every rank with exit 2 and one line.

What the user sees on bad input (torch 2.13's torchrun, which always reports a worker that exited
non-zero): rank 0's one line `slidefusion generate: error: ...`, then torchrun's own report - an
`E... failed (exitcode: 2) local_rank: 0` log line, torchrun's traceback ending in `ChildFailedError`
and its table naming each rank with `exitcode : 2` - and torchrun itself exits 1. No rank prints a
traceback and none is killed: each exits 2 on its own, before any process group exists."""

import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from slidefusion.cli import main
from slidefusion.parallel.launch import free_port

ARGS = ["--prompt", "a red circle moving left", "--frames", "5", "--height", "48", "--width", "80", "--steps", "2",
        "--guidance", "4", "--seed", "3", "--quiet"]


def torchrun(*args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "slidefusion", "generate", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_ring_on_a_wan_a14b_folder_under_torchrun_equals_one_process(tiny_wan_variant_dir, tmp_path):
    folder = tiny_wan_variant_dir("2.2-a14b")
    result = torchrun("--pretrained", str(folder), *ARGS, "--out", f"{tmp_path}/v.gif", "--save-latents",
                      f"{tmp_path}/l.safetensors", "--parallel", "ring", "--slices", "2", "--timeout", "120")
    assert result.returncode == 0, "\n".join(l for l in result.stderr.splitlines() if "rror" in l)
    single = tmp_path / "single"
    assert main(["generate", "--pretrained", str(folder), *ARGS, "--save-latents", str(single / "l.safetensors"),
                 "--out", str(single / "v.gif")]) == 0
    parallel, alone = load_file(tmp_path / "l.safetensors")["latents"], load_file(single / "l.safetensors")["latents"]
    assert alone.abs().max() > 0.5 and (parallel - alone).abs().max() <= 1e-5


@pytest.fixture(scope="module")
def window_checkpoint(tmp_path_factory):
    """A DiT3D checkpoint whose attention is a local window (a mask a ring cannot split)."""
    from pathlib import Path

    from slidefusion.models import build_model
    from slidefusion.training import load_config
    from slidefusion.io.checkpoint import save_checkpoint

    config = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml", ["model.attention=window"])
    return save_checkpoint(tmp_path_factory.mktemp("window") / "run", 1, config.to_dict(),
                           build_model(config.model).state_dict())


RANDOM = ["--init", "random", "--model", "dit3d-tiny"]
SMALL = ["--prompt", "x", "--steps", "1", "--frames", "3", "--height", "6", "--width", "10", "--quiet"]


@pytest.mark.parametrize("model, extra, message", [
    (RANDOM, ["--parallel", "usp", "--ulysses", "2", "--ring", "2"],
     "--ulysses 2 x --ring 2 = 4 must equal the ranks per sequence group (2); valid: --ulysses 1 --ring 2, "
     "--ulysses 2 --ring 1"),
    ("window", ["--parallel", "ring"], "limits each query to a window, a mask that ring cannot split; valid: ulysses"),
    (RANDOM, ["--parallel", "usp"], "--parallel usp needs its degrees"),
])
def test_bad_ring_input_under_torchrun_exits_2_on_every_rank(tmp_path, window_checkpoint, model, extra, message):
    model = ["--checkpoint", str(window_checkpoint)] if model == "window" else model
    result = torchrun(*model, *SMALL, "--out", f"{tmp_path}/out/v.gif", *extra, timeout=180)
    errors = [line for line in result.stderr.splitlines() if line.startswith("slidefusion generate: error:")]
    assert len(errors) == 1 and message in errors[0], result.stderr[-2000:]  # rank 0 alone, one line
    assert result.stderr.count("exitcode  : 2") == 2  # both ranks exited 2 themselves, none was killed
    assert "slidefusion/" not in result.stderr  # no traceback from our code (torchrun's own is torch's)
    assert result.returncode == 1 and not (tmp_path / "out").exists()
