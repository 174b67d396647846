"""Bad input to the newer surface (diffusers folders and their fine-tunes, exports of them, sizes with
units, the caches), one class of mistake per block of rows. Every row must exit 2 with exactly one
stderr line that names the key (or file) and says what is valid, print no traceback, touch nothing
(the repository and the fixtures stay as they were) and leave no run folder behind, even where the
mistake shows only after work started (a component that loads last, a clip that does not decode).

Under a launcher every rank reads the same input: rank 0 says the line, the others exit 2 silently;
`test_every_rank_exits_2_and_the_line_comes_first` runs one row under torchrun.

To cover a new key or flag, add a row to ROWS (an invocation and the text its line must contain);
`{braces}` name what `world` builds once (damaged folders: tests/cli/damaged.py)."""

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import damaged
from slidefusion.cli import main

REPO = Path(__file__).resolve().parents[2]
GEN = "generate --prompt x --steps 1 --frames 5 --height 48 --width 80 --out {cwd}/v.gif --quiet --pretrained"
FT = ("train {wan_config} data.kind=shapes data.num_samples=2 data.frames=5 data.height=48 data.width=80 "
      "run.device=cpu run.steps=1 run.batch_size=1 run.output_dir={cwd}/runs --quiet")
PLAN = "plan --frames 5 --height 48 --width 80 --model"

ROWS = [
    # 1. export never over, into or around the base folder a fine-tune reads (model.pretrained), --force or not
    ("export --checkpoint {full} --out {base} --format diffusers --force", "is the base folder"),
    ("export --checkpoint {lora} --out {base} --format diffusers --force", "is the base folder"),
    ("export --checkpoint {full} --out {base} --force", "is the base folder"),
    ("export --checkpoint {full} --out {bases} --format diffusers --force", "holds the base folder"),
    ("export --checkpoint {lora} --out {base}/lora --format diffusers", "is inside the base folder"),
    # 3. a transformer config diffusers would build nonsense from (or for an hour): checked before building
    (f"{GEN} {{heads0}}", "num_attention_heads=0 must be an int >= 1"),
    (f"{GEN} {{heads_negative}}", "num_attention_heads=-2 must be an int >= 1"),
    (f"{GEN} {{layers_text}}", "num_layers='2' must be an int >= 1"),
    (f"{GEN} {{patch0}}", "patch_size=[1, 0, 2] must be 3 ints >= 1, like [1, 2, 2]"),
    (f"{GEN} {{ffn_nan}}", "ffn_dim=nan must be an int >= 1"),
    (f"{GEN} {{int_weight}}", "is stored as torch.int64"),
    (f"{GEN} {{layers0}}", "num_layers=0 must be an int >= 1"),
    (f"{GEN} {{layers_huge}}", "num_layers=1000000) but the weight files hold"),
    (f"{GEN} {{layers1}}", "the weight files hold 27 tensor(s) the model lacks"),
    (f"{GEN} {{rope_huge}}", "rope_max_seq_len) need"),
    (f"{FT} model.pretrained={{heads_negative}}", "num_attention_heads=-2 must be an int >= 1"),
    (f"{FT} model.pretrained={{layers_huge}}", "num_layers=1000000) but the weight files hold"),
    (f"{FT} model.pretrained={{int_weight}}", "is stored as torch.int64"),
    (f"{PLAN} {{heads_negative}}", "--model: "),
    (f"{PLAN} {{layers_huge}}", "num_layers=1000000) but the weight files hold"),
    (f"{PLAN} {{ffn_nan}}", "ffn_dim=nan must be an int >= 1"),
    # 4. model_index.json and the scheduler
    (f"{GEN} {{vae_entry}}", "model_index.json: vae=['diffusers'] must be a [library, class] pair"),
    (f"{GEN} {{vae_text}}", "model_index.json: vae='AutoencoderKLWan' must be a [library, class] pair"),
    (f"{GEN} {{boundary2}}", "boundary_ratio=2.0 must be a number in (0, 1)"),
    (f"{FT} model.pretrained={{boundary2}}", "boundary_ratio=2.0 must be a number in (0, 1)"),
    (f"{GEN} {{boundary_text}}", "boundary_ratio='half' must be a number in (0, 1)"),
    (f"{GEN} {{pipeline_unknown}}", "_class_name='FooPipeline' is not a diffusers pipeline class; valid: "),
    (f"{GEN} {{shift_nan}}", "flow_shift=nan must be a finite number"),
    (f"{FT} model.pretrained={{shift_nan}}", "flow_shift=nan must be a finite number"),
    # 5. damaged components, and a cache folder that cannot be one
    (f"{GEN} {{cut_text_encoder}}", "component text_encoder/ does not load"),
    (f"{FT} model.pretrained={{cut_text_encoder}}", "component text_encoder/ does not load"),
    (f"{FT} model.pretrained={{base}} data.cache_dir={{file}}", "data.cache_dir="),
    (f"{FT} model.pretrained={{base}} data.cache_dir=/sys/kernel", "data.cache_dir='/sys/kernel' cannot be written"),
    # 6. what the export copies from the base folder
    ("export --checkpoint {fifo_run} --out {cwd}/e --format diffusers", "holds notes.pipe, a named pipe"),
    ("export --checkpoint {loop_run} --out {cwd}/e --format diffusers", "holds loop, a link that leads nowhere"),
    # 9. found after work started (the VAE loaded, clips cached): still nothing left behind
    (f"{FT} model.pretrained={{garbage_tokenizer}}", "component tokenizer/ does not load"),
    (f"{FT} model.pretrained={{no_text_encoder}}", "component text_encoder/ is listed in model_index.json but missing"),
    (f"{FT} model.pretrained={{base}} data.kind=folder data.root={{videos}} data.resolution=null "
     "data.frame_buckets=null data.strict=true", "bad.mp4"),
    # sizes need their unit, on the command line and in a config
    ("plan --model wan2.1-14b --frames 81 --height 480 --width 832 --gpu-memory 24", "'24' has no unit; write e.g. 24GB"),
    ("plan --model wan2.1-14b --frames 81 --height 480 --width 832 --host-memory 1.5T", "'1.5T' is ambiguous"),
    ("export --checkpoint {full} --out {cwd}/e --format diffusers --max-shard-size 5000", "--max-shard-size"),
    (f"{FT} model.pretrained={{base}} --offload offload.spill_dir={{cwd}} offload.spill_after=64",
     "offload.spill_after=64 has no unit"),
    (f"{FT} model.pretrained={{base}} --offload offload.pin_budget=100", "offload.pin_budget=100 has no unit"),
]


