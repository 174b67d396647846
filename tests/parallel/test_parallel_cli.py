"""The torchrun launch path and the simulate command."""

import json
import os
import subprocess
import sys

import pytest
from safetensors.torch import load_file

from slidefusion.cli import main
from slidefusion.parallel.launch import free_port
from slidefusion.parallel.simulate import HARDWARE, Link, Op, StepCosts, paper_scenario, run, simulate

ARGS = ["generate", "--init", "random", "--model", "stdit-tiny", "--prompt", "a blue square", "--steps", "2",
        "--frames", "3", "--height", "6", "--width", "10", "--quiet"]


def test_torchrun_generate_equals_one_process(tmp_path):
    assert main(ARGS + ["--out", str(tmp_path / "s.gif"), "--save-latents", str(tmp_path / "s.safetensors")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "slidefusion", *ARGS, "--out", str(tmp_path / "p.gif"), "--save-latents", str(tmp_path / "p.safetensors"),
           "--parallel", "scalefusion-inter", "--slices", "2", "--trace", str(tmp_path / "trace.json"), "--timeout", "150"]  # generous: loaded CI machines are slow
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    # torchrun's own summary buries the rank's error: show the lines that name it.
    assert result.returncode == 0, "\n".join(l for l in result.stderr.splitlines() if "rror" in l or "terminate" in l)
    assert "exposed communication" in result.stdout
    single, parallel = (load_file(tmp_path / f"{k}.safetensors")["latents"] for k in "sp")
    assert (single - parallel).abs().max() <= 1e-5
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1} and any(e.get("cat") == "comm" for e in events)


def test_parallel_without_launcher_is_a_one_line_error(capsys, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert main(ARGS + ["--out", "x.gif", "--parallel", "dsp"]) == 2
    assert "torchrun --nproc-per-node P" in capsys.readouterr().err


def test_simulate_paper_scenario_json(tmp_path, capsys):
    assert main(["simulate", "--json", str(tmp_path / "sim.json")]) == 0
    report = json.loads((tmp_path / "sim.json").read_text())
    assert [r["nodes"] for r in report["rows"]] == [1, 2, 4]
    two = report["rows"][1]["schedules"]
    assert two["scalefusion"]["step_s"] < two["dsp"]["step_s"]  # overlap pays where the link is slow
    assert "paper" in capsys.readouterr().out


def test_simulator_basics():
    # a transfer that depends on compute, then compute that depends on it: strictly serial
    assert abs(run([Op("a", "compute", 1.0), Op("x", "link", 2.0, [0]), Op("b", "compute", 1.0, [1])]).step_s - 4) < 1e-9
    # independent: they overlap, and compute slows down while the link is busy
    assert abs(run([Op("a", "compute", 1.0), Op("x", "link", 1.0)], slowdown=1.0).step_s - 1.5) < 1e-9
    link = Link(8, 4, 1e9, 1e8, 1e-5)
    costs = StepCosts(4, 0.01, 0.005, 1e-4, 4e6, link, 0.05)
    dsp, sf = simulate("dsp", costs, 1), simulate("scalefusion", costs, 4)
    assert abs(dsp.step_s - dsp.compute_s - dsp.exposed_comm_s) < 1e-12 and sf.step_s < dsp.step_s
    free = StepCosts(4, 0.01, 0.005, 0.0, 0.0, Link(8, 8, 1e12, 1e12, 0.0))
    assert abs(simulate("scalefusion-inter", free, 8).step_s - simulate("dsp", free, 1).step_s) < 1e-9
    assert simulate("scalefusion", costs, 64).step_s > simulate("scalefusion", costs, 8).step_s  # overheads win


def test_paper_scenario_shape():
    report = paper_scenario(HARDWARE["a100"])
    assert report["rows"][0]["schedules"]["dsp"]["comm_share"] < report["rows"][1]["schedules"]["dsp"]["comm_share"]


TORCHRUN_ENV = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}  # never joined


@pytest.mark.parametrize("model, extra, env, message", [
    ("dit3d-tiny", ["--parallel", "dsp"], {}, "valid for DiT3D: ulysses"),
    ("dit3d-tiny", ["--parallel", "scalefusion", "--slices", "2"], {}, "valid for DiT3D: ulysses"),
    ("dit3d-tiny", ["--parallel", "ulysses"], TORCHRUN_ENV, "3 ranks > 2 heads of DiT3D"),
    ("dit3d-tiny", ["--parallel", "ulysses", "--cfg-parallel"], TORCHRUN_ENV, "cfg_parallel needs an even number"),
    ("stdit-tiny", ["--parallel", "ulysses", "--slices", "2"], {}, "ulysses --slices 2 slices full-3D attention"),
    ("stdit-tiny", ["--parallel", "dsp", "--slices", "4"], {}, "does not apply to the dsp schedule"),
    ("stdit-tiny", ["--parallel", "scalefusion", "--slices", "x"], {}, "--slices='x' must be an integer"),
    ("stdit-tiny", ["--slices", "2"], {}, "--slices applies to parallel runs only"),
    ("stdit-tiny", ["--trace", "t.json"], {}, "--trace applies to parallel runs only"),
    ("stdit-tiny", ["--cfg-parallel"], {}, "--cfg-parallel applies to parallel runs only"),
    ("dit3d-tiny", ["--parallel", "usp"], {}, "--parallel usp needs its degrees: --ulysses U and/or --ring R"),
    ("dit3d-tiny", ["--parallel", "usp", "--ulysses", "2", "--ring", "2"], TORCHRUN_ENV,
     "--ulysses 2 x --ring 2 = 4 must equal the ranks per sequence group (3); valid: --ulysses 1 --ring 3"),
    ("dit3d-tiny", ["--parallel", "usp", "--ring", "2"], TORCHRUN_ENV, "--ring 2 does not divide the 3 ranks"),
    ("dit3d-tiny", ["--parallel", "usp", "--ulysses", "3"], TORCHRUN_ENV, "--ulysses 3 splits attention heads: 3 > 2"),
    ("dit3d-tiny", ["--parallel", "ring", "--ring", "2"], {}, "--ring 2 applies to --parallel usp only"),
    ("dit3d-tiny", ["--ulysses", "2"], {}, "--ulysses applies to parallel runs only"),
    ("stdit-tiny", ["--parallel", "ring"], {}, "--parallel ring splits full-3D attention; STDiT has spatial/temporal"),
    ("stdit-tiny", ["--parallel", "auto"], {}, "--parallel auto splits full-3D attention"),
])
def test_bad_parallel_input_is_one_line_exit_2(tmp_path, capsys, monkeypatch, model, extra, env, message):
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    args = [a if a != "stdit-tiny" else model for a in ARGS] + ["--out", "x.gif"] + extra
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err, err
    assert list(tmp_path.iterdir()) == []  # nothing written
    if env:  # under torchrun only rank 0 says it; the others exit 2 in silence
        monkeypatch.setenv("RANK", "1")
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 2 and capsys.readouterr().err == ""
