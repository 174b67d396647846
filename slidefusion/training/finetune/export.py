"""`slidefusion export --format diffusers`: a fine-tune of a diffusers folder back into diffusers' layout.

A full fine-tune becomes a pipeline folder: every component of the source folder copied untouched
(model_index.json, text encoders, tokenizers, VAE, scheduler, the other Wan 2.2 expert), and the
trained transformer as config.json plus safetensors weights, sharded past `max_shard_size` with
diffusers' index file (huggingface_hub's `save_torch_state_dict` splits them, as diffusers' own
save_pretrained does), each tensor in the dtype the source stored it in (or `dtype`, by diffusers'
rule: `_keep_in_fp32_modules` stay float32). `<Pipeline>.from_pretrained(OUT)` loads it.

A LoRA fine-tune becomes the adapter alone, in the layout `pipe.load_lora_weights(OUT)` reads
(pytorch_lora_weights.safetensors with "transformer."-prefixed names and the adapter's peft config
as metadata), written by the family pipeline's own `save_lora_weights`.

`export --format comfyui` (a Wan fine-tune) writes one file in Wan's original layout instead: a LoRA
for ComfyUI's models/loras or a transformer for models/diffusion_models (`slidefusion.io.comfyui`).

A run with `model.attention=slide` (or neighborhood) is refused with one line: diffusers' stock
transformer classes cannot hold its offset networks, and a folder without them would run dense
attention, a different model; `generate --checkpoint` samples such a run as trained.

Each is written by `slidefusion.io.export` or `slidefusion.io.comfyui` (a temporary folder renamed
into place), after `check_export_destination`.
"""

from __future__ import annotations

from pathlib import Path

import torch

from slidefusion.core.errors import UserError, check
from slidefusion.io.checkpoint import check_export_destination, first_nonfinite, load_checkpoint, resolve_checkpoint
from slidefusion.io.diskfull import folder_bytes, tensor_bytes, writing
from slidefusion.io.export import DEFAULT_SHARD, copyable_entries, write_lora, write_pipeline_folder
from slidefusion.pretrained import lora as lora_lib
from slidefusion.run_config import SamplingConfig