def _fine_tune(base: Path, runs: Path, name: str, *extra: str) -> Path:
    args = shlex.split(FT.format(wan_config=REPO / "configs" / "wan-finetune.yaml", cwd=runs.parent))
    args = [a for a in args if not a.startswith("run.output_dir=")]
    assert main([*args, f"model.pretrained={base}", f"run.output_dir={runs}", f"run.name={name}", *extra]) == 0
    return runs / name


def _videos(folder: Path) -> Path:
    """A data folder: one clip that decodes, one that does not (after it, so the first is cached)."""
    from slidefusion.data.video_io import write_video

    folder.mkdir()
    write_video(folder / "good.gif", torch.zeros(3, 5, 48, 80), fps=8, upscale=1)
    (folder / "bad.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42 but then nothing useful" * 4)
    for name in ("good", "bad"):
        (folder / f"{name}.txt").write_text("a red circle moving left")
    return folder


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_wan_dir):
    root = tmp_path_factory.mktemp("bad-folders")
    bases = root / "bases"
    base = bases / "wan"
    shutil.copytree(tiny_wan_dir, base)
    dmg = root / "damaged"
    dmg.mkdir()
    made = {
        "heads0": damaged.transformer_config(base, dmg, "heads0", num_attention_heads=0),
        "heads_negative": damaged.transformer_config(base, dmg, "heads-negative", num_attention_heads=-2),
        "layers_text": damaged.transformer_config(base, dmg, "layers-text", num_layers="2"),
        "patch0": damaged.transformer_config(base, dmg, "patch0", patch_size=[1, 0, 2]),
        "ffn_nan": damaged.raw_transformer_config(base, dmg, "ffn-nan", "ffn_dim", "NaN"),
        "int_weight": damaged.int_weight(base, dmg, "int-weight"),
        "layers0": damaged.transformer_config(base, dmg, "layers0", num_layers=0),
        "layers1": damaged.transformer_config(base, dmg, "layers1", num_layers=1),
        "layers_huge": damaged.transformer_config(base, dmg, "layers-huge", num_layers=1_000_000),
        "rope_huge": damaged.transformer_config(base, dmg, "rope-huge", rope_max_seq_len=10**12),
        "vae_entry": damaged.model_index(base, dmg, "vae-entry", vae=["diffusers"]),
        "vae_text": damaged.model_index(base, dmg, "vae-text", vae="AutoencoderKLWan"),
        "boundary2": damaged.model_index(base, dmg, "boundary2", boundary_ratio=2.0),
        "boundary_text": damaged.model_index(base, dmg, "boundary-text", boundary_ratio="half"),
        "pipeline_unknown": damaged.model_index(base, dmg, "pipeline-unknown", _class_name="FooPipeline"),
        "shift_nan": damaged.scheduler_config(base, dmg, "shift-nan", "flow_shift", "NaN"),
        "cut_text_encoder": damaged.truncated(base, dmg, "cut-text-encoder", "text_encoder"),
        "garbage_tokenizer": damaged.garbage_tokenizer(base, dmg, "garbage-tokenizer"),
        "no_text_encoder": damaged.without(base, dmg, "no-text-encoder", "text_encoder"),
    }
    runs = root / "runs"
    fifo, loop = (damaged.special_file(base, dmg, kind, kind) for kind in ("fifo", "loop"))
    paths = {"root": root, "bases": bases, "base": base, "cwd": root / "cwd", "file": root / "file.txt",
             "wan_config": REPO / "configs" / "wan-finetune.yaml", "videos": _videos(root / "videos"),
             "full": _fine_tune(base, runs, "full"), "lora": _fine_tune(base, runs, "lora", "lora.rank=4"),
             "fifo_run": _fine_tune(fifo, runs, "fifo"), "loop_run": _fine_tune(loop, runs, "loop"), **made}
    paths["cwd"].mkdir()
    paths["file"].write_text("a file")
    return {k: str(v) for k, v in paths.items()}


