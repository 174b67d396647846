"""The planner: the paper's 105 B numbers, verdicts with reasons, and the `plan` command."""

import pytest

from slidefusion.cli import main
from slidefusion.errors import UserError
from slidefusion.models import preset
from slidefusion.offload.planner import Workload, parse_bytes, plan_training, tokens_for

H200 = {"gpu_memory": 141e9, "host_memory": 1.5e12, "pcie_bytes_s": 55e9, "tflops": 990}


def _plan(attention, frames=256, height=1080, width=1920, **overrides):
    config = preset("dit3d-105b")
    tokens = tokens_for(frames, height, width, config.patch_size, (4, 8, 8))
    return plan_training(config, Workload(1, tokens, attention), **{**H200, **overrides})


def test_105b_persistent_state_is_14_bytes_per_parameter():
    plan = _plan("slide")
    persistent = plan.host["persistent state (14 B/param in bf16)"]
    assert persistent == pytest.approx(1.47e12, rel=0.01)
    assert plan.device["weights in flight"] == pytest.approx(2 * 2 * 1.48e9, rel=0.01)


def test_256_frames_at_1080p_and_the_reasons():
    slide, dense = _plan("slide"), _plan("dense")
    assert not dense.fits and "attention workspace (scores of one head" in dense.verdict()
    # Even slide attention does not fit at 105 B: the block-boundary checkpoints alone are 608 GB.
    assert not slide.fits and "activation checkpoints" in slide.host
    assert slide.host["activation checkpoints"] == pytest.approx(608e9, rel=0.01)
    assert dense.device_bytes - slide.device_bytes > 500e9
    assert _plan("slide", frames=32).fits and not _plan("dense", frames=64).fits


def test_parse_bytes():
    assert parse_bytes("141GB", "x") == 141e9 and parse_bytes("1.5TB", "x") == 1.5e12
    assert parse_bytes("55GB/s", "x") == 55e9 and parse_bytes("64GiB", "x") == 64 * 2**30
    with pytest.raises(UserError, match="--gpu-memory='lots' must be a size"):
        parse_bytes("lots", "--gpu-memory")


def test_plan_command(capsys):
    args = ["plan", "--model", "dit3d-105b", "--frames", "256", "--height", "1080", "--width", "1920",
            "--attention", "slide", "--gpu-memory", "141GB", "--host-memory", "1.5TB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1.47 TB" in out and "does not fit" in out and "largest clip that fits" in out
    assert main([*args[:-4], "--gpu-memory", "lots"]) == 2
    assert "argument --gpu-memory: 'lots' must be a size" in capsys.readouterr().err
