"""The fine-tune trainer on a folder of mixed media (tiny random Wan folder): trains on every usable file
in buckets, resumes exactly across an epoch boundary (offloaded LoRA, grad_accum, cosine), grad_accum
equals a larger batch end to end, validation samples equal `generate --checkpoint` at their step,
`slidefusion cache` fills what `train` then reuses, a failed run leaves no run folder, and the
loggers (W&B, TensorBoard) get the numbers and videos."""

import json
import sys
import types

import pytest
import torch
from safetensors.torch import load_file

from slidefusion.cli import main
from slidefusion.testing.media import make_folder
from slidefusion.training import Trainer, load_config

CONFIG = "configs/wan-finetune.yaml"
FILES = [("clip.mp4", 9, 48, 80), ("portrait.mov", 13, 80, 48), ("still.png", 1, 64, 48), ("anim.gif", 5, 32, 32),
         ("wide.mkv", 9, 48, 96)]
BUCKETED = ["data.resolution=[80, 48]", "data.frame_buckets=[1, 5, 9]"]


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    """FILES captioned, a clip without a caption and a damaged one (skipped, not strict)."""
    root = make_folder(tmp_path_factory.mktemp("media"), FILES)
    (root / "nocap.mp4").write_bytes((root / "clip.mp4").read_bytes())
    (root / "bad.mp4").write_bytes(b"damaged")
    (root / "bad.txt").write_text("a damaged clip")
    return root


def _args(folder, data, out, name, *extra):
    return ["train", CONFIG, f"model.pretrained={folder}", f"data.root={data}", "run.device=cpu", "run.batch_size=1",
            "run.save_every=100", "run.log_every=1", f"run.output_dir={out}", f"run.name={name}", "optim.lr=1e-3",
            "optim.warmup_steps=0", "offload.compute_dtype=float32", "--quiet", *extra]


