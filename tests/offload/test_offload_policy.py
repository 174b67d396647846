"""One offload config: the YAML section, the planner's flags and the engine read the same
`OffloadPolicy`; one `resolve` turns `auto` into numbers for the planner and the trainer alike."""

import dataclasses
import json

import pytest
import torch

from slidefusion.cli import main
from slidefusion.errors import UserError
from slidefusion.models import build_model, preset
from slidefusion.offload import OffloadEngine, OffloadPolicy, Sizing, Workload, engine_blocks, resolve
from slidefusion.offload.plan.model_shape import shape_of_config
from slidefusion.offload.plan.resolve import search_tile
from slidefusion.training import TrainConfig, load_config
from slidefusion.training.config import build


def test_the_config_section_is_the_policy_and_round_trips_through_config_json():
    config = load_config(None, ["offload.compute_dtype=bf16", "offload.master=bfloat16", "offload.tile=off",
                                "offload.resident_blocks=auto", "offload.spill_dir=/tmp", "offload.spill_after=1GB"])
    policy = config.offload
    assert type(policy) is OffloadPolicy
    assert policy.compute_dtype is torch.bfloat16 and policy.master == "bf16"  # one spelling, the other an alias
    assert policy.tile is None and policy.spill_after == 10**9 and policy.resident_blocks == "auto"
    written = json.loads(json.dumps(config.to_dict()))
    assert written["offload"]["compute_dtype"] == "bfloat16" and "device" not in written["offload"]
    assert build(TrainConfig, written).offload == policy
    with pytest.raises(UserError, match="unknown config key offload.device"):
        load_config(None, ["offload.device=cpu"])  # the program sets it (run.device)


def test_one_compute_dtype_default_follows_the_device():
    assert OffloadPolicy().compute_dtype == "auto"
    assert OffloadPolicy(device="cpu").dtype is torch.float32
    assert OffloadPolicy().dtype is torch.bfloat16  # the planner sizes a GPU
    assert resolve(OffloadPolicy(device="cpu")).compute_dtype is torch.float32
    assert OffloadPolicy(compute_dtype="fp16").compute_dtype is OffloadPolicy(compute_dtype=torch.float16).compute_dtype
    with pytest.raises(UserError, match="offload.compute_dtype='fp8' is unsupported; valid: float32, bfloat16"):
        OffloadPolicy(compute_dtype="fp8")


def test_the_engine_refuses_an_auto_it_cannot_size():
    model = build_model(preset("dit3d-tiny", depth=2, text_dim=16))
    with pytest.raises(UserError, match="offload.tile=auto needs the model and one step's workload"):
        OffloadEngine(model, model.blocks, OffloadPolicy(device="cpu", tile="auto"))
    engine = OffloadEngine(model, model.blocks, OffloadPolicy(device="cpu"))
    assert engine.policy.compute_dtype is torch.float32  # resolved where it is built
    engine.close()


def _sizings(device_memory: int):
    """The trainer's and the planner's sizing of the same model and step."""
    config = preset("dit3d-tiny", depth=4, text_dim=16)
    model, shape = build_model(config, "meta"), shape_of_config(config)
    work = Workload(batch=2, tokens=8 * 16 * 16, attention="dense", frames=8)
    counts = Sizing.of_model(model, engine_blocks(model), shape, work)
    trainer = dataclasses.replace(counts, device_capacity=device_memory, host_capacity=None)
    planner = Sizing.of_shape(shape, work, device_memory, None, None)
    return trainer, planner


@pytest.mark.parametrize("room", [10**12, 3 * 10**6, 1])
def test_the_trainer_and_the_planner_resolve_auto_alike(room):
    trainer, planner = _sizings(room)
    policy = OffloadPolicy(compute_dtype="float32", tile="auto", resident_blocks="auto")
    ours, theirs = resolve(policy, trainer), resolve(policy, planner)
    assert (ours.tile, ours.resident_blocks) == (theirs.tile, theirs.resident_blocks)
    if room == 10**12:
        assert ours.tile is None and ours.resident_blocks == 4  # everything fits: whole blocks, all resident
    else:
        assert ours.resident_blocks == 0 and ours.tile is not None  # tiles sized to the room (1 when none is enough)
    unknown = resolve(policy, dataclasses.replace(trainer, device_capacity=None))  # a CPU: its size is unknown
    assert (unknown.tile, unknown.resident_blocks) == (None, 0)


def test_the_tile_search_takes_the_largest_fitting_tile():
    for largest in range(1, 12):
        assert search_tile(lambda t, n=largest: t is not None and t <= n, 12) == largest
    assert search_tile(lambda t: True, 12) is None


def test_plan_flags_set_the_policy_fields(capsys):
    base = ["plan", "--model", "dit3d-tiny", "--frames", "8", "--height", "32", "--width", "32", "--attention", "dense"]
    assert main([*base, "--compute-dtype", "float32"]) == 0
    assert "B/param in fp32" in capsys.readouterr().out
    assert main([*base, "--compute-dtype", "fp8"]) == 2
    assert "--compute-dtype='fp8' is unsupported" in capsys.readouterr().err
    assert main([*base, "--tile", "off"]) == 0
    assert "tiling: off (whole blocks)" in capsys.readouterr().out
