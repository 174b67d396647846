"""The planner: the paper's 105 B numbers, verdicts with reasons, and the `plan` command."""

import pytest

from slidefusion.cli import main
from slidefusion.errors import UserError
from slidefusion.models import preset
from slidefusion.offload.plan.plan import parse_bytes
from slidefusion.offload.plan.planner import plan_training, tokens_for
from slidefusion.offload.tiling.activations import Workload

H200 = {"gpu_memory": 141e9, "host_memory": 1.5e12, "pcie_bytes_s": 55e9, "tflops": 990}


def _plan(attention, frames=256, height=1080, width=1920, **overrides):
    config = preset("dit3d-105b")
    tokens = tokens_for(frames, height, width, config.patch_size, (4, 8, 8))
    return plan_training(config, Workload(1, tokens, attention), **{**H200, **overrides})


def test_105b_persistent_state_is_14_bytes_per_parameter():
    plan = _plan("slide")
    persistent = plan.host["persistent state (14 B/param in bf16)"]
    assert persistent == pytest.approx(1.47e12, rel=0.01)
    assert plan.device["weights in flight"] == pytest.approx(2 * 2 * 1.48e9, rel=0.01)


def test_256_frames_at_1080p_and_the_reasons():
    slide, dense = _plan("slide"), _plan("dense")
    assert not dense.fits and "attention workspace (scores of one head" in dense.verdict()
    # Even slide attention does not fit at 105 B: the block-boundary checkpoints alone are 608 GB.
    assert not slide.fits and "activation checkpoints" in slide.host
    assert slide.host["activation checkpoints"] == pytest.approx(608e9, rel=0.01)
    assert dense.device_bytes - slide.device_bytes > 500e9
    assert _plan("slide", frames=32).fits and not _plan("dense", frames=64).fits


def test_parse_bytes():
    assert parse_bytes("141GB", "x") == 141e9 and parse_bytes("1.5TB", "x") == 1.5e12
    assert parse_bytes("55GB/s", "x") == 55e9 and parse_bytes("64GiB", "x") == 64 * 2**30
    with pytest.raises(UserError, match="--gpu-memory='lots' must be a size"):
        parse_bytes("lots", "--gpu-memory")


def test_plan_command(capsys):
    args = ["plan", "--model", "dit3d-105b", "--frames", "256", "--height", "1080", "--width", "1920",
            "--attention", "slide", "--gpu-memory", "141GB", "--host-memory", "1.5TB"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "1.47 TB" in out and "does not fit" in out and "largest clip that fits" in out
    assert main([*args[:-4], "--gpu-memory", "lots"]) == 2
    assert "argument --gpu-memory: 'lots' must be a size" in capsys.readouterr().err


# -- Wan presets, diffusers folders, host-state flags --------------------------------------------

PINNED = ["plan", "--model", "wan2.1-14b", "--frames", "81", "--height", "480", "--width", "832", "--gpu-memory", "24GB",
          "--host-memory", "128GB"]


TINY_WAN = dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, text_dim=16,
                freq_dim=16, ffn_dim=32, num_layers=3, rope_max_seq_len=32)


@pytest.mark.parametrize("variant", [{}, {"cross_attn_norm": False, "out_channels": None},
                                     {"image_dim": 24, "added_kv_proj_dim": 24, "pos_embed_seq_len": 6}])
def test_meta_device_counts_are_what_diffusers_builds(variant):
    """Counted on the meta device, block by block, equal to the parameters of the model itself."""
    from diffusers import WanTransformer3DModel

    from slidefusion.families import adapter_for_class
    from slidefusion.offload.plan.model_shape import meta_transformer, shape_of_model

    cfg, adapter = {**TINY_WAN, **variant}, adapter_for_class("WanTransformer3DModel")
    shape = shape_of_model(meta_transformer(adapter, cfg), adapter)
    real = WanTransformer3DModel(**cfg)
    assert shape.block_params == tuple(sum(p.numel() for p in b.parameters()) for b in real.blocks)
    assert shape.params == sum(p.numel() for p in real.parameters()) and shape.patch == (1, 2, 2)
    assert (shape.hidden, shape.heads, shape.mlp_ratio, shape.text_tokens) == (16, 2, 2.0, 512)


@pytest.mark.parametrize("name, total", [("wan2.1-1.3b", 1_418_996_800), ("wan2.1-14b", 14_288_491_584)])
def test_published_models_count_their_published_totals(name, total):
    from slidefusion.offload.plan.model_shape import model_shape

    shape = model_shape(name)
    assert shape.params == total and len(shape.block_params) == {"wan2.1-1.3b": 30, "wan2.1-14b": 40}[name]


def test_the_pinned_wan_14b_command_fits_lean_and_not_in_fp32(capsys):
    assert main([*PINNED, "--master", "bf16", "--moments", "int8"]) == 0
    out = capsys.readouterr().out
    assert "verdict: fits" in out and "predicted step time:" in out and "assuming 990 TFLOP/s at 60% MFU" in out
    assert "persistent state (4 B/param in bf16)" in out and "57.2 GB" in out  # under the 90 GB
    assert "14.29 B parameters in 40 blocks" in out and "32760 tokens per sample" in out
    assert main(PINNED) == 0
    out = capsys.readouterr().out
    assert "does not fit: host needs 215 GB but has 128 GB" in out and "with --master bf16 --moments int8 it fits" in out


def test_resident_blocks_take_the_spare_device_memory(capsys):
    assert main([*PINNED, "--master", "bf16", "--moments", "int8", "--resident-blocks", "auto"]) == 0
    auto = capsys.readouterr().out
    assert "16 blocks resident" in auto and "resident blocks (16)" in auto and "verdict: fits" in auto
    assert main([*PINNED, "--master", "bf16", "--moments", "int8", "--resident-blocks", "30"]) == 0
    assert "does not fit: device needs" in capsys.readouterr().out
    assert main([*PINNED, "--resident-blocks", "some"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--resident-blocks='some' must be an int >= 0 or auto" in err
    for flag, value in (("--master", "fp8"), ("--moments", "int4")):
        assert main([*PINNED, flag, value]) == 2  # argparse's choices
        assert "invalid choice" in capsys.readouterr().err


def test_plan_reads_a_diffusers_transformer_folder(tmp_path, capsys):
    from diffusers import WanTransformer3DModel

    pipeline = tmp_path / "pipe"
    model = WanTransformer3DModel(**TINY_WAN)
    model.save_config(str(pipeline / "transformer"))
    args = ["plan", "--frames", "9", "--height", "64", "--width", "64", "--gpu-memory", "1GB", "--host-memory", "1GB"]
    for folder in (pipeline, pipeline / "transformer"):
        assert main([*args, "--model", str(folder)]) == 0
        total = sum(p.numel() for p in model.parameters())
        assert f"{total / 1e9:.2f} B parameters in 3 blocks" in capsys.readouterr().out
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text('{"_class_name": "CogVideoXTransformer3DModel"}')
    assert main([*args, "--model", str(tmp_path / "other")]) == 2
    assert "the planner supports WanTransformer3DModel" in capsys.readouterr().err
    assert main([*args, "--model", str(tmp_path / "missing")]) == 2
    assert "neither a preset nor a folder" in capsys.readouterr().err
