"""Ranks that die, never join, or read a bad command line: each surviving rank ends in one line
(exit 3 for a failed group, exit 2 for bad input said by rank 0 alone), never a traceback or a hang.

The ranks are started here as torchrun would start them (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the
environment), without its agent, so that the test holds each rank's process and can kill one."""

import os
import select
import subprocess
import sys
import time

import pytest

from slidefusion.cli import main
from slidefusion.parallel.launch import free_port

ARGS = ["-m", "slidefusion", "generate", "--init", "random", "--model", "stdit-tiny", "--prompt", "a blue square",
        "--frames", "3", "--height", "6", "--width", "10", "--parallel", "ulysses", "--timeout", "8"]


def _rank(rank: int, world: int, port: int, out, *extra) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, *ARGS, "--out", str(out), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def _read_until(proc: subprocess.Popen, needle: bytes, deadline: float) -> bytes:
    """rank 0's stderr up to `needle` (its progress bar has no line ends, so bytes as they come)."""
    seen = b""
    while needle not in seen and time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stderr], [], [], 1.0)
        if ready:
            seen += os.read(proc.stderr.fileno(), 65536)
    return seen


def _finish(proc: subprocess.Popen, seen: bytes = b"", timeout: float = 120) -> tuple[int, list[str]]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        proc.kill()  # only if it still runs: our own child, by its handle
    text = (seen + err).decode(errors="replace").replace("\r", "\n")
    return proc.returncode, [line for line in text.splitlines() if line.strip() and "sampling" not in line]


def test_a_killed_peer_and_a_peer_that_never_joins_end_in_one_line(tmp_path):
    # a group of two that loses rank 1 mid-sampling, and, beside it, a rank 0 whose peer never starts
    port, lonely_port = free_port(), free_port()
    survivor = _rank(0, 2, port, tmp_path / "a.gif", "--steps", "5000")
    victim = _rank(1, 2, port, tmp_path / "b.gif", "--steps", "5000", "--quiet")
    lonely = _rank(0, 2, lonely_port, tmp_path / "c.gif", "--steps", "2", "--quiet")
    seen = _read_until(survivor, b"sampling", time.monotonic() + 240)
    assert b"sampling" in seen, seen.decode(errors="replace")[-2000:]
    victim.kill()  # mid-sampling, as an OOM killer would
    killed_at = time.monotonic()
    code, lines = _finish(survivor, seen)
    assert time.monotonic() - killed_at < 60  # a closed socket ends the wait well before the job would
    assert code == 3 and len(lines) == 1, lines
    assert lines[0].startswith("slidefusion generate: stopped: rank 0: the process group failed:"), lines
    assert not any(p.exists() for p in tmp_path.iterdir())  # no video from a broken group
    victim.communicate(timeout=30)
    start = time.monotonic()
    code, lines = _finish(lonely)
    assert code == 3 and len(lines) == 1 and "1/2 clients joined" in lines[0], lines
    assert "Traceback" not in lines[0] and time.monotonic() - start < 120


@pytest.mark.parametrize("argv", [
    ["generate", "--prompt", "x", "--bogus", "1"],  # argparse
    ["generate", "--prompt", "x", "--init", "random", "--model", "stdit-tiny", "--frames", "1", "--height", "5", "--width", "4",
     "--out", "v.gif"],
    ["train", "configs/tiny.yaml", "optim.lr=-1"],
])
def test_bad_input_under_a_launcher_is_said_by_rank_0_alone(argv, capsys, monkeypatch, tmp_path):
    repo = os.getcwd()
    monkeypatch.chdir(tmp_path)
    argv = [a.replace("configs/", f"{repo}/configs/") for a in argv]
    for rank, lines in (("0", 1), ("1", 0), ("3", 0)):
        monkeypatch.setenv("RANK", rank)
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == lines and "Traceback" not in err, (rank, err)
    assert list(tmp_path.iterdir()) == []
