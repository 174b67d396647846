"""`export --format comfyui`: a Wan fine-tune in the layout ComfyUI loads, read back by the tools that
read it. ComfyUI's own rule for LoRA keys is written out below from its documented key names (it is
not imported: ComfyUI is not a dependency); diffusers reads both files itself."""

import pytest
import torch
from safetensors.torch import load_file
from wan_runs import WAN_MODULE, original_keys, train

from slidefusion.cli import main

TARGETS = "lora.target_modules=[to_q,to_k,to_v,to_out.0,ffn.net.0.proj,ffn.net.2,condition_embedder.time_proj,proj_out]"


def comfyui_patches(model_keys: set[str], lora: dict) -> tuple[dict, set]:
    """What ComfyUI patches with `lora` in a model whose weights are `model_keys` (Wan's original
    names), and the LoRA keys it reports as "lora key not loaded".

    ComfyUI's rule (comfy/lora.py `model_lora_keys_unet`, comfy/weight_adapter/lora.py): a diffusion
    model's weights are named "diffusion_model.<name>"; each "<m>.weight" among them is a LoRA module
    X = "diffusion_model.<m>", read from "X.lora_up.weight" + "X.lora_down.weight" or "X.lora_B.weight"
    + "X.lora_A.weight"; the patch is strength * alpha / rank * up @ down with alpha the 0-d tensor
    "X.alpha" and rank = down.shape[0]; without an alpha tensor the scale is 1."""
    patches, loaded = {}, set()
    for key in model_keys:
        if not key.endswith(".weight"):
            continue
        x = "diffusion_model." + key[: -len(".weight")]
        for up, down in ((f"{x}.lora_up.weight", f"{x}.lora_down.weight"), (f"{x}.lora_B.weight", f"{x}.lora_A.weight")):
            if up in lora:
                alpha = lora.get(f"{x}.alpha")
                scale = 1.0 if alpha is None else alpha.item() / lora[down].shape[0]
                patches[key] = scale * lora[up].double() @ lora[down].double()
                loaded |= {up, down} | ({f"{x}.alpha"} if alpha is not None else set())
                break
    return patches, set(lora) - loaded


def peft_deltas(weights: dict, alpha: float) -> dict:
    """{Wan weight name: alpha / rank * B @ A} from a checkpoint's peft adapter weights."""
    deltas = {}
    for name, down in weights.items():
        if ".lora_A." not in name:
            continue
        module = name.split(".lora_A.")[0]
        up = weights[name.replace(".lora_A.", ".lora_B.")]
        if module.startswith("blocks."):
            _, index, rest = module.split(".", 2)
            wan = f"blocks.{index}.{WAN_MODULE[rest]}"
        else:
            wan = WAN_MODULE[module]
        deltas[f"{wan}.weight"] = alpha / down.shape[0] * up.double() @ down.double()
    return deltas


