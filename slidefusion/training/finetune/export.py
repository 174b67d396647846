"""`slidefusion export --format diffusers`: a fine-tune of a diffusers folder back into diffusers' layout.

A full fine-tune becomes a pipeline folder: every component of the source folder copied untouched
(model_index.json, text encoders, tokenizers, VAE, scheduler, the other Wan 2.2 expert), and the
trained transformer as config.json plus safetensors weights, sharded past `max_shard_size` with
diffusers' index file, each tensor in the dtype the source stored it in (or `dtype`, by diffusers'
rule: `_keep_in_fp32_modules` stay float32). `<Pipeline>.from_pretrained(OUT)` loads it.

A LoRA fine-tune becomes the adapter alone, in the layout `pipe.load_lora_weights(OUT)` reads
(pytorch_lora_weights.safetensors with "transformer."-prefixed names and the adapter's peft config
as metadata), written by the family pipeline's own `save_lora_weights`.

A run with `model.attention=slide` (or neighborhood) is refused with one line: diffusers' stock
transformer classes cannot hold its offset networks, and a folder without them would run dense
attention, a different model; `generate --checkpoint` samples such a run as trained.

Either is written into a temporary folder and renamed into place (`atomic_folder`), after
`check_export_destination`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from slidefusion.errors import UserError, check
from slidefusion.training.checkpoint import (
    atomic_folder,
    check_export_destination,
    contiguous_state,
    first_nonfinite,
    load_checkpoint,
    resolve_checkpoint,
)
from slidefusion.training.finetune import lora as lora_lib

WEIGHTS, INDEX = "diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.safetensors.index.json"
DEFAULT_SHARD = 5 * 2**30


def shards(weights: dict[str, torch.Tensor], max_bytes: int) -> list[list[str]]:
    """Names grouped into shards of at most `max_bytes` each (a larger tensor gets a shard alone)."""
    groups, size = [[]], 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def write_weights(folder: Path, weights: dict[str, torch.Tensor], max_bytes: int) -> list[str]:
    """diffusers' transformer weights in `folder`: one file, or numbered shards and their index."""
    groups = shards(weights, max_bytes)
    if len(groups) == 1:
        save_file(contiguous_state(weights), folder / WEIGHTS, metadata={"format": "pt"})
        return [WEIGHTS]
    names, weight_map = [], {}
    for i, group in enumerate(groups, start=1):
        name = WEIGHTS.replace(".safetensors", f"-{i:05d}-of-{len(groups):05d}.safetensors")
        save_file(contiguous_state({k: weights[k] for k in group}), folder / name, metadata={"format": "pt"})
        weight_map.update({k: name for k in group})
        names.append(name)
    total = sum(t.numel() * t.element_size() for t in weights.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return [*names, INDEX]


def _cast(weights: dict, folder, expert: str, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """Each tensor as the source stored it, or as `dtype` by diffusers' rule."""
    from slidefusion.pretrained import transformer_class
    from slidefusion.pretrained.safetensors_io import target_dtype

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
    from slidefusion.pretrained import open_folder
    from slidefusion.training.config import TrainConfig, build

    destination = check_export_destination(resolve_checkpoint(source), destination, force)
    ckpt = load_checkpoint(source)
    try:
        config = build(TrainConfig, ckpt.config)
    except UserError as error:
        raise UserError(f"checkpoint {ckpt.path}: config.json: {error}") from None
    if not config.pretrained:
        raise UserError(f"--format {fmt} needs a checkpoint of a diffusers fine-tune (model.pretrained=DIR); "
                        f"{ckpt.path} trained our own {config.model.arch}: use --format slidefusion")
    check(config.model.attention == "dense",
          f"--format {fmt} cannot hold slide attention: {ckpt.path} trained model.attention={config.model.attention} "
          "and the stock model classes have no place for its offset networks (they would run dense attention); "
          f"sample it with `slidefusion generate --checkpoint {ckpt.path}`")
    folder = open_folder(config.model.pretrained, config.model.transformer, config.model.expert)
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
    with atomic_folder(destination) as tmp:
        for entry in sorted(folder.root.iterdir()):
            if entry.name == expert or entry.name.startswith("."):
                continue
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp / entry.name)
        (tmp / expert).mkdir()
        shutil.copy2(folder.transformer_dir(expert) / "config.json", tmp / expert / "config.json")
        write_weights(tmp / expert, weights, max_shard_size)
    return destination, f"a {folder.pipeline_class} folder with the fine-tuned {expert}"


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
    with atomic_folder(destination) as tmp:
        cls.save_lora_weights(str(tmp), transformer_lora_layers=contiguous_state(state),
                              transformer_lora_adapter_metadata=metadata)
    return destination
