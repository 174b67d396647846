"""What a run does when things go wrong: NaN stops, locks, stale temporaries, resumes that changed."""

import json
import shutil

import pytest
import torch

from slidefusion.cli import main
from slidefusion.errors import NonFiniteError, UserError
from slidefusion.training import Trainer, load_config
from slidefusion.io.checkpoint import checkpoint_steps, load_checkpoint
from slidefusion.training.run_folder import RunLock, remove_stale_temporaries, truncate_metrics
from slidefusion.training.trainer import ResidentOptimizer


def _config(tmp_path, *overrides):
    return load_config(None, [
        "model.preset=dit3d-tiny", "data.frames=2", "data.height=8", "data.width=8", "run.batch_size=2",
        "run.log_every=1", "run.save_every=1", f"run.output_dir={tmp_path}", "run.name=t", "optim.warmup_steps=1",
        *overrides,
    ])


def _poison_at(monkeypatch, step: int, what: str) -> None:
    """From the `step`-th call (1-based) on, the resident step reports a NaN loss or leaves an inf weight."""
    calls = {"n": 0}
    original = ResidentOptimizer.train_step

    def train_step(self, loss_fn):
        loss = original(self, loss_fn)
        calls["n"] += 1
        if calls["n"] >= step:
            if what == "loss":
                return float("nan")
            with torch.no_grad():
                next(self.model.parameters()).view(-1)[0] = float("inf")
        return loss

    monkeypatch.setattr(ResidentOptimizer, "train_step", train_step)


@pytest.mark.parametrize("what, clip, message", [
    ("loss", "1.0", r"loss became nan at step 3 although the weights before it were finite.*max_grad_norm=1 was set"),
    ("weights", "null", r"the update of step 3 made weight \S+ non-finite although its loss .* was finite.*max_grad_norm is null"),
])
def test_a_non_finite_step_stops_before_its_checkpoint(tmp_path, monkeypatch, what, clip, message):
    _poison_at(monkeypatch, 3, what)
    trainer = Trainer(_config(tmp_path, "run.steps=5", f"optim.max_grad_norm={clip}"), quiet=True)
    with pytest.raises(NonFiniteError, match=message):
        trainer.train()
    assert sorted(checkpoint_steps(trainer.run_dir)) == [1, 2]  # nothing written from step 3 on
    latest = load_checkpoint(trainer.run_dir)
    assert all(torch.isfinite(v).all() for v in [*latest.model.values(), *latest.ema.values()])


def test_the_cli_stops_a_diverged_run_with_one_line_and_exit_3(tmp_path, monkeypatch, capsys):
    _poison_at(monkeypatch, 2, "weights")
    code = main(["train", "configs/tiny.yaml", f"run.output_dir={tmp_path}", "run.steps=4", "run.save_every=1", "--quiet"])
    err = capsys.readouterr().err
    assert code == 3 and err.count("\n") == 1 and err.startswith("slidefusion train: stopped: the update of step 2")
    assert sorted(checkpoint_steps(tmp_path / "tiny")) == [1]


def test_a_second_run_on_the_same_folder_is_refused_while_the_first_holds_it(tmp_path):
    first, second = (Trainer(_config(tmp_path, "run.steps=1"), quiet=True) for _ in range(2))
    with first.lock():
        with pytest.raises(UserError, match=r"run folder .*t is in use by another training run \(pid \d+\)"):
            second.train()
        with first.lock():  # re-entrant for its holder
            first.train()
    second.resume("latest")  # released: the second may go on
    assert second.train(until=2).losses


def test_stale_temporaries_of_our_writer_are_removed_and_nothing_else(tmp_path):
    run = tmp_path / "t"
    ours = [run / ".checkpoint-5-ab_cd123", run / ".old-checkpoint-3-4242"]
    theirs = [run / ".checkpoint-notes", run / ".mine", run / "checkpoint-x"]
    for folder in ours + theirs:
        (folder / "sub").mkdir(parents=True)
    (run / "captions.safetensorsk3j_9x0q.tmp").write_bytes(b"half")
    (run / "notes.tmp").write_text("keep")
    trainer = Trainer(_config(tmp_path, "run.steps=1"), quiet=True)
    with pytest.warns(UserWarning, match="interrupted save"):
        trainer.train()
    assert not any(p.exists() for p in ours) and not (run / "captions.safetensorsk3j_9x0q.tmp").exists()
    assert all(p.is_dir() for p in theirs) and (run / "notes.tmp").read_text() == "keep"
    assert remove_stale_temporaries(tmp_path / "missing") == []