def _losses(run):
    return [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def _latest(run):
    steps = sorted(int(p.name.split("-")[1]) for p in run.glob("checkpoint-*"))
    return load_file(run / f"checkpoint-{steps[-1]}" / "model.safetensors")


def test_a_mixed_folder_trains_in_buckets_and_resumes_exactly_across_an_epoch(tiny_wan_dir, media, tmp_path, capsys):
    """4 steps per epoch (5 clips in 4 buckets, 2 clips a step: 9x48x80 holds two); 2 epochs straight,
    or 3 steps then --resume latest through the boundary: the same losses and weights, bitwise."""
    common = [*BUCKETED, "run.grad_accum=2", "run.epochs=2", "optim.schedule=cosine", "lora.rank=4", "--offload"]
    assert main(_args(tiny_wan_dir, media, tmp_path, "straight", *common)) == 0
    straight = _losses(tmp_path / "straight")
    assert len(straight) == 8
    split = _args(tiny_wan_dir, media, tmp_path, "split", *common)
    first = Trainer(load_config(CONFIG, [a for a in split[2:] if not a.startswith("--")] + ["offload.enabled=true"]),
                    quiet=True)
    assert first.total_steps == 8
    first.train(until=3)  # stopped in epoch 0 (as by a kill after its checkpoint)
    assert main([*split, "--resume", "latest"]) == 0
    assert _losses(tmp_path / "split") == straight
    a, b = _latest(tmp_path / "straight"), _latest(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    latents = sorted(p.parent.name for p in (tmp_path / "straight" / "cache" / "latents").rglob("*.safetensors"))
    assert len(latents) == len(FILES) and sorted(set(latents)) == ["1x80x48", "5x48x64", "9x48x80", "9x80x48"]


def test_the_tables_are_printed_before_any_work(tiny_wan_dir, media, tmp_path, capsys):
    args = [a for a in _args(tiny_wan_dir, media, tmp_path, "tables", *BUCKETED, "run.steps=1") if a != "--quiet"]
    assert main(args) == 0
    out = capsys.readouterr().out
    table, buckets = out.index("no caption"), out.index("clips/epoch")
    assert table < out.index("cached") < buckets < out.index("trained 1 steps")
    row = next(line for line in out.splitlines() if line.startswith("data.root="))
    assert row.split()[1:7] == ["7", "5", "5", "1", "1", "0"]  # found, used, clips, no caption, unreadable, too short
    for bucket in ("9x48x80", "9x80x48", "1x80x48", "5x48x64"):
        assert bucket in out[buckets:], bucket


@pytest.mark.parametrize("offload", [[], ["lora.rank=4", "--offload"]], ids=["resident-full", "offloaded-lora"])
def test_grad_accum_trains_as_a_batch_that_many_times_larger(tiny_wan_dir, tmp_path, offload):
    shapes = ["data.kind=shapes", "data.root=null", "data.num_samples=4", "data.frames=5", "data.height=48",
              "data.width=80", "run.steps=3", "optim.eps=0.1", *offload]
    assert main(_args(tiny_wan_dir, "x", tmp_path, "large", *shapes, "run.batch_size=2")) == 0
    assert main(_args(tiny_wan_dir, "x", tmp_path, "accum", *shapes, "run.batch_size=1", "run.grad_accum=2")) == 0
    torch.testing.assert_close(_losses(tmp_path / "accum"), _losses(tmp_path / "large"), rtol=1e-5, atol=0)
    a, b = _latest(tmp_path / "accum"), _latest(tmp_path / "large")
    for name in b:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("offload", [[], ["--offload"]], ids=["resident", "offloaded"])
def test_validation_samples_equal_generate_at_that_step(tiny_wan_dir, media, tmp_path, monkeypatch, offload):
    from slidefusion.pipeline import VideoPipeline
    from slidefusion.training.validation import Validator

    drawn, original = {}, Validator.sample_latents

    def record(self, model, device, prompt, seed):
        latents = original(self, model, device, prompt, seed)
        drawn[(len(drawn), prompt, seed)] = latents.clone()
        return latents

    monkeypatch.setattr(Validator, "sample_latents", record)
    held_out = make_folder(tmp_path / "held-out", [("h.mp4", 9, 48, 80)])
    validate = ["validate.prompts=[a red fox, a blue car]", "validate.every=2", "validate.steps=2", "validate.frames=5",
                "validate.height=48", "validate.width=80", "validate.guidance=3.0", "validate.seed=5",
                f"validate.data=[{{root: {held_out}}}]", "run.save_every=2"]
    assert main(_args(tiny_wan_dir, media, tmp_path, "val", *BUCKETED, "run.steps=3", *validate, *offload)) == 0
    run = tmp_path / "val"
    assert sorted(p.name for p in (run / "samples" / "step-2").iterdir()) == ["00-a-red-fox.mp4", "01-a-blue-car.mp4"]
    assert (run / "samples" / "step-3").is_dir()  # the last step validates too
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    held = [r["heldout_loss"] for r in records if "heldout_loss" in r]
    assert len(held) == 2 and all(r["validation_s"] > 0 for r in records if "validation_s" in r)
    pipe = VideoPipeline.from_checkpoint(run / "checkpoint-2")
    for (number, prompt, seed), latents in list(drawn.items())[:2]:  # step 2's samples
        expected = pipe.latents(prompt, frames=5, height=48, width=80, steps=2, guidance=3.0, seed=seed, progress=False)
        torch.testing.assert_close(latents, expected, rtol=1e-5, atol=1e-5)
    assert [s for _, _, s in drawn] == [5, 6, 5, 6]


def test_cache_then_train_reuses_the_caches(tiny_wan_dir, media, tmp_path):
    args = _args(tiny_wan_dir, media, tmp_path, "cached", *BUCKETED, "run.steps=1")
    assert main(["cache", *args[1:]]) == 0
    cache = tmp_path / "cached" / "cache"
    files = {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")}
    assert len(files) == len(FILES) + len(FILES) + 1  # latents; captions and ""
    assert not (tmp_path / "cached" / "config.json").exists()
    assert main(args) == 0
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("*.safetensors")} == files


def test_a_failed_run_leaves_no_run_folder(tiny_wan_dir, media, tmp_path, monkeypatch, capsys):
    from slidefusion.core.errors import UserError
    from slidefusion.training.finetune.caches import FinetuneCache

    assert main(_args(tiny_wan_dir, media, tmp_path, "strict", *BUCKETED, "data.strict=true")) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "data.strict=true: 2 file(s) skipped" in err
    assert not (tmp_path / "strict").exists()

    def fail(self, *args, **kwargs):
        raise UserError("cannot read video x.mp4: it ended early")

    monkeypatch.setattr(FinetuneCache, "fill", fail)  # a file that probed fine, damaged further in
    assert main(_args(tiny_wan_dir, media, tmp_path, "late", *BUCKETED, "run.steps=1")) == 2
    assert not (tmp_path / "late").exists() and list(tmp_path.iterdir()) == []


def test_wandb_gets_the_numbers_and_the_samples(tiny_wan_dir, media, tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = types.SimpleNamespace(name="wandb")

    class Run:
        def log(self, values, step):
            calls.append(("log", step, sorted(values)))

        def finish(self):
            calls.append(("finish",))

    fake.init = lambda **kwargs: calls.append(("init", kwargs["project"], kwargs["id"])) or Run()
    fake.Video = lambda path, format: ("video", path, format)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: object() if name == "wandb" else None)
    validate = ["validate.prompts=[a fox]", "validate.every=2", "validate.steps=1", "validate.frames=1",
                "validate.height=48", "validate.width=80"]
    assert main(_args(tiny_wan_dir, media, tmp_path, "logged", *BUCKETED, "run.steps=2", "run.wandb=my-project",
                      *validate)) == 0
    assert calls[0][:2] == ("init", "my-project") and calls[-1] == ("finish",)
    logged = [c for c in calls if c[0] == "log"]
    assert ("log", 1, ["train/elapsed_s", "train/loss", "train/lr"]) in logged
    assert ("log", 2, ["validate/00"]) in logged and ("log", 2, ["validate/samples", "validate/validation_s"]) in logged


def test_missing_wandb_is_one_line_before_any_work(tiny_wan_dir, media, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *a: None)
    assert main(_args(tiny_wan_dir, media, tmp_path, "nowandb", "run.wandb=proj")) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "pip install 'slidefusion[wandb]'" in err and not (tmp_path / "nowandb").exists()


def test_device_auto_says_which_it_chose(tmp_path, capsys):
    config = load_config("configs/tiny.yaml", ["run.device=auto", "data.frames=2", "data.height=8", "data.width=8",
                                               "run.steps=1", f"run.output_dir={tmp_path}"])
    trainer = Trainer(config)
    assert trainer.config.run.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert f"run.device=auto: training on {trainer.config.run.device}" in capsys.readouterr().out


def test_our_own_models_take_grad_accum_epochs_and_a_schedule(tmp_path):
    config = load_config("configs/tiny.yaml", ["data.frames=2", "data.height=8", "data.width=8", "data.num_samples=6",
                                               "run.batch_size=2", "run.grad_accum=2", "run.epochs=2", "optim.schedule=linear",
                                               "optim.warmup_steps=0", "run.log_every=1", f"run.output_dir={tmp_path}"])
    trainer = Trainer(config, quiet=True)
    assert trainer.total_steps == 2 * 2  # ceil(6 clips / (2 x 2)) steps per epoch
    assert len(trainer.train().losses) == 4
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines())]
    assert lrs == pytest.approx([config.optim.lr * (1 - k / 4) for k in range(4)])
