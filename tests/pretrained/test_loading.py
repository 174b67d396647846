"""Loading local diffusers folders: against diffusers' own from_pretrained, shard streaming, the
other components, peak host memory, and one-line errors for every broken folder."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from slidefusion.errors import UserError
from slidefusion.pretrained import (
    build_on_meta,
    iter_weights,
    load_component,
    load_scheduler,
    load_text_encoders,
    load_transformer,
    load_vae,
    open_folder,
    read_header,
)
from slidefusion.pretrained.folder import WEIGHTS, WEIGHTS_INDEX
from slidefusion.testing.tiny import save_tiny_transformer


def _same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name
    ba, bb = dict(a.named_buffers()), dict(b.named_buffers())
    assert ba.keys() == bb.keys() and all(torch.equal(ba[k], bb[k]) for k in ba)


def test_a_pipeline_folder_is_described(tiny_wan_dir):
    folder = open_folder(tiny_wan_dir)
    assert folder.is_pipeline and folder.pipeline_class == "WanPipeline"
    assert set(folder.components()) == {"scheduler", "text_encoder", "tokenizer", "transformer", "vae"}
    assert folder.transformer_names == ("transformer",)  # Wan 2.1: transformer_2 is a [null, null] placeholder
    assert folder.adapter().family == "wan" and folder.adapter().options["expand_timesteps"] is False
    assert [e.name for e in folder.experts()] == ["transformer"]


def test_wan22_layouts_are_described(tiny_wan_variant_dir):
    a14b = open_folder(tiny_wan_variant_dir("2.2-a14b"))
    assert a14b.transformer_names == ("transformer", "transformer_2")
    high, low = a14b.experts()  # WanPipeline: transformer for t >= boundary_ratio * 1000
    assert (high.name, high.low, low.name, low.high) == ("transformer", 875.0, "transformer_2", 875.0)
    ti2v = open_folder(tiny_wan_variant_dir("2.2-ti2v"))
    assert ti2v.adapter().options["expand_timesteps"] is True
    assert ti2v.transformer_config()["in_channels"] == 48


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_resident_loader_equals_diffusers_from_pretrained(tiny_wan_dir, tiny_wan_sharded_dir, sharded, dtype):
    from diffusers import WanTransformer3DModel

    root = tiny_wan_sharded_dir if sharded else tiny_wan_dir
    ours = load_transformer(root, dtype=dtype)
    theirs = WanTransformer3DModel.from_pretrained(root / "transformer", torch_dtype=dtype, local_files_only=True)
    _same_state(ours, theirs)
    if dtype is torch.bfloat16:  # diffusers' _keep_in_fp32_modules rule
        assert ours.blocks[0].scale_shift_table.dtype == torch.float32
        assert ours.blocks[0].attn1.to_q.weight.dtype == torch.bfloat16
    assert not ours.training and all(p.device.type == "cpu" for p in ours.parameters())
    x, t, states = torch.randn(1, 4, 2, 4, 4), torch.tensor([500.0]), torch.randn(1, 6, 16)
    x, states = x.to(dtype or torch.float32), states.to(dtype or torch.float32)
    with torch.no_grad():
        for tensor in [*theirs.parameters(), *theirs.buffers()]:
            # diffusers' tensors from a shard are views at the file's offsets (8-byte aligned here), and on
            # some CPUs (Zen 5) MKL rounds an unaligned matrix differently in the last bit; ours are aligned
            tensor.data = tensor.data.clone()
        assert torch.equal(ours(x, t, states, return_dict=False)[0], theirs(x, t, states, return_dict=False)[0])


def test_meta_build_allocates_no_parameters(tiny_wan_dir):
    model = build_on_meta(tiny_wan_dir)
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # RoPE tables are computed, not loaded
    names = [n for n, _ in iter_weights(tiny_wan_dir)]
    assert sorted(names) == sorted(model.state_dict())


def test_weights_stream_shard_by_shard_in_file_order(tiny_wan_sharded_dir):
    directory = tiny_wan_sharded_dir / "transformer"
    index = json.loads((directory / WEIGHTS_INDEX).read_text())["weight_map"]
    shards = list(dict.fromkeys(index.values()))
    assert len(shards) >= 3
    expected = [e.name for shard in shards for e in read_header(directory / shard)]
    streamed = list(iter_weights(tiny_wan_sharded_dir, dtype=torch.float16))
    assert [n for n, _ in streamed] == expected
    keep = {"rope", "time_embedder", "scale_shift_table", "norm1", "norm2", "norm3"}  # Wan's _keep_in_fp32_modules
    assert {tensor.dtype for name, tensor in streamed if keep & set(name.split("."))} == {torch.float32}
    assert {tensor.dtype for name, tensor in streamed if not keep & set(name.split("."))} == {torch.float16}
    assert all(t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size() for _, t in streamed)


def test_components_load_from_the_folder(tiny_wan_dir):
    from transformers import AutoTokenizer

    [(tokenizer, encoder)] = load_text_encoders(tiny_wan_dir)
    assert type(encoder).__name__ == "UMT5EncoderModel" and not encoder.training
    ids = tokenizer(["a red circle moving up"], return_tensors="pt").input_ids
    assert ids[0, -1].item() == tokenizer.eos_token_id and tokenizer.unk_token_id not in ids[0].tolist()
    again = AutoTokenizer.from_pretrained(tiny_wan_dir / "tokenizer", local_files_only=True)
    assert again("a red circle moving up").input_ids == ids[0].tolist()
    assert type(load_vae(tiny_wan_dir)).__name__ == "AutoencoderKLWan"
    scheduler = load_scheduler(tiny_wan_dir)
    assert type(scheduler).__name__ == "UniPCMultistepScheduler" and scheduler.config.prediction_type == "flow_prediction"
    assert type(load_component(tiny_wan_dir, "transformer")).__name__ == "WanTransformer3DModel"


@pytest.mark.parametrize("variant", ["2.1", "2.2-ti2v", "2.2-a14b"])
def test_diffusers_loads_the_tiny_pipeline_and_samples(tiny_wan_dir, tiny_wan_variant_dir, variant):
    from diffusers import WanPipeline

    root = tiny_wan_dir if variant == "2.1" else tiny_wan_variant_dir(variant)
    pipe = WanPipeline.from_pretrained(root, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    size = 32 if variant == "2.2-ti2v" else 16  # 2.2's VAE compresses space 16x
    run = lambda: pipe("a red circle moving up", num_frames=5, height=size, width=size, num_inference_steps=2,  # noqa: E731
                       guidance_scale=3.0, output_type="np", max_sequence_length=16,
                       generator=torch.Generator().manual_seed(0)).frames
    frames = run()
    assert frames.shape == (1, 5, size, size, 3)
    assert (frames >= 0).all() and (frames <= 1).all() and frames.std() > 0
    assert (frames == run()).all()  # deterministic for a seed


# ---------------------------------------------------------------- peak host memory while loading
_MEASURE = textwrap.dedent("""
    import gc, json, sys, torch
    from slidefusion.pretrained import build_on_meta, load_transformer, open_folder
    from slidefusion.testing.rss import reset_peak_rss, status_kib as kb


    folder, dtype = open_folder(sys.argv[1]), getattr(torch, sys.argv[2])
    build_on_meta(folder)  # imports and class set-up happen before the measurement
    gc.collect()
    assert reset_peak_rss()  # VmHWM restarts from the current RSS
    before = kb("VmRSS")
    model = load_transformer(folder, dtype=dtype)
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(json.dumps({"peak_increase": (kb("VmHWM") - before) * 1024, "weights": weights}))
""")


@pytest.fixture(scope="module")
def wan_100mb(tmp_path_factory):
    """A ~100 MB Wan-shaped transformer in 4 safetensors shards."""
    root = tmp_path_factory.mktemp("wan-100mb") / "transformer"
    save_tiny_transformer(root, "wan", max_shard_size="30MB", num_attention_heads=4, attention_head_dim=128,
                          ffn_dim=2048, text_dim=512, freq_dim=256, num_layers=6, in_channels=16, out_channels=16)
    return root


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_resident_loading_peaks_within_1_2x_the_weights(wan_100mb, dtype):
    assert len(list(wan_100mb.glob("*.safetensors"))) >= 4
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(wan_100mb), dtype], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    ratio = measured["peak_increase"] / measured["weights"]
    print(f"\n{dtype}: weights {measured['weights'] / 2**20:.1f} MiB, peak increase "
          f"{measured['peak_increase'] / 2**20:.1f} MiB, ratio {ratio:.3f}")
    assert measured["weights"] > (90 if dtype == "float32" else 45) * 2**20
    assert ratio <= 1.2


_MEASURE_ENGINE = textwrap.dedent("""
    import gc, json, sys, torch
    from slidefusion.families import adapter_for
    from slidefusion.offload import OffloadEngine, OffloadPolicy
    from slidefusion.pretrained import build_on_meta, iter_weights, open_folder
    from slidefusion.testing.rss import reset_peak_rss, status_kib as kb


    folder = open_folder(sys.argv[1])
    build_on_meta(folder)
    gc.collect()
    assert reset_peak_rss()
    before = kb("VmRSS")
    model = build_on_meta(folder)  # what `train model.pretrained=DIR --offload` does
    engine = OffloadEngine(model, adapter_for(model).blocks(model), OffloadPolicy(device="cpu", compute_dtype=torch.float32))
    engine.load_weights(iter_weights(folder))
    print(json.dumps({"peak": (kb("VmHWM") - before) * 1024, "grown": (kb("VmRSS") - before) * 1024,
                      "host_state": engine.stats.host_state_bytes}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_offloaded_loading_streams_the_shards_into_the_engine_within_1_2x(wan_100mb):
    """The --offload path of a fine-tune: the transformer on the meta device, the engine's host
    buffers its only copy, the shards streamed into them one tensor at a time."""
    result = subprocess.run([sys.executable, "-c", _MEASURE_ENGINE, str(wan_100mb)], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"\nengine: host state {m['host_state'] / 2**20:.1f} MiB, final RSS growth {m['grown'] / 2**20:.1f} MiB, "
          f"peak {m['peak'] / 2**20:.1f} MiB: peak / host state = {m['peak'] / m['host_state']:.3f}")
    assert m["host_state"] > 250 * 2**20 and m["grown"] >= 0.9 * m["host_state"]  # weights, and AdamW moments
    assert m["peak"] <= 1.2 * m["host_state"]


# ---------------------------------------------------------------- broken folders
def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def _copy(src, tmp_path):
    return shutil.copytree(src, tmp_path / "copy")


def _edit_json(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _break(kind, tiny_wan_dir, tiny_wan_sharded_dir, tmp_path):
    """Make a broken folder of `kind`; returns (path, what to call on it)."""
    sharded = lambda: _copy(tiny_wan_sharded_dir, tmp_path)  # noqa: E731
    if kind == "not a directory":
        (tmp_path / "file").write_text("x")
        return tmp_path / "file", open_folder
    if kind == "not diffusers":
        (tmp_path / "empty").mkdir()
        return tmp_path / "empty", open_folder
    if kind == "no _class_name":
        (tmp_path / "cfg").mkdir()
        (tmp_path / "cfg" / "config.json").write_text('{"hidden_size": 8}')
        return tmp_path / "cfg", open_folder
    if kind == "unsupported class":
        root = _copy(tiny_wan_dir, tmp_path)
        _edit_json(root / "transformer" / "config.json", lambda c: c.update(_class_name="FluxTransformer2DModel"))
        return root, open_folder
    if kind == "missing shard":
        root = sharded()
        next(iter(sorted((root / "transformer").glob("*-00002-of-*.safetensors")))).unlink()
        return root, load_transformer
    if kind == "mismatched index":
        root = sharded()
        index = root / "transformer" / WEIGHTS_INDEX
        _edit_json(index, lambda d: d["weight_map"].update(
            {"proj_out.weight": next(s for s in d["weight_map"].values() if s != d["weight_map"]["proj_out.weight"])}))
        return root, iter_weights
    if kind == "truncated shard":
        root = _copy(tiny_wan_dir, tmp_path)
        path = root / "transformer" / WEIGHTS
        path.write_bytes(path.read_bytes()[:-100])
        return root, load_transformer
    if kind == "bin weights":
        root = _copy(tiny_wan_dir, tmp_path)
        (root / "transformer" / WEIGHTS).rename(root / "transformer" / "diffusion_pytorch_model.bin")
        return root, load_transformer
    if kind == "missing component":
        root = _copy(tiny_wan_dir, tmp_path)
        shutil.rmtree(root / "vae")
        return root, load_vae
    if kind == "unlisted component":
        root = _copy(tiny_wan_dir, tmp_path)
        _edit_json(root / "model_index.json", lambda d: d.pop("scheduler"))
        return root, load_scheduler
    if kind == "bare folder component":
        return tiny_wan_dir / "transformer", load_vae
    if kind == "shape mismatch":
        root = _copy(tiny_wan_dir, tmp_path)
        _edit_json(root / "transformer" / "config.json", lambda c: c.update(ffn_dim=48))
        return root, load_transformer
    assert kind == "missing tensors"
    root = _copy(tiny_wan_dir, tmp_path)
    _edit_json(root / "transformer" / "config.json", lambda c: c.update(num_layers=3))
    return root, load_transformer


@pytest.mark.parametrize("kind, match", [
    ("not a directory", "is not a directory; valid: a diffusers pipeline folder"),
    ("not diffusers", "is not a diffusers model folder"),
    ("no _class_name", "config.json has no _class_name"),
    ("unsupported class", "'FluxTransformer2DModel' is not supported; supported: CogVideoXTransformer3DModel, "),
    ("missing shard", r"missing weights shard diffusion_pytorch_model-00002-of-\d+.safetensors"),
    ("mismatched index", "shard index mismatch in .*proj_out.weight"),
    ("truncated shard", "is not a valid safetensors file"),
    ("bin weights", "found diffusion_pytorch_model.bin; valid: safetensors weights"),
    ("missing component", "component vae/ is listed in model_index.json but missing on disk"),
    ("unlisted component", "has no scheduler component; model_index.json lists: "),
    ("bare folder component", "is a bare transformer folder: it has no vae/"),
    ("shape mismatch", r"weight blocks.0.ffn.net.0.proj.bias has shape \(32,\) in the folder but \(48,\)"),
    ("missing tensors", r"the folder's weights lack \d+ tensor\(s\) of the model, e.g. blocks.2."),
])
def test_broken_folders_are_one_line_user_errors(kind, match, tiny_wan_dir, tiny_wan_sharded_dir, tmp_path):
    path, call = _break(kind, tiny_wan_dir, tiny_wan_sharded_dir, tmp_path)
    with pytest.raises(UserError, match=match) as excinfo:
        result = call(path)
        if kind == "mismatched index":
            pytest.fail(f"iter_weights must check the index before streaming, got {type(result).__name__}")
    _one_line(excinfo)
