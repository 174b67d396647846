"""io/: one definition of each file format, each read back by the tool that reads it."""

import json

import pytest
import torch
from safetensors.torch import load_file

from slidefusion.io.checkpoint import load_checkpoint, write_checkpoint
from slidefusion.io.diffusers import (MODEL, PIPELINE, WEIGHTS, WEIGHTS_INDEX, folder_kind, is_pipeline_folder, model_dir,
                                      weight_entries, write_weights)
from slidefusion.io.files import atomic_file, atomic_folder
from slidefusion.io.safetensors_stream import stream_tensors


def _weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {"a.weight": torch.randn(64, 64), "b.bias": torch.randn(7), "c.big": torch.randn(300, 100),
            "d.half": torch.randn(33, 5).to(torch.bfloat16)}


@pytest.mark.parametrize("max_shard", [10**9, 20_000, 1])
def test_sharded_weights_read_back_bitwise_by_our_reader_and_by_diffusers(tmp_path, max_shard):
    from diffusers.models.model_loading_utils import load_state_dict

    weights = _weights()
    write_weights(tmp_path, weights, max_shard)
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    if max_shard == 10**9:
        assert shards == [WEIGHTS] and not (tmp_path / WEIGHTS_INDEX).exists()
    else:
        index = json.loads((tmp_path / WEIGHTS_INDEX).read_text())
        assert set(index["weight_map"]) == set(weights) and set(index["weight_map"].values()) == set(shards)
        assert len(shards) == (4 if max_shard == 1 else 2)  # every tensor alone; the big one alone, the rest together
        for shard in shards:  # at most max_shard bytes, or one tensor larger than that
            held = load_file(tmp_path / shard)
            assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held.values()) <= max_shard
    ours = dict(stream_tensors(weight_entries(tmp_path)))
    theirs = {}
    for shard in shards:
        theirs.update(load_state_dict(str(tmp_path / shard)))
    for name, tensor in weights.items():
        assert torch.equal(ours[name], tensor) and torch.equal(theirs[name], tensor) and ours[name].dtype == tensor.dtype


def test_the_folder_kind_is_decided_once(tmp_path):
    pipe, model, neither = tmp_path / "pipe", tmp_path / "model", tmp_path / "neither"
    for folder in (pipe / "vae", model, neither):
        folder.mkdir(parents=True)
    (pipe / "model_index.json").write_text("{}")
    (pipe / "vae" / "config.json").write_text("{}")
    (model / "config.json").write_text("{}")
    assert [folder_kind(p) for p in (pipe, model, neither, tmp_path / "missing")] == [PIPELINE, MODEL, None, None]
    assert is_pipeline_folder(pipe) and not is_pipeline_folder(model)
    assert model_dir(pipe, "vae") == pipe / "vae" and model_dir(model, "vae") == model
    assert model_dir(pipe, "transformer") is None and model_dir(neither, "vae") is None


def test_our_checkpoint_layout_is_written_once_and_read_back(tmp_path):
    weights = _weights()
    folder = write_checkpoint(tmp_path / "ckpt", {"model": {"preset": "x"}}, weights, ema=weights, state={"step": 3},
                              metadata={"source": "here"})
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "ema.safetensors", "model.safetensors", "state.pt"]
    ckpt = load_checkpoint(folder, with_state=True)
    assert ckpt.config == {"model": {"preset": "x"}} and ckpt.state == {"step": 3}
    assert all(torch.equal(ckpt.model[k], v) and torch.equal(ckpt.ema[k], v) for k, v in weights.items())
    assert load_file(folder / "model.safetensors").keys() == weights.keys()


def test_a_failed_write_leaves_nothing_behind(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_folder(tmp_path / "out") as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "file.json") as tmp:
            tmp.write_text("{")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