def _cast(weights: dict, folder, expert: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Each tensor as the source stored it, or as `dtype` by diffusers' rule."""
    from slidefusion.io.safetensors_stream import target_dtype
    from slidefusion.pretrained import transformer_class

    stored = {e.name: e.dtype for e in folder.weight_entries(expert)}
    keep = getattr(transformer_class(folder, expert), "_keep_in_fp32_modules", None) or ()
    missing = [k for k in weights if k not in stored]
    check(not missing, f"the checkpoint's weight {missing[0] if missing else ''} is not in the source folder "
                       f"{folder.root}; was the folder changed since the run?")
    return {k: v.to(stored[k] if dtype is None else target_dtype(k, dtype, stored[k], keep)) for k, v in weights.items()}


def open_fine_tune(source: str | Path, destination: str | Path, force: bool, fmt: str):
    """The checked pieces every export of a diffusers fine-tune starts from: (checkpoint, its
    TrainConfig, the source folder, its sampling weights, the checked destination); UserError for a
    checkpoint of our own models, of slide attention, or holding NaN."""
    from slidefusion.pretrained.source import open_folder_with

    destination = check_export_destination(resolve_checkpoint(source), destination, force)
    ckpt = load_checkpoint(source)
    config = SamplingConfig.of_checkpoint(ckpt)
    if not config.pretrained:
        raise UserError(f"--format {fmt} needs a checkpoint of a diffusers fine-tune (model.pretrained=DIR); "
                        f"{ckpt.path} trained our own {config.model.arch}: use --format slidefusion")
    check(config.model.attention == "dense",
          f"--format {fmt} cannot hold slide attention: {ckpt.path} trained model.attention={config.model.attention} "
          "and the stock model classes have no place for its offset networks (they would run dense attention); "
          f"sample it with `slidefusion generate --checkpoint {ckpt.path}`")
    folder = open_folder_with(config.model.pretrained, config.model.transformer, config.model.expert)
    weights = ckpt.sampling_weights
    bad = first_nonfinite(weights)
    check(bad is None, f"weight {bad} of {ckpt.path} holds NaN or infinity; export an earlier checkpoint")
    return ckpt, config, folder, weights, destination


def export_diffusers(source: str | Path, destination: str | Path, dtype: torch.dtype | None = None,
                     force: bool = False, max_shard_size: int = DEFAULT_SHARD) -> tuple[Path, str]:
    """Write the diffusers form of a fine-tune's checkpoint; returns (folder, what it is)."""
    ckpt, config, folder, weights, destination = open_fine_tune(source, destination, force, "diffusers")
    if config.lora.enabled:
        return _export_lora(folder, config, weights, destination), "LoRA weights (pipe.load_lora_weights(OUT))"
    expert = config.model.expert
    weights = _cast(weights, folder, expert, dtype)
    copied = copyable_entries(folder.root, skip=expert)  # a named pipe or a link loop: refused before writing
    needed = tensor_bytes(weights) + sum(folder_bytes(e) if e.is_dir() else e.stat().st_size for e in copied)
    with _writing(destination, needed):
        write_pipeline_folder(folder.root, destination, expert, folder.transformer_dir(expert) / "config.json",
                              weights, max_shard_size)
    return destination, f"a {folder.pipeline_class} folder with the fine-tuned {expert}"


def export_comfyui(source: str | Path, destination: str | Path, dtype: torch.dtype | None = None,
                   force: bool = False) -> tuple[Path, str]:
    """Write the ComfyUI form of a Wan fine-tune's checkpoint into the folder `destination`; returns
    (the file written, what it is). `dtype`: default float32 for a LoRA, bfloat16 for a full fine-tune."""
    from slidefusion.io.comfyui import comfyui_lora_state, file_name, write_comfyui
    from slidefusion.families import original_layout

    ckpt, config, folder, weights, destination = open_fine_tune(source, destination, force, "comfyui")
    expert = config.model.expert
    adapter = folder.adapter(expert)
    layout = original_layout(adapter, "--format comfyui")
    if config.lora.enabled:
        adapters = {k: v.float() for k, v in lora_lib.diffusers_lora_state(weights).items()}
        state = {k: v.to(dtype or torch.float32)
                 for k, v in comfyui_lora_state(adapters, config.lora.scale_alpha, layout).items()}
        name, what = file_name(_run_name(ckpt), folder, expert, None), "a ComfyUI LoRA (models/loras)"
    else:
        dtype = dtype or torch.bfloat16
        names = layout.to_original(weights)
        state = {names[k]: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
        name = file_name(_run_name(ckpt), folder, expert, dtype)
        what = f"a ComfyUI {adapter.class_name} (models/diffusion_models)"
    with _writing(destination, tensor_bytes(state)):
        return write_comfyui(destination, name, state), what


def _run_name(ckpt) -> str:
    """The run's name from its checkpoint's config.json: ComfyUI's file is named after it."""
    from slidefusion.training.config import RUN_NAME

    name = (ckpt.config.get("run") or {}).get("name", "run")
    check(isinstance(name, str) and RUN_NAME.match(name) is not None,
          f"checkpoint {ckpt.path}: config.json: run.name={name!r} must be a plain file name")
    return name


def _writing(destination: Path, needed: int):
    return writing(f"the export {destination.name}", destination.absolute().parent, needed,
                   "the run, its base folder and any earlier --out are untouched")


def _export_lora(folder, config, weights: dict, destination: Path) -> Path:
    import diffusers

    from slidefusion.pretrained import build_on_meta

    cls = getattr(diffusers, folder.pipeline_class)
    check(hasattr(cls, "save_lora_weights"), f"{folder.pipeline_class} cannot load LoRA weights (diffusers has no "
                                             "LoRA loader for it); train without lora.rank to export a full folder")
    state = {k: v.float() for k, v in lora_lib.diffusers_lora_state(weights).items()}
    meta = build_on_meta(folder, config.model.expert)
    metadata = lora_lib.peft_config(meta, config.lora, folder.adapter(config.model.expert).lora_targets).to_dict()
    metadata = {k: (sorted(v) if isinstance(v, set) else v) for k, v in metadata.items()}
    with _writing(destination, tensor_bytes(state)):
        return write_lora(cls, destination, state, metadata)