def _snapshot(*folders: Path) -> dict[str, tuple[int, int]]:
    """Every entry under `folders` with its size and mtime (folders' own mtimes and the run locks'
    contents aside), skipping caches and the venv."""
    skip = {".venv", ".git", "__pycache__", ".pytest_cache", ".ruff_cache"}
    seen = {}
    for folder in folders:
        for parent, dirs, files in os.walk(folder):
            dirs[:] = [d for d in dirs if d not in skip]
            seen.update({os.path.join(parent, d): (-1, -1) for d in dirs})
            for name in files:
                stat = os.lstat(os.path.join(parent, name))
                seen[os.path.join(parent, name)] = (stat.st_size, stat.st_mtime_ns) if name != ".lock" else (0, 0)
    return seen


def _run(world, argv: str, capsys, monkeypatch) -> tuple[int, str]:
    monkeypatch.chdir(world["cwd"])
    code = main(shlex.split(argv.format(**world)))
    return code, capsys.readouterr().err


@pytest.mark.parametrize("argv, needle", ROWS, ids=[f"{i:02d} {a[-60:]}" for i, (a, _) in enumerate(ROWS)])
def test_bad_input_to_the_newer_surface_exits_2_in_one_line(world, argv, needle, capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    before = _snapshot(Path(world["root"]), REPO)
    code, err = _run(world, argv, capsys, monkeypatch)
    lines = err.splitlines()
    assert code == 2, (argv, code, err)
    assert len(lines) == 1 and err.endswith("\n"), err
    assert lines[0].startswith("slidefusion") and ": error: " in lines[0] and "Traceback" not in err, lines[0]
    assert needle in lines[0], (needle, lines[0])
    assert _snapshot(Path(world["root"]), REPO) == before, "a file was written, changed or left behind"


# one row per command and stage: export, generate, plan, and train failing late (after the VAE and a clip)
LAUNCHED = [next(argv for argv, needle in ROWS if needle == wanted and argv.startswith(command)) for command, wanted in (
    ("export", "is the base folder"), ("generate", "num_attention_heads=0 must be an int >= 1"),
    ("plan", "ffn_dim=nan must be an int >= 1"), ("train", "component tokenizer/ does not load"),
    ("train", "bad.mp4"))]


@pytest.mark.parametrize("argv", LAUNCHED)
def test_under_a_launcher_the_other_ranks_exit_2_silently(world, argv, capsys, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    before = _snapshot(Path(world["root"]))
    assert _run(world, argv, capsys, monkeypatch) == (2, "")
    assert _snapshot(Path(world["root"])) == before


def test_every_rank_exits_2_and_the_line_comes_first(world):
    argv = shlex.split(f"{GEN} {{pipeline_unknown}} --parallel ulysses --timeout 60".format(**world))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    from slidefusion.parallel.launch import free_port

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "slidefusion", *argv]
    before = _snapshot(Path(world["root"]))
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    ours = [line for line in result.stderr.splitlines() if line.startswith("slidefusion ") and ": error: " in line]
    assert len(ours) == 1 and "_class_name='FooPipeline'" in ours[0] and "error:" in ours[0], result.stderr[-3000:]
    first = next(line for line in result.stderr.splitlines() if line.strip() and not line.startswith(("W", "*")))
    assert first == ours[0], result.stderr[-3000:]  # before anything torchrun adds
    codes = [line.split(":")[1].split()[0] for line in result.stderr.splitlines() if line.strip().startswith("exitcode")]
    # every rank failed as bad input, none crashed; torchrun may stop (SIGTERM, -15) a rank still
    # exiting once another has left: the launcher's wait for rank 0 (parallel/cli.py) removes that race
    assert codes and all(code in ("2", "-15") for code in codes) and "2" in codes, codes
    assert "Traceback" not in result.stderr.split(ours[0])[0]
    assert _snapshot(Path(world["root"])) == before


def test_a_vae_that_decodes_nan_stops_in_one_line_and_writes_no_grey_video(tiny_wan_dir, tmp_path, capsys):
    from slidefusion.errors import NonFiniteError
    from slidefusion.pipeline import FolderPipeline

    folder = damaged.nan_decoder(tiny_wan_dir, tmp_path, "nan-decoder")  # finite latents, NaN pixels
    out = tmp_path / "out"
    argv = shlex.split(f"{GEN} {folder}".format(cwd=out)) + ["--save-latents", str(out / "l.safetensors")]
    assert main(argv) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stopped: decoding produced NaN or infinite pixels" in err, err
    assert not (out / "v.gif").exists()  # the latents (finite) were written first; no video from NaN pixels
    pipe = FolderPipeline.from_pretrained(folder)
    with pytest.raises(NonFiniteError, match="decoding produced NaN"):
        pipe("x", num_frames=5, height=48, width=80, num_inference_steps=1, seed=0)


def test_save_pretrained_never_over_into_or_around_its_source(tiny_wan_dir, tmp_path):
    from slidefusion.errors import UserError
    from slidefusion.pipeline import FolderPipeline

    source = tmp_path / "models" / "wan"
    shutil.copytree(tiny_wan_dir, source)
    pipe = FolderPipeline.from_pretrained(source)
    before = _snapshot(tmp_path)
    for target in (source, source / "copy", source.parent):
        with pytest.raises(UserError, match="these components were loaded from"):
            pipe.save_pretrained(target, force=True)
    assert _snapshot(tmp_path) == before