def test_a_resumed_run_logs_each_step_once(tmp_path):
    straight = Trainer(_config(tmp_path / "a", "run.steps=6", "run.save_every=3"), quiet=True)
    straight.train()
    first = Trainer(_config(tmp_path / "b", "run.steps=6", "run.save_every=3"), quiet=True)
    first.train(until=5)
    shutil.rmtree(first.run_dir / "checkpoint-5")  # as if killed before saving: steps 4, 5 logged past checkpoint-3
    with open(first.run_dir / "metrics.jsonl", "a") as log:
        log.write('{"step": 6, "lo')  # a record torn by the kill
    resumed = Trainer(_config(tmp_path / "b", "run.steps=6", "run.save_every=3"), quiet=True)
    resumed.resume(first.run_dir / "checkpoint-3")
    resumed.train()

    def losses(run):
        return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]

    assert losses(resumed.run_dir) == losses(straight.run_dir) and len(losses(straight.run_dir)) == 6


def test_truncate_metrics_keeps_what_it_cannot_read_except_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n{"step": 2}\n{"note": "x"}\n{"step": 3}\n{"st')
    assert truncate_metrics(path, 2) == 2
    assert path.read_text() == '{"step": 1}\nnot json\n{"step": 2}\n{"note": "x"}\n'
    assert truncate_metrics(path, 2) == 0 and truncate_metrics(tmp_path / "none", 0) == 0


def test_a_new_run_never_writes_over_an_earlier_runs_checkpoints(tmp_path):
    Trainer(_config(tmp_path, "run.steps=2"), quiet=True).train()
    def files():  # the lock file records its holder's pid, nothing else may change
        return {p: p.stat().st_mtime_ns for p in (tmp_path / "t").rglob("*") if p.name != ".lock"}

    before = files()
    with pytest.raises(UserError, match="already holds checkpoint-2 of an earlier run; continue it with --resume latest"):
        Trainer(_config(tmp_path, "run.steps=2"), quiet=True).train()
    assert files() == before


@pytest.mark.parametrize("first, second", [(False, True), (True, False)])
def test_resume_converts_the_optimizer_state_when_offload_is_switched(tmp_path, first, second):
    options = ("run.steps=6", "run.save_every=3", "optim.max_grad_norm=0.5")
    straight = Trainer(_config(tmp_path / "a", *options), quiet=True)
    losses = straight.train().losses
    head = Trainer(_config(tmp_path / "b", *options, f"offload.enabled={str(first).lower()}"), quiet=True).train(until=3)
    resumed = Trainer(_config(tmp_path / "b", *options, f"offload.enabled={str(second).lower()}"), quiet=True)
    with pytest.warns(UserWarning, match="optimizer state was saved by the .*; converted"):
        resumed.resume("latest")
    assert head.losses + resumed.train().losses == losses  # fp32: the engine is torch's AdamW bit for bit
    weights = resumed.optimizer.model_state_dict()
    assert all(torch.equal(weights[k], v) for k, v in straight.model.state_dict().items())


def test_resuming_an_older_checkpoint_never_writes_over_newer_ones(tmp_path):
    Trainer(_config(tmp_path, "run.steps=3", "run.save_every=1", "run.keep_last=null"), quiet=True).train()
    with pytest.raises(UserError, match=r"holds newer checkpoints \(checkpoint-3\) that the run would write over"):
        Trainer(_config(tmp_path, "run.steps=3"), quiet=True).resume(tmp_path / "t" / "checkpoint-1")


def test_resume_warns_when_the_data_changed(tmp_path):
    Trainer(_config(tmp_path, "run.steps=1"), quiet=True).train()
    resumed = Trainer(_config(tmp_path, "run.steps=2", "data.frames=3", "run.batch_size=1"), quiet=True)
    with pytest.warns(UserWarning, match=r"the data changed since it was saved \(data.frames 2 -> 3, run.batch_size 2 -> 1\)"):
        resumed.resume("latest")


@pytest.mark.parametrize("damage, message", [
    (lambda ckpt: (ckpt / "state.pt").write_bytes(b"\x80garbage"), "cannot be read"),
    (lambda ckpt: torch.save({"x": 1}, ckpt / "state.pt"), "state.pt lacks optimizer, step, torch_rng"),
    (lambda ckpt: (ckpt / "config.json").write_text('{"model": null}'), "config.json is invalid: model=None must be a section"),
    (lambda ckpt: (ckpt / "config.json").write_text("[1, 2]"), "config.json must hold a mapping"),
])
def test_a_damaged_checkpoint_is_one_line_on_resume(tmp_path, damage, message):
    path = Trainer(_config(tmp_path, "run.steps=1"), quiet=True).train().last_checkpoint
    damage(path)
    with pytest.raises(UserError, match=message):
        Trainer(_config(tmp_path, "run.steps=2"), quiet=True).resume("latest")


def test_run_lock_is_released_on_release_and_names_its_holder(tmp_path):
    lock = RunLock(tmp_path / "r")
    lock.acquire()
    with pytest.raises(UserError, match=r"\(pid \d+\)"):
        RunLock(tmp_path / "r").acquire()
    lock.release()
    again = RunLock(tmp_path / "r")
    again.acquire()
    again.release()
