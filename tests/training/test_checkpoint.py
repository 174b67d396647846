import pytest
import torch

from slidefusion.errors import UserError
from slidefusion.models import build_model, preset
from slidefusion.io.checkpoint import checkpoint_steps, latest_checkpoint, load_checkpoint, save_checkpoint
from slidefusion.training import load_matching


def test_save_load_round_trip_and_pruning(tmp_path):
    model = build_model(preset("dit3d-tiny"))
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, {"step": step}, model.state_dict(), ema=model.state_dict(),
                        state={"step": step}, keep_last=2)
    assert sorted(checkpoint_steps(tmp_path)) == [20, 30]
    ckpt = load_checkpoint(tmp_path, with_state=True)  # a run folder means its latest
    assert ckpt.path == latest_checkpoint(tmp_path) and ckpt.config == {"step": 30} and ckpt.state == {"step": 30}
    for name, value in model.state_dict().items():
        assert torch.equal(ckpt.model[name], value)


def test_a_crash_while_writing_leaves_no_checkpoint(tmp_path, monkeypatch):
    import slidefusion.io.checkpoint as module

    model = build_model(preset("dit3d-tiny"))

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(module.torch, "save", explode)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path, 5, {}, model.state_dict(), state={"x": 1})
    assert checkpoint_steps(tmp_path) == {} and list(tmp_path.iterdir()) == []


def test_missing_and_corrupt_checkpoints_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_checkpoint(tmp_path / "nowhere")
    model = build_model(preset("dit3d-tiny"))
    path = save_checkpoint(tmp_path, 1, {}, model.state_dict())
    (path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(UserError, match="cannot be read"):
        load_checkpoint(path)
    with pytest.raises(UserError, match="no state.pt"):
        load_checkpoint(save_checkpoint(tmp_path, 2, {}, model.state_dict()), with_state=True)


def test_load_matching_lists_what_did_not_fit():
    dense = build_model(preset("dit3d-tiny"))
    wider = build_model(preset("dit3d-tiny", mlp_ratio=2.0))
    loaded, skipped = load_matching(wider, dense.state_dict())
    assert any("mlp.fc1.weight" in s and "shape" in s for s in skipped)
    assert "blocks.0.attn.qkv.weight" in loaded
    assert torch.equal(wider.state_dict()["blocks.0.attn.qkv.weight"], dense.state_dict()["blocks.0.attn.qkv.weight"])


def test_export_keeps_the_sampling_weights_in_half_precision(tmp_path):
    from slidefusion.io.checkpoint import export_checkpoint

    model = build_model(preset("dit3d-tiny"))
    ema = {k: v + 1 for k, v in model.state_dict().items()}
    source = save_checkpoint(tmp_path / "run", 3, {"a": 1}, model.state_dict(), ema=ema, state={"step": 3})
    out = export_checkpoint(source, tmp_path / "bundle")
    exported = load_checkpoint(out)
    assert exported.config == {"a": 1} and exported.ema is None and not (out / "state.pt").exists()
    name = "blocks.0.mlp.fc1.weight"
    assert exported.model[name].dtype == torch.float16
    torch.testing.assert_close(exported.model[name].float(), ema[name], atol=1e-3, rtol=1e-3)
    with pytest.raises(UserError, match="already exists; add --force"):
        export_checkpoint(source, out)  # an existing destination is never replaced unasked
    assert export_checkpoint(source, out, force=True) == out and load_checkpoint(out).config == {"a": 1}
