"""`Trainer` with `offload.enabled` and `slidefusion train --offload`: same run as the resident one."""

import torch

from slidefusion.cli import main
from slidefusion.offload import OffloadEngine
from slidefusion.training import Trainer, load_config


def _config(tmp_path, *overrides):
    return load_config(None, [
        "model.preset=dit3d-tiny", "data.frames=2", "data.height=8", "data.width=8", "run.batch_size=2",
        "run.log_every=1", "run.save_every=3", f"run.output_dir={tmp_path}", "run.name=t", "optim.warmup_steps=2",
        "optim.max_grad_norm=0.5", *overrides,
    ])


def test_offloaded_trainer_repeats_the_resident_run_and_resumes(tmp_path):
    resident = Trainer(_config(tmp_path / "a", "run.steps=6"), quiet=True)
    losses = resident.train().losses
    offloaded = Trainer(_config(tmp_path / "b", "run.steps=6", "offload.enabled=true"), quiet=True)
    assert isinstance(offloaded.optimizer, OffloadEngine)
    head = offloaded.train(until=3).losses
    resumed = Trainer(_config(tmp_path / "b", "run.steps=6", "offload.enabled=true"), quiet=True)
    resumed.resume("latest")
    tail = resumed.train().losses
    assert head + tail == losses  # fp32 compute: bitwise the resident AdamW + clipping
    weights, expected = resumed.optimizer.model_state_dict(), resident.model.state_dict()
    assert all(torch.equal(weights[k], expected[k]) for k in expected)
    assert all(torch.equal(resumed.ema.shadow[k], resident.ema.shadow[k]) for k in expected)


def test_train_offload_flag(tmp_path, capsys):
    code = main(["train", "configs/tiny.yaml", f"run.output_dir={tmp_path}", "run.steps=2", "--offload", "--device", "cpu", "--quiet"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "tiny" / "checkpoint-2" / "model.safetensors").is_file()
    config = (tmp_path / "tiny" / "config.json").read_text()
    assert '"enabled": true' in config


def test_offload_schedule_keys_reach_the_engine_and_keep_the_run(tmp_path):
    default = Trainer(_config(tmp_path / "a", "run.steps=3", "offload.enabled=true"), quiet=True)
    assert not default.optimizer.policy.overlapped  # a CPU device computing in place: updates in line
    forced = Trainer(_config(tmp_path / "b", "run.steps=3", "offload.enabled=true", "offload.overlap=true",
                             "offload.optimizer_threads=2"), quiet=True)
    assert forced.optimizer.policy.overlapped and forced.optimizer.policy.optimizer_threads == 2
    assert forced.train().losses == default.train().losses
