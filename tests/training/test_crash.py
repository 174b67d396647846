"""kill -9 a real `slidefusion train` at random points, during checkpoint saves too, resume it each
time with `--resume latest`, and check the result against an uninterrupted run: the same loss for
every step (each logged once) and the same final weights, bit for bit."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slidefusion.io.checkpoint import TEMPORARY, checkpoint_steps

REPO = Path(__file__).resolve().parents[2]
STEPS = 24
ARGS = ["train", str(REPO / "configs" / "tiny.yaml"), "--quiet", "data.frames=2", "data.height=8", "data.width=8",
        "data.num_samples=2", "run.batch_size=2", f"run.steps={STEPS}", "run.save_every=1", "run.log_every=1",
        "run.keep_last=2"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _train(out: Path, resume: bool) -> subprocess.Popen:
    extra = ["--resume", "latest"] if resume else []
    return subprocess.Popen([sys.executable, "-m", "slidefusion", *ARGS, f"run.output_dir={out}", *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, cwd=REPO)


def _records(run: Path) -> int:
    path = run / "metrics.jsonl"
    return path.read_bytes().count(b"\n") if path.is_file() else 0


def _temporaries(run: Path) -> list[str]:
    return [p.name for p in run.iterdir() if TEMPORARY.match(p.name)] if run.is_dir() else []


def _kill_at(proc: subprocess.Popen, run: Path, during_save: bool, delay: float) -> bool:
    """SIGKILL `proc` once it has logged a new step: at once when a checkpoint is being written
    (`during_save`), else `delay` seconds later. False if it finished first."""
    start, deadline = _records(run), time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        if _records(run) > start and (not during_save or _temporaries(run)):
            if not during_save:
                time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            return True
        time.sleep(0.0005)
    return False


def _losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_matches_an_uninterrupted_run(tmp_path):
    reference = _train(tmp_path / "straight", resume=False)  # runs alongside the killed ones
    run = tmp_path / "killed" / "tiny"
    rng = random.Random(15)
    kinds = rng.sample([True] * 3 + [False] * 3, 6)  # 3 kills inside a save, 3 at random moments
    caught_in_save = 0
    for during_save in kinds:
        proc = _train(tmp_path / "killed", resume=bool(checkpoint_steps(run)))
        if not _kill_at(proc, run, during_save, rng.uniform(0.0, 0.3)):
            assert proc.returncode == 0, proc.stderr.read().decode()
            break  # it finished before this kill: the remaining trials have nothing to interrupt
        assert proc.returncode == -signal.SIGKILL, proc.stderr.read().decode()  # not an error of its own
        caught_in_save += bool(during_save and _temporaries(run))
    final = _train(tmp_path / "killed", resume=bool(checkpoint_steps(run)))
    assert final.wait(timeout=300) == 0, final.stderr.read().decode()
    assert reference.wait(timeout=300) == 0, reference.stderr.read().decode()
    assert caught_in_save >= 1  # at least one kill left a half-written checkpoint behind
    assert _temporaries(run) == []  # ... and the next start removed it
    straight = tmp_path / "straight" / "tiny"
    assert _losses(run) == _losses(straight) and [s for s, _ in _losses(run)] == list(range(1, STEPS + 1))
    for name in ("model.safetensors", "ema.safetensors"):
        ours, theirs = load_file(run / f"checkpoint-{STEPS}" / name), load_file(straight / f"checkpoint-{STEPS}" / name)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