@pytest.fixture(scope="module")
def lora_run(tiny_wan_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("comfy-lora")
    run = train(tiny_wan_dir, out, "shapes", "lora.rank=4", "lora.alpha=8", TARGETS)
    assert main(["export", "--checkpoint", str(run), "--out", str(out / "comfy"), "--format", "comfyui"]) == 0
    assert main(["export", "--checkpoint", str(run), "--out", str(out / "diffusers"), "--format", "diffusers"]) == 0
    return run, out


def test_lora_keys_are_exactly_what_comfyui_patches_at_the_trained_strength(lora_run):
    run, out = lora_run
    assert [p.name for p in (out / "comfy").iterdir()] == ["shapes.safetensors"]
    lora = load_file(out / "comfy" / "shapes.safetensors")
    patches, not_loaded = comfyui_patches(original_keys(2), lora)
    assert not_loaded == set()  # every key is read: no "lora key not loaded"
    ours = peft_deltas(load_file(run / "checkpoint-2" / "model.safetensors"), alpha=8.0)
    assert patches.keys() == ours.keys() and len(ours) == 2 * 10 + 2  # every adapted module is patched
    assert any(ours[k].abs().max() > 1e-4 for k in ours)  # training moved the adapters
    for key, delta in ours.items():
        torch.testing.assert_close(patches[key], delta, rtol=1e-6, atol=1e-9, msg=key)
    # alpha tensors where diffusers reads them (blocks); outside them alpha / rank is folded into lora_B
    assert lora["diffusion_model.blocks.0.self_attn.q.alpha"].item() == 8.0
    assert "diffusion_model.head.head.alpha" not in lora and "diffusion_model.head.head.lora_B.weight" in lora


def test_diffusers_loads_the_comfyui_lora_as_it_loads_our_diffusers_export(lora_run, tiny_wan_dir):
    from diffusers import WanPipeline

    from slidefusion.testing.tiny import tiny_latents, tiny_text

    _, out = lora_run
    outputs = {}
    for how in ("comfy", "diffusers", "base"):
        pipe = WanPipeline.from_pretrained(tiny_wan_dir)
        if how == "comfy":
            pipe.load_lora_weights(out / "comfy", weight_name="shapes.safetensors")
        elif how == "diffusers":
            pipe.load_lora_weights(out / "diffusers")
        model = pipe.transformer
        text = tiny_text(model, batch=1)
        with torch.no_grad():
            outputs[how] = model(tiny_latents(model, batch=1), torch.tensor([500.0]), text.states, return_dict=False)[0]
    scale = outputs["base"].abs().max()
    assert (outputs["comfy"] - outputs["diffusers"]).abs().max() <= 1e-5 * scale
    assert (outputs["comfy"] - outputs["base"]).abs().max() > 1e-3 * scale  # the LoRA is what changed it


@pytest.mark.parametrize("variant", ["2.1", "2.2-ti2v"])
def test_full_fine_tune_is_one_original_layout_file_diffusers_reads_back(variant, tiny_wan_dir, tiny_wan_variant_dir,
                                                                        tmp_path):
    from diffusers import WanTransformer3DModel
    from wan_runs import TI2V_PIXELS

    folder = tiny_wan_dir if variant == "2.1" else tiny_wan_variant_dir(variant)
    run = train(folder, tmp_path, "full", steps=1, **({"pixels": TI2V_PIXELS} if variant != "2.1" else {}))
    trained = load_file(run / "checkpoint-1" / "model.safetensors")
    for dtype, tag in (("bfloat16", "bf16"), ("float32", "fp32")):
        args = [] if dtype == "bfloat16" else ["--dtype", dtype]  # bf16 is the default
        assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / tag), "--format", "comfyui", *args]) == 0
        path = tmp_path / tag / f"full_{tag}.safetensors"
        assert original_keys(2) == set(load_file(path))  # Wan's own names, nothing else
        model = WanTransformer3DModel.from_single_file(str(path), config=str(folder), subfolder="transformer",
                                                       torch_dtype=getattr(torch, dtype))
        state = model.state_dict()
        assert state.keys() == trained.keys()
        for name, value in trained.items():
            expected = value.to(torch.bfloat16).to(state[name].dtype) if dtype == "bfloat16" else value
            assert torch.equal(state[name], expected), name


def test_a14b_experts_get_the_names_comfyui_workflows_load(tiny_wan_variant_dir, tmp_path):
    from slidefusion.io.comfyui import file_name
    from slidefusion.pretrained import open_folder

    folder = tiny_wan_variant_dir("2.2-a14b")
    run = train(folder, tmp_path, "moves", "model.expert=transformer_2", "lora.rank=2", steps=1)
    assert main(["export", "--checkpoint", str(run), "--out", str(tmp_path / "out"), "--format", "comfyui"]) == 0
    lora = load_file(tmp_path / "out" / "moves_low_noise.safetensors")
    assert comfyui_patches(original_keys(2), lora)[1] == set()
    opened = open_folder(folder)
    assert file_name("moves", opened, "transformer", None) == "moves_high_noise.safetensors"
    assert file_name("moves", opened, "transformer", torch.float16) == "moves_high_noise_fp16.safetensors"


def test_comfyui_export_refuses_what_it_cannot_write(tiny_pipeline_dir, tmp_path, capsys):
    from slidefusion.training import load_config
    from slidefusion.io.checkpoint import save_checkpoint

    def checkpoint(name, folder, *overrides):
        config = load_config("configs/wan-finetune.yaml", [f"model.pretrained={folder}", *overrides])
        return save_checkpoint(tmp_path / name, 1, config.to_dict(), {"x": torch.zeros(1)})

    cases = [
        (checkpoint("cog", tiny_pipeline_dir("cogvideox")), [], "has no layout for CogVideoXTransformer3DModel; supported: WanTransformer3DModel"),
        (checkpoint("wan", tiny_pipeline_dir("wan")), ["--max-shard-size", "1MB"], "applies to --format diffusers only"),
        (checkpoint("slide", tiny_pipeline_dir("wan"), "model.attention=slide"), [], "cannot hold slide attention"),
    ]
    for source, extra, message in cases:
        assert main(["export", "--checkpoint", str(source), "--out", str(tmp_path / "o"), "--format", "comfyui",
                     *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
        assert not (tmp_path / "o").exists()
