"""A LoRA file merged into a diffusers folder's transformer, for sampling (`generate --pretrained DIR
--lora FILE_OR_DIR --lora-scale S`, `FolderPipeline.load_lora`); the file is read by
`slidefusion.io.lora_files`, in either layout slidefusion exports.

    expert, adapters = lora_for(folder, path)          # [LoraModule], checked on the meta device
    apply_lora(parts, path, scale=1.0)                 # W += scale * alpha / rank * B @ A, in place

Merging costs nothing per step and suits every engine (offload, parallel plans) alike; it equals
peft's unmerged adapters up to float rounding.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from slidefusion.core.errors import UserError, check
from slidefusion.io.lora_files import LoraModule, lora_file, read_lora
from slidefusion.pretrained.build import build_on_meta


def check_lora(model: nn.Module, adapters: list[LoraModule], what: str = "--lora") -> list[tuple[nn.Linear, LoraModule]]:
    """(layer, adapter) pairs after checking that every adapted module is a Linear of `model` (the
    meta device is enough) with the adapter's shape; a LoRA for another model is one line."""
    targets = []
    for adapter in adapters:
        try:
            layer = model.get_submodule(adapter.module)
        except AttributeError:
            raise UserError(f"{what}: the transformer has no module {adapter.module}; a LoRA for another "
                            f"model ({type(model).__name__} here)?") from None
        check(isinstance(layer, nn.Linear), f"{what}: {adapter.module} is a {type(layer).__name__}, not a Linear")
        shape = (adapter.up.shape[0], adapter.down.shape[-1])
        ok = adapter.down.ndim == adapter.up.ndim == 2 and adapter.up.shape[1] == adapter.down.shape[0]
        check(ok and shape == tuple(layer.weight.shape),
              f"{what}: {adapter.module} is {tuple(adapter.up.shape)} @ {tuple(adapter.down.shape)} in the LoRA but "
              f"{tuple(layer.weight.shape)} in the transformer; a LoRA for another model size?")
        targets.append((layer, adapter))
    return targets


def merge_lora(model: nn.Module, adapters: list[LoraModule], scale: float = 1.0, what: str = "--lora") -> nn.Module:
    """Add `scale` * adapter.scale * up @ down to each adapted Linear's weight, in place, after
    `check_lora` (so a refused LoRA changes nothing)."""
    targets = check_lora(model, adapters, what)
    with torch.no_grad():
        for layer, adapter in targets:
            delta = (adapter.up.double() @ adapter.down.double()) * (scale * adapter.scale)
            layer.weight.add_(delta.to(device=layer.weight.device, dtype=layer.weight.dtype))
    return model


def lora_expert(folder, file: Path, what: str = "--lora") -> str:
    """The transformer a LoRA file is for: the folder's one, or in a two-expert folder (Wan 2.2 A14B)
    the one its name says: "..._high_noise" or "..._low_noise", as `export --format comfyui` names them."""
    experts = [e.name for e in folder.experts()]
    if len(experts) == 1:
        return experts[0]
    noise = [level for level in ("high_noise", "low_noise") if level in file.stem]
    check(len(noise) == 1, f"{what}={file}: {folder.root} has two experts ({', '.join(experts)}); name the LoRA "
                           "file ..._high_noise.safetensors or ..._low_noise.safetensors for the one it was trained for")
    return experts[0] if noise == ["high_noise"] else experts[1]


def lora_for(folder, path: str | Path, what: str = "--lora") -> tuple[str, list[LoraModule]]:
    """(the expert it is for, its adapters) of a LoRA for `folder`, checked against that expert's
    config on the meta device: every mistake fails before any weight is loaded."""
    file = lora_file(path, what)
    adapters = read_lora(file, folder.adapter().layout, what)
    expert = lora_expert(folder, file, what)
    check_lora(build_on_meta(folder, expert), adapters, what)
    return expert, adapters


def apply_lora(parts, path: str | Path, scale: float = 1.0, what: str = "--lora") -> None:
    """Merge a LoRA file or folder into the loaded transformer of `parts` (`PretrainedParts`) it is for."""
    expert, adapters = lora_for(parts.folder, path, what)
    names = [e.name for e in parts.folder.experts()]
    merge_lora(parts.experts[names.index(expert)][0], adapters, scale, what)
