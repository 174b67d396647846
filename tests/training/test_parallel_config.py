"""The `parallel:` config section on one process: its spellings and its one-line refusals (the
multi-rank behaviour is in test_distributed.py)."""

import pytest

from slidefusion.cli import main
from slidefusion.core.errors import UserError
from slidefusion.training import load_config
from slidefusion.training.config import ParallelTrainConfig

TINY = ["model.preset=dit3d-tiny", "data.frames=2", "data.height=8", "data.width=8", "run.batch_size=1", "run.steps=1"]


def test_the_issue_spelling_is_the_section():
    config = load_config(None, ["train.parallel.fsdp=true", "parallel.cpu_offload=true", "run.device=cuda"])
    assert config.parallel == ParallelTrainConfig(fsdp=True, cpu_offload=True)
    assert load_config(None, ["parallel.sp=2"]).parallel.sp == 2


@pytest.mark.parametrize("overrides,message", [
    (["train.steps=3"], "only train.parallel.KEY is accepted"),
    (["parallel.sp=0"], "parallel.sp"),
    (["parallel.cpu_offload=true"], "parallel.cpu_offload=true needs parallel.fsdp=true"),
    (["parallel.fsdp=true", "parallel.cpu_offload=true"], "run.device=cpu has none"),
    (["parallel.fsdp=true", "offload.enabled=true"], "choose one"),
    (["parallel.sp=2", "offload.enabled=true", "offload.tile=2"], "use offload.tile=off"),
    (["parallel.timeout_s=0"], "parallel.timeout_s"),
    (["parallel.shard=true"], "unknown config key parallel.shard"),
])
def test_bad_parallel_config_is_refused(overrides, message):
    with pytest.raises(UserError, match=message):
        load_config(None, overrides)


def test_sequence_parallel_on_one_process_says_how_to_launch(tmp_path, capsys):
    code = main(["train", "configs/tiny.yaml", *TINY, f"run.output_dir={tmp_path}", "parallel.sp=2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "torchrun --nproc-per-node 2 -m slidefusion train" in err, err
    assert not any(tmp_path.iterdir())  # nothing written
