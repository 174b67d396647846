"""Faults under real commands: kill -9 while the latent cache or an export is written, a damaged latest
checkpoint, a disk that fills during a checkpoint save or a spilled step. Each ends in one line,
loses nothing that was there, and leaves nothing that loads half-written.

The full disk is a small tmpfs mounted here (the test runs as root in CI containers); where mounting
is not allowed, the documented seam is used instead: `slidefusion.io.checkpoint.save_file`
replaced by one that raises ENOSPC, which is what safetensors raises on a full disk.
"""

import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slidefusion.cli import main
from slidefusion.io.partial import MARKER, hold
from slidefusion.io.checkpoint import load_checkpoint

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TINY = ["train", str(REPO / "configs" / "tiny.yaml"), "--quiet", "data.frames=2", "data.height=8", "data.width=8",
        "run.batch_size=2"]
# Run a slidefusion command in a child process that kills itself (SIGKILL) at the Nth call of `target`
# (module, attribute): a kill -9 at a known point of a write. Only this child's own test code is patched.
DIE_AT = """
import os, signal, sys, importlib
module, name, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
owner = importlib.import_module(module)
real, calls = getattr(owner, name), [0]
def dying(*args, **kwargs):
    calls[0] += 1
    if calls[0] == n:
        path = args[1] if len(args) > 1 else None
        if isinstance(path, (str, os.PathLike)) and not os.path.isdir(path):
            with open(path, "wb") as f:
                f.write(b"\\0" * 64)  # half a file, as a kill mid-write leaves it
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
setattr(owner, name, dying)
from slidefusion.cli import main
sys.exit(main(sys.argv[4:]))
"""


def _die_at(module: str, name: str, n: int, argv: list[str]) -> int:
    result = subprocess.run([sys.executable, "-c", DIE_AT, module, name, str(n), *argv], env=ENV, cwd=REPO,
                            capture_output=True, text=True, timeout=300)
    return result.returncode


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _finetune(wan: Path, out: Path, name: str, *extra: str) -> list[str]:
    return ["train", str(REPO / "configs" / "wan-finetune.yaml"), f"model.pretrained={wan}", "data.kind=shapes",
            "data.num_samples=3", "data.frames=5", "data.height=48", "data.width=80", "run.device=cpu", "run.steps=1",
            "run.batch_size=1", f"run.output_dir={out}", f"run.name={name}", "--quiet", *extra]


def test_kill_during_latent_caching_never_feeds_a_half_file_to_the_rerun(tiny_wan_dir, tmp_path):
    cache = tmp_path / "cache"
    argv = _finetune(tiny_wan_dir, tmp_path / "runs", "killed", f"data.cache_dir={cache}")
    assert _die_at("slidefusion.training.finetune.caches", "save_file", 3, argv) == -9  # the third clip's write
    complete = sorted((cache / "latents").glob("*/*.safetensors"))  # one folder per bucket
    half = [p for p in (cache / "latents").glob("*/*") if p.name.endswith(".tmp")]
    assert len(complete) == 2 and len(half) == 1, list((cache / "latents").rglob("*"))
    kept = {p: p.stat().st_mtime_ns for p in complete}
    assert main(argv) == 0  # the same command again, over what the kill left
    assert [p.name for p in (cache / "latents").glob("*/*") if not p.name.endswith(".safetensors")] == []
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items())  # complete entries reused as they were
    assert main(_finetune(tiny_wan_dir, tmp_path / "fresh", "fresh")) == 0  # uninterrupted, its own cache
    rerun = load_file(tmp_path / "runs" / "killed" / "checkpoint-1" / "model.safetensors")
    fresh = load_file(tmp_path / "fresh" / "fresh" / "checkpoint-1" / "model.safetensors")
    assert all(torch.equal(rerun[k], fresh[k]) for k in fresh)


def test_kill_during_export_leaves_no_folder_that_loads_and_the_next_export_cleans_up(tiny_pipeline_dir, tmp_path):
    wan = tmp_path / "wan"
    shutil.copytree(tiny_pipeline_dir("wan"), wan)
    assert main(_finetune(wan, tmp_path / "runs", "run")) == 0
    sources = {p: _digest(p) for p in (wan, tmp_path / "runs")}
    out = tmp_path / "exports" / "wan-ft"
    argv = ["export", "--checkpoint", str(tmp_path / "runs" / "run"), "--out", str(out), "--format", "diffusers"]
    assert _die_at("shutil", "copyfile", 3, argv) == -9  # halfway through copying the base folder's files
    left = [p.name for p in out.parent.iterdir()]
    assert not out.exists() and len(left) == 1 and re.match(r"^\.wan-ft-[a-z0-9_]{8}$", left[0]), left
    assert (out.parent / left[0] / MARKER).is_file()  # the killed writer's marker: this one is provably ours
    assert {p: _digest(p) for p in sources} == sources  # the run and its base folder untouched
    live = out.parent / ".wan-ft-abcdefgh"  # a writer still alive (this process holds its marker)
    live.mkdir()
    fd = hold(live / MARKER)
    mine = out.parent / ".wan-ft-12345678"  # a hidden folder of the user's with a name like ours, no marker
    mine.mkdir()
    try:
        assert main(argv) == 0
    finally:
        os.close(fd)
    assert sorted(p.name for p in out.parent.iterdir()) == sorted(["wan-ft", live.name, mine.name])
    import diffusers

    assert diffusers.WanPipeline.from_pretrained(out).transformer is not None


