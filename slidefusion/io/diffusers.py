"""The diffusers folder layout, decided in one place: what kind of folder a path is, where a
component's config lives, and a model's safetensors weights (read shard by shard, written sharded).

    pipeline folder   model_index.json naming its components, one subfolder each
                      (transformer/ vae/ text_encoder/ tokenizer/ scheduler/ ...)
    model folder      config.json (with `_class_name`) and diffusion_pytorch_model*.safetensors:
                      a bare transformer, a VAE
    LoRA folder       pytorch_lora_weights.safetensors alone (`save_lora_weights`): no model, an
                      adapter for one (read by `slidefusion.io.lora_files`)
Weights are one `WEIGHTS` file, or numbered shards and `WEIGHTS_INDEX` mapping each tensor to its shard.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from slidefusion.errors import UserError, check
from slidefusion.io.safetensors_stream import TensorEntry, read_header

MODEL_INDEX, CONFIG = "model_index.json", "config.json"
WEIGHTS = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = WEIGHTS + ".index.json"
LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
PIPELINE, MODEL, LORA = "pipeline", "model", "lora"


def read_json(path: Path, what: str) -> dict:
    """A JSON object from `path`, or a one-line UserError naming `what` it was meant to be."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{what} {path} is unreadable: {type(err).__name__}") from None
    check(isinstance(data, dict), f"{what} {path} is not a JSON object")
    return data


def folder_kind(path: str | Path) -> str | None:
    """PIPELINE (model_index.json), MODEL (config.json), LORA (LoRA weights alone), or None (none of
    them, or not a folder)."""
    path = Path(path).expanduser()
    if (path / MODEL_INDEX).is_file():
        return PIPELINE
    if (path / CONFIG).is_file():
        return MODEL
    if (path / LORA_WEIGHTS).is_file():
        return LORA
    return None


def is_pipeline_folder(path: str | Path) -> bool:
    """A diffusers pipeline folder (model_index.json), not one of our checkpoints or a bare model."""
    return folder_kind(path) == PIPELINE


def model_dir(path: str | Path, component: str) -> Path | None:
    """The folder with `component`'s config.json: `path` itself when it is a model folder, its
    `component/` subfolder when it is a pipeline folder; None when neither holds one."""
    path = Path(path).expanduser()
    kind = folder_kind(path)
    found = path if kind == MODEL else path / component if kind == PIPELINE else None
    return found if found is not None and (found / CONFIG).is_file() else None


def weight_entries(directory: Path) -> list[TensorEntry]:
    """The tensors of `directory`'s safetensors weights, single file or sharded, after checking that
    every shard the index names exists and holds exactly the tensors the index maps to it."""
    index_path, single = directory / WEIGHTS_INDEX, directory / WEIGHTS
    if index_path.is_file():
        return _sharded_entries(directory, read_json(index_path, "shard index"))
    if single.is_file():
        return read_header(single)
    others = sorted(p.name for p in directory.glob("diffusion_pytorch_model*"))
    hint = f"found {', '.join(others)}; valid: safetensors weights (save_pretrained(safe_serialization=True))" \
        if others else f"expected {WEIGHTS} or {WEIGHTS_INDEX}"
    raise UserError(f"no safetensors weights in {directory}: {hint}")


def _sharded_entries(directory: Path, index: dict) -> list[TensorEntry]:
    weight_map = index.get("weight_map")
    check(isinstance(weight_map, dict) and weight_map, f"shard index {directory / WEIGHTS_INDEX} has no weight_map")
    entries = []
    for shard in dict.fromkeys(weight_map.values()):  # file order of first mention
        path = directory / str(shard)
        check(path.is_file(), f"missing weights shard {shard} in {directory} (listed in {WEIGHTS_INDEX})")
        held = read_header(path)
        for entry in held:
            check(weight_map.get(entry.name) == shard,
                  f"shard index mismatch in {directory}: {shard} holds {entry.name}, which {WEIGHTS_INDEX} "
                  f"maps to {weight_map.get(entry.name)}")
        names = {e.name for e in held}
        absent = [n for n, s in weight_map.items() if s == shard and n not in names]
        if absent:
            raise UserError(f"shard index mismatch in {directory}: {WEIGHTS_INDEX} maps {absent[0]} to {shard}, "
                            f"which does not hold it ({len(absent)} such)")
        entries.extend(held)
    return entries


def write_weights(directory: Path, weights: dict[str, torch.Tensor], max_shard_size: int) -> None:
    """A model's weights into `directory` as diffusers reads them: one `WEIGHTS` file, or numbered
    shards of at most `max_shard_size` bytes (a larger tensor gets a shard alone) and `WEIGHTS_INDEX`.
    huggingface_hub's writer does the splitting and the index, as diffusers' own save_pretrained."""
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(weights, directory, filename_pattern=WEIGHTS.replace(".safetensors", "{suffix}.safetensors"),
                          max_shard_size=max_shard_size, metadata={"format": "pt"})
