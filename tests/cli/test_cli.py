import subprocess
import sys

import pytest
import torch

from slidefusion.cli import main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "slidefusion", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("args, message", [
    (["train", "configs/tiny.yaml", "optim.lrr=1"], "unknown config key optim.lrr"),
    (["train", "configs/tiny.yaml", "data.height=15"], "height=15 must be a positive multiple of DiT3D's patch size 2"),
    (["train", "missing.yaml"], "config file missing.yaml does not exist"),
    (["generate", "--checkpoint", "no/such/dir", "--prompt", "a red circle"], "checkpoint no/such/dir not found"),
])
def test_user_mistakes_exit_2_with_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_bad_flag_value_exits_2_without_traceback():
    result = _run("generate", "--checkpoint", "x", "--prompt", "p", "--steps", "0")
    assert result.returncode == 2 and "Traceback" not in result.stderr and "--steps" in result.stderr


def test_train_then_generate_end_to_end(tmp_path):
    run = tmp_path / "runs"
    result = _run("train", "configs/tiny.yaml", f"run.output_dir={run}", "run.steps=4", "run.save_every=2", "--quiet")
    assert result.returncode == 0, result.stderr
    assert (run / "tiny" / "checkpoint-4" / "model.safetensors").is_file()
    out = tmp_path / "v.gif"
    result = _run("generate", "--checkpoint", str(run / "tiny"), "--prompt", "a red circle moving left",
                  "--steps", "2", "--out", str(out), "--quiet")
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 0
    result = _run("train", "configs/tiny.yaml", f"run.output_dir={run}", "run.steps=6", "--resume", "latest", "--quiet")
    assert result.returncode == 0 and "at step 4" in result.stdout, result.stderr
    result = _run("generate", "--checkpoint", str(run / "tiny"), "--prompt", "x", "--out", str(tmp_path / "v.avi"))
    assert result.returncode == 2 and "Traceback" not in result.stderr


def test_generate_random_init_saves_latents(tmp_path):
    from safetensors.torch import load_file

    path = tmp_path / "lat.safetensors"
    args = ["generate", "--init", "random", "--model", "stdit-tiny", "--prompt", "a blue square", "--steps", "2",
            "--frames", "3", "--height", "6", "--width", "10", "--out", str(tmp_path / "v.gif"),
            "--save-latents", str(path), "--quiet"]
    assert main(args) == 0
    first = load_file(path)["latents"]
    assert first.shape == (1, 3, 3, 6, 10)
    assert main(args) == 0 and torch.equal(load_file(path)["latents"], first)  # same seed, same latents
    assert main(args + ["--seed", "1"]) == 0 and not torch.equal(load_file(path)["latents"], first)


def test_generate_needs_a_checkpoint_or_random_init(capsys):
    assert main(["generate", "--prompt", "x"]) == 2
    assert "--checkpoint DIR is required" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--init", "random"]) == 2


def test_unreadable_video_in_a_folder_dataset_exits_2(tmp_path, capsys):
    folder = tmp_path / "videos"
    folder.mkdir()
    (folder / "clip.mp4").write_bytes(b"not really an mp4")
    (folder / "captions.csv").write_text("file,caption\nclip.mp4,a red circle\n")
    args = ["train", "configs/tiny.yaml", "data.kind=folder", f"data.root={folder}",
            f"run.output_dir={tmp_path / 'runs'}", "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "none of its 1 files is usable (1 unreadable)" in err and "clip.mp4" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()  # checked before the run folder is made


def test_sampling_that_produces_nan_stops_with_exit_3_and_writes_nothing(tmp_path, monkeypatch, capsys):
    import slidefusion.pipeline.ours as pipeline

    monkeypatch.setattr(pipeline, "sample", lambda *args, **kwargs: torch.full((1, 3, 1, 4, 4), float("nan")))
    out = tmp_path / "v.gif"
    code = main(["generate", "--init", "random", "--model", "stdit-tiny", "--prompt", "x", "--steps", "1",
                 "--frames", "1", "--height", "4", "--width", "4", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and "sampling produced NaN or infinite latents" in err
    assert list(tmp_path.iterdir()) == []


def test_export_replaces_an_earlier_export_only_with_force(tmp_path, capsys):
    from slidefusion.models import build_model, preset
    from slidefusion.io.checkpoint import save_checkpoint

    model = build_model(preset("dit3d-tiny"))
    source = save_checkpoint(tmp_path / "run", 3, {"a": 1}, model.state_dict(), state={"step": 3})
    before = {p.name: p.read_bytes() for p in source.iterdir()}
    out = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(source), "--out", str(out)]) == 0
    (out / "note.txt").write_text("mine")
    assert main(["export", "--checkpoint", str(source), "--out", str(out)]) == 2
    assert "already exists; add --force" in capsys.readouterr().err and (out / "note.txt").exists()
    assert main(["export", "--checkpoint", str(source), "--out", str(out), "--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert {p.name: p.read_bytes() for p in source.iterdir()} == before  # the source is never touched
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no .old-* left behind


def test_overrides_may_follow_flags(tmp_path):
    assert main(["train", "configs/tiny.yaml", "--quiet", f"run.output_dir={tmp_path}", "run.steps=1",
                 "data.frames=2", "data.height=8", "data.width=8"]) == 0
    assert (tmp_path / "tiny" / "checkpoint-1").is_dir()
