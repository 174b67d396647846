"""`slidefusion plan`: sizes need their unit, and what it suggests is valid and fits."""

import re

import pytest

from slidefusion.cli import main
from slidefusion.core.errors import UserError
from slidefusion.io.config import build, plain
from slidefusion.offload.plan.model_shape import model_shape
from slidefusion.offload.plan.plan import parse_bytes
from slidefusion.offload.plan.planner import Machine, grid_for, largest_frames, plan_training
from slidefusion.offload.policy import OffloadPolicy
from slidefusion.offload.tiling.activations import Workload
from slidefusion.training.config import load_config

WAN = ["plan", "--model", "wan2.1-14b", "--height", "720", "--width", "1280"]


@pytest.mark.parametrize("flag, value, needle", [
    ("--gpu-memory", "24", "'24' has no unit; write e.g. 24GB"), ("--host-memory", "128", "has no unit"),
    ("--disk", "2000", "has no unit"), ("--pcie", "25", "has no unit"), ("--disk-bandwidth", "3", "has no unit"),
    ("--gpu-memory", "24G", "'24G' is ambiguous: write 24GB (powers of 1000) or 24GiB (powers of 1024)"),
])
def test_a_size_without_its_unit_is_refused(capsys, flag, value, needle):
    assert main([*WAN, "--frames", "81", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"argument {flag}: " in err and needle in err, err


def test_every_size_key_needs_its_unit_but_python_ints_are_bytes():
    assert main([*WAN, "--frames", "81", "--gpu-memory", "24gib", "--host-memory", "1.5TB"]) == 0
    for key in ("spill_after", "pin_budget"):
        with pytest.raises(UserError, match=f"offload.{key}=64 has no unit; write e.g. 64GB"):  # YAML reads 64 as an int
            load_config(None, [f"offload.{key}=64", "offload.spill_dir=/tmp"])
        with pytest.raises(UserError, match=f"offload.{key}='64' has no unit"):
            OffloadPolicy(**{key: "64"}, spill_dir="/tmp")
        assert getattr(OffloadPolicy(**{key: 64}, spill_dir="/tmp"), key) == 64  # the Python API: bytes
    assert load_config(None, ["offload.spill_after=0", "offload.pin_budget=64GB"]).offload.pin_budget == 64 * 10**9
    assert parse_bytes(1000, "host_memory") == 1000  # the Python API: an int is a number of bytes


def test_a_policy_written_as_config_reads_back_with_its_units():
    policy = OffloadPolicy(pin_budget=3 * 2**30, spill_after=1234, spill_dir="/tmp")
    data = plain(policy)
    assert (data["pin_budget"], data["spill_after"]) == ("3GiB", "1234B")
    assert build(OffloadPolicy, data, "offload") == policy


def _plan(frames, **sizes):
    shape = model_shape("wan2.1-14b")
    grid = grid_for(frames, 720, 1280, shape.patch, (4, 8, 8))
    work = Workload(1, grid[0] * grid[1] * grid[2], "flash", frames=grid[0])
    base = {"gpu_memory": 141e9, "host_memory": 260e9, "pcie_bytes_s": 55e9, "tflops": 990, "tile": "auto"}
    return shape, work, {**base, **sizes}


def test_the_largest_clip_is_a_length_the_vae_takes_and_the_next_one_does_not_fit():
    shape, work, sizes = _plan(241)
    machine = Machine(sizes["gpu_memory"], sizes["host_memory"], sizes["pcie_bytes_s"], sizes["tflops"])
    policy = OffloadPolicy(compute_dtype="bfloat16", tile="auto")
    frames = largest_frames(shape, work, policy, machine, (241, 720, 1280), (4, 8, 8))
    assert frames and (frames - 1) % 4 == 0, frames
    assert plan_training(*_plan(frames)[:2], **sizes).fits
    assert not plan_training(*_plan(frames + 4)[:2], **sizes).fits


def test_plan_says_lean_state_plus_a_disk_fits_when_neither_alone_does(capsys):
    assert main([*WAN, "--frames", "161", "--gpu-memory", "80GB", "--host-memory", "96GB"]) == 0
    out = capsys.readouterr().out
    said = re.search(r"with --master bf16 --moments int8 and checkpoints spilled to a disk \(--disk, offload.spill_dir\) "
                     r"of ([\d.]+) GB or more it fits", out)
    assert said, out
    assert "with --master bf16 --moments int8 it fits" not in out  # lean state alone does not
    largest = re.search(r"largest clip that fits at 1280x720: none as asked \(even one latent frame does not fit\); "
                        r"with (.+): (\d+) frames", out)
    assert largest and (int(largest.group(2)) - 1) % 4 == 0, out
    # what it said fits does fit
    assert main([*WAN, "--frames", "161", "--gpu-memory", "80GB", "--host-memory", "96GB", "--master", "bf16",
                 "--moments", "int8", "--disk", f"{float(said.group(1)) + 0.1:.1f}GB"]) == 0
    assert "verdict: fits" in capsys.readouterr().out


def test_plan_notes_a_length_the_vae_does_not_take(capsys):
    assert main([*WAN, "--frames", "76", "--gpu-memory", "24GB", "--host-memory", "240GB"]) == 0
    assert "--frames 76 is not 1 + 4k" in capsys.readouterr().out
