"""Single-file transformers: `model.pretrained=DIR model.transformer=FILE` and `generate --pretrained DIR
--transformer FILE` read an original-layout Wan file (the ComfyUI export of a fine-tune here) as the
folder's transformer, streaming it tensor by tensor; a file that does not fit is one line."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from wan_runs import train

from slidefusion.cli import main
from slidefusion.testing.pipelines import PIXELS

FRAMES, HEIGHT, WIDTH = PIXELS["wan"]
SAMPLE = ["--prompt", "a red circle moving left", "--steps", "2", "--guidance", "4", "--seed", "3", "--quiet",
          "--frames", str(FRAMES), "--height", str(HEIGHT), "--width", str(WIDTH)]


def _latents(out, *source):
    path = out / "latents.safetensors"
    assert main(["generate", *source, *SAMPLE, "--out", str(out / "v.gif"), "--save-latents", str(path)]) == 0
    return load_file(path)["latents"]


def test_an_original_layout_file_samples_fine_tunes_and_exports_back(tiny_wan_dir, tmp_path):
    from diffusers import WanTransformer3DModel

    from slidefusion.pretrained import load_transformer
    from slidefusion.pretrained.source import open_folder_with

    run = train(tiny_wan_dir, tmp_path, "full", steps=1)
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "comfy"), "--format", "comfyui",
                 "--dtype", "float32"]) == 0
    file = tmp_path / "comfy" / "full_fp32.safetensors"
    trained = load_file(run / "checkpoint-1" / "model.safetensors")
    loaded = load_transformer(open_folder_with(tiny_wan_dir, file)).state_dict()
    assert loaded.keys() == trained.keys() and all(torch.equal(loaded[k], trained[k]) for k in trained)

    ours = _latents(tmp_path / "file", "--pretrained", str(tiny_wan_dir), "--transformer", str(file))
    run_latents = _latents(tmp_path / "run", "--checkpoint", str(run))
    assert torch.equal(ours, run_latents)  # the file is the fine-tune, sampled the same way

    # ... and it fine-tunes again (offloaded: its tensors stream into the engine) and exports back
    again = train(tiny_wan_dir, tmp_path, "again", f"model.transformer={file}", "--offload",
                  "offload.compute_dtype=float32", steps=1)
    assert json.loads((again / "checkpoint-1" / "config.json").read_text())["model"]["transformer"] == str(file)
    assert main(["export", "--checkpoint", str(again), "--out", str(tmp_path / "back"), "--format", "comfyui",
                 "--dtype", "float32"]) == 0
    retrained = load_file(again / "checkpoint-1" / "model.safetensors")
    model = WanTransformer3DModel.from_single_file(str(tmp_path / "back" / "again_fp32.safetensors"),
                                                   config=str(tiny_wan_dir), subfolder="transformer")
    state = model.state_dict()
    assert all(torch.equal(state[k], retrained[k]) for k in retrained)
    assert any(not torch.equal(retrained[k], trained[k]) for k in trained)  # it trained from the file's weights


# ---------------------------------------------------------------- peak host memory
_MEASURE = textwrap.dedent("""
    import gc, json, sys, torch
    from slidefusion.pretrained import build_on_meta, load_transformer
    from slidefusion.pretrained.source import open_folder_with
    from slidefusion.testing.rss import reset_peak_rss, status_kib as kb

    folder = open_folder_with(sys.argv[1], sys.argv[2])  # checks the file's header against the config
    build_on_meta(folder)
    gc.collect()
    assert reset_peak_rss()
    before = kb("VmRSS")
    model = load_transformer(folder, dtype=getattr(torch, sys.argv[3]))
    weights = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    print(json.dumps({"peak_increase": (kb("VmHWM") - before) * 1024, "weights": weights}))