def test_a_truncated_latest_checkpoint_names_the_previous_good_one(tmp_path, capsys):
    out = tmp_path / "runs"
    assert main([*TINY, "run.steps=2", "run.save_every=1", f"run.output_dir={out}"]) == 0
    weights = out / "tiny" / "checkpoint-2" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    capsys.readouterr()
    assert main([*TINY, "run.steps=3", f"run.output_dir={out}", "--resume", "latest"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert f"checkpoint {out / 'tiny' / 'checkpoint-2'} cannot be read: model.safetensors" in err, err
    assert f"the previous good checkpoint is {out / 'tiny' / 'checkpoint-1'}" in err, err


@contextmanager
def small_disk(path: Path, size: str, monkeypatch):
    """A tmpfs of `size` at `path`; without the right to mount, the checkpoint writer's seam instead
    (yields False then: the caller fills nothing, every save fails as on a full disk)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True).returncode == 0
    if not mounted:
        def full(*args, **kwargs):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr("slidefusion.io.checkpoint.save_file", full)
    try:
        yield mounted
    finally:
        if mounted and subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)  # busy (an fd not yet closed): detach


def _fill(disk: Path, leave: int) -> Path:
    """A filler file that leaves `leave` bytes free on `disk`."""
    filler = disk / "filler"
    filler.write_bytes(b"\0" * max(0, shutil.disk_usage(disk).free - leave))
    return filler


def test_a_full_disk_during_a_checkpoint_save_is_one_line_and_the_previous_loads(tmp_path, capsys, monkeypatch):
    disk = tmp_path / "disk"
    with small_disk(disk, "4m", monkeypatch) as mounted:
        if not mounted:
            pytest.skip("no tmpfs here and the seam covers only the save: see the module docstring")
        out = disk / "runs"
        assert main([*TINY, "run.steps=1", f"run.output_dir={out}"]) == 0
        size = sum(p.stat().st_size for p in (out / "tiny" / "checkpoint-1").iterdir())
        filler = _fill(disk, size // 2)
        before = _digest(out / "tiny" / "checkpoint-1")
        capsys.readouterr()
        assert main([*TINY, "run.steps=2", f"run.output_dir={out}", "--resume", "latest"]) == 3
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert "stopped: the disk ran out of space writing checkpoint-2" in err and "it needs about" in err, err
        assert "checkpoint-1 is intact and --resume latest continues from it" in err, err
        assert sorted(p.name for p in (out / "tiny").iterdir()) == [".lock", "captions.safetensors", "checkpoint-1",
                                                                     "config.json", "metrics.jsonl"]
        assert _digest(out / "tiny" / "checkpoint-1") == before
        assert load_checkpoint(out / "tiny", with_state=True).state["step"] == 1
        filler.unlink()
        assert main([*TINY, "run.steps=2", f"run.output_dir={out}", "--resume", "latest"]) == 0


def test_a_full_spill_disk_is_refused_before_step_1_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    disk = tmp_path / "disk"
    with small_disk(disk, "1m", monkeypatch) as mounted:
        if not mounted:
            pytest.skip("no tmpfs here; tests/offload/test_offload_spill.py covers the engine's check with a seam")
        (disk / "spill").mkdir()
        _fill(disk, 8192)
        runs = tmp_path / "runs"
        capsys.readouterr()
        assert main([*TINY, "run.steps=2", "--offload", f"offload.spill_dir={disk / 'spill'}",
                     f"run.output_dir={runs}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "offload.spill_dir=" in err and "free" in err, err
        assert list((disk / "spill").iterdir()) == [] and not runs.exists()


@pytest.mark.parametrize("what", ["export", "cache", "latents"])
def test_a_full_disk_while_writing_is_one_line_and_leaves_nothing(what, tiny_wan_dir, tmp_path, capsys, monkeypatch):
    disk = tmp_path / "disk"
    with small_disk(disk, "1m", monkeypatch) as mounted:
        if not mounted:
            pytest.skip("no tmpfs here")
        if what == "export":
            run = _fine_tune_once(tiny_wan_dir, tmp_path)
            argv = ["export", "--checkpoint", str(run), "--out", str(disk / "out"), "--format", "diffusers"]
            needle, sources = "writing the export out in", {p: _digest(p) for p in (run, tiny_wan_dir)}
        elif what == "cache":
            argv = _finetune(tiny_wan_dir, tmp_path / "runs", "cached", f"data.cache_dir={disk / 'cache'}")
            needle, sources = "writing the latents cache", {tiny_wan_dir: _digest(tiny_wan_dir)}
        else:
            argv = ["generate", "--init", "random", "--model", "stdit-tiny", "--prompt", "x", "--steps", "1",
                    "--frames", "1", "--height", "4", "--width", "4", "--out", str(tmp_path / "v.gif"), "--quiet",
                    "--save-latents", str(disk / "l.safetensors")]
            needle, sources = "writing the latents l.safetensors", {}
        filler = _fill(disk, 0)
        capsys.readouterr()
        assert main(argv) == 3
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err and needle in err and "free some space" in err, err
        assert [p.name for p in disk.iterdir()] == [filler.name]  # no temporary left, no half output
        assert {p: _digest(p) for p in sources} == sources
        assert not (tmp_path / "runs").exists() and not (tmp_path / "v.gif").exists()


def _fine_tune_once(wan: Path, tmp_path: Path) -> Path:
    assert main(_finetune(wan, tmp_path / "ft", "run")) == 0
    return tmp_path / "ft" / "run"