""")


@pytest.fixture(scope="module")
def wan_100mb_file(tmp_path_factory):
    """A ~100 MB Wan transformer as one original-layout bf16 file, and a folder with its config."""
    from slidefusion.io.wan_layout import original_name
    from slidefusion.testing.tiny import tiny_model

    root = tmp_path_factory.mktemp("wan-file")
    sizes = dict(num_attention_heads=4, attention_head_dim=128, ffn_dim=2048, text_dim=512, freq_dim=256,
                 num_layers=6, in_channels=16, out_channels=16)
    model = tiny_model("wan", 0, **sizes)
    model.save_config(root / "transformer")
    save_file({original_name(k): v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()},
              root / "wan_bf16.safetensors")
    return root / "transformer", root / "wan_bf16.safetensors"


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_single_file_streams_within_1_2x_the_loaded_weights(wan_100mb_file, dtype):
    folder, file = wan_100mb_file
    result = subprocess.run([sys.executable, "-c", _MEASURE, str(folder), str(file), dtype], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    ratio = measured["peak_increase"] / measured["weights"]
    print(f"\n{dtype}: weights {measured['weights'] / 2**20:.1f} MiB, peak increase "
          f"{measured['peak_increase'] / 2**20:.1f} MiB, ratio {ratio:.3f}")
    assert measured["weights"] > (45 if dtype == "bfloat16" else 90) * 2**20
    assert ratio <= 1.2


# ---------------------------------------------------------------- bad input
def _files(tmp_path, tiny_wan_dir):
    from slidefusion.io.wan_layout import original_name
    from slidefusion.testing.tiny import tiny_model

    def write(name, model, rename=original_name):
        save_file({rename(k): v.contiguous() for k, v in model.state_dict().items()}, tmp_path / name)
        return tmp_path / name

    (tmp_path / "notes.safetensors").write_text("not a safetensors file")
    (tmp_path / "wan.ckpt").write_bytes(b"\0" * 16)
    return {
        "cog": write("cog.safetensors", tiny_model("cogvideox"), rename=lambda k: k),
        "wide": write("wide.safetensors", tiny_model("wan", 0, num_attention_heads=4)),
        "i2v": write("i2v.safetensors", tiny_model("wan", 0, image_dim=8, added_kv_proj_dim=16)),
        "lora": write("lora.safetensors", tiny_model("wan"), rename=lambda k: f"diffusion_model.{k}.lora_A.weight"),
        "text": tmp_path / "notes.safetensors",
        "ckpt": tmp_path / "wan.ckpt",
    }


@pytest.mark.parametrize("case, message", [
    ("cog", "is not a WanTransformer3DModel in its original layout or diffusers'"),
    ("lora", "is not a WanTransformer3DModel in its original layout or diffusers'"),
    ("wide", "in the file but (16,) in the transformer config of"),
    ("i2v", "holds 18 weight(s) the transformer config of"),
    ("text", "is not a valid safetensors file"),
    ("ckpt", "is not a .safetensors file"),
    ("no-pretrained", "add --pretrained DIR"),
])
def test_a_file_that_does_not_fit_is_one_line(case, message, tiny_wan_dir, tmp_path, capsys):
    files = _files(tmp_path, tiny_wan_dir)
    source = [] if case == "no-pretrained" else ["--pretrained", str(tiny_wan_dir)]
    file = files["cog" if case == "no-pretrained" else case]
    assert main(["generate", *source, "--transformer", str(file), *SAMPLE, "--out", str(tmp_path / "v.gif")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    assert case in ("no-pretrained",) or "--transformer=" in err
    assert not (tmp_path / "v.gif").exists()


def test_model_transformer_for_a_family_without_an_original_layout_is_one_line(tiny_pipeline_dir, tmp_path, capsys):
    file = tmp_path / "x.safetensors"
    save_file({"x": torch.zeros(1)}, file)
    args = ["train", "configs/wan-finetune.yaml", f"model.pretrained={tiny_pipeline_dir('cogvideox')}",
            f"model.transformer={file}", "data.kind=shapes", f"run.output_dir={tmp_path}", "run.device=cpu", "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "model.transformer: a single-file transformer has no layout for CogVideoXTransformer3DModel" in err
    assert "supported: WanTransformer3DModel" in err and err.count("\n") == 1
