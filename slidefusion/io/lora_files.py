"""LoRA files for sampling (`generate --pretrained DIR --lora FILE_OR_DIR --lora-scale S`): both
layouts slidefusion exports, read and merged into the folder's transformer.

    expert, adapters = lora_for(folder, path)          # [LoraModule], checked on the meta device
    apply_lora(parts, path, scale=1.0)                 # W += scale * alpha / rank * B @ A, in place

Layouts: diffusers' (`export --format diffusers`: pytorch_lora_weights.safetensors, "transformer."
names, peft's `lora_alpha` and `r` in the "lora_adapter_metadata" header entry; without it alpha =
rank, diffusers' rule) and the original one (`export --format comfyui`: "diffusion_model.<original
name>.lora_A/B.weight" or kohya's ".lora_down/up.weight", scaled by ".alpha" / rank where present).
A folder holds exactly one .safetensors file. Merging costs nothing per step and suits every engine
(offload, parallel plans) alike; it equals peft's unmerged adapters up to float rounding.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from slidefusion.errors import UserError, check

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
_PAIRS = {"lora_A": "down", "lora_B": "up", "lora_down": "down", "lora_up": "up"}
_KEY = re.compile(r"^(.+)\.(lora_A|lora_B|lora_down|lora_up)\.weight$")


@dataclass(frozen=True)
class LoraModule:
    """One adapted Linear: `module` its diffusers path, `down` (rank, in), `up` (out, rank), and the
    factor the file asks for (alpha / rank)."""

    module: str
    down: Tensor
    up: Tensor
    scale: float


def lora_file(path: str | Path, what: str = "--lora") -> Path:
    """The .safetensors file `path` names: itself, or the one inside a folder."""
    path = Path(path).expanduser()
    check(path.exists(), f"{what}={path} does not exist")
    if path.is_file():
        check(path.suffix == ".safetensors", f"{what}={path} is not a .safetensors file")
        return path
    files = sorted(path.glob("*.safetensors"))
    if (path / DIFFUSERS_FILE).is_file():
        return path / DIFFUSERS_FILE
    check(len(files) == 1, f"{what}={path} holds {len(files)} .safetensors files; give the LoRA file itself"
          if files else f"{what}={path} holds no .safetensors LoRA file")
    return files[0]


def read_lora(path: str | Path, layout=None, what: str = "--lora") -> list[LoraModule]:
    """The adapters of a LoRA file or folder, under diffusers module names (`layout`: the family's
    original-layout module, for files in that layout; None: diffusers' layout only)."""
    from safetensors import safe_open

    file = lora_file(path, what)
    try:
        with safe_open(str(file), "pt") as handle:
            tensors = {k: handle.get_tensor(k) for k in handle.keys()}
            metadata = handle.metadata() or {}
    except Exception as error:  # noqa: BLE001 - a damaged file can make the parser raise nearly anything
        raise UserError(f"{what}={file} is not a readable safetensors file: {str(error).splitlines()[0]}") from None
    check(bool(tensors), f"{what}={file} holds no tensors")
    bad = next((k for k, v in tensors.items() if v.is_floating_point() and not torch.isfinite(v).all()), None)
    check(bad is None, f"{what}={file}: {bad} holds NaN or infinity")
    if any(k.startswith("transformer.") for k in tensors):
        return _diffusers_modules(tensors, metadata, file, what)
    original = layout is not None and any(k.startswith(layout.LORA_PREFIX) for k in tensors)
    check(original, f"{what}={file} is not a LoRA in diffusers' layout (\"transformer.<module>.lora_A.weight\")"
                    + (f" or {layout.FAMILY}'s original one (\"{layout.LORA_PREFIX}<module>.lora_A.weight\")"
                       if layout is not None else "") + f"; it holds e.g. {next(iter(tensors))}")
    return _original_modules(tensors, layout, file, what)


def _pairs(tensors: dict, strip: str, file: Path, what: str) -> dict[str, dict[str, Tensor]]:
    modules: dict[str, dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        if key.endswith(".alpha"):
            continue
        match = _KEY.match(key[len(strip):] if key.startswith(strip) else "")
        check(match is not None, f"{what}={file}: {key} is not a LoRA weight this reader knows "
                                 "(lora_A/lora_B or lora_down/lora_up; DoRA, LoKr and LoHa are not read)")
        modules.setdefault(match.group(1), {})[_PAIRS[match.group(2)]] = tensor
    for module, pair in modules.items():
        check(set(pair) == {"down", "up"}, f"{what}={file}: module {module} lacks its down or up weight")
    return modules


def _diffusers_modules(tensors, metadata, file, what) -> list[LoraModule]:
    """peft's scaling from the adapter config diffusers writes ("transformer."-prefixed keys):
    lora_alpha (or an alpha_pattern entry) over the module's rank, or its square root with rsLoRA."""
    raw = json.loads(metadata.get("lora_adapter_metadata", "{}") or "{}")
    config = {k.split(".", 1)[1] if k.startswith("transformer.") else k: v for k, v in raw.items()}
    check(not config.get("use_dora"), f"{what}={file} is a DoRA adapter; only plain LoRA is merged")
    out = []
    for module, pair in _pairs(tensors, "transformer.", file, what).items():
        rank = pair["down"].shape[0]
        alpha = config.get("lora_alpha", rank)  # no metadata: alpha = rank, diffusers' rule
        for pattern, value in (config.get("alpha_pattern") or {}).items():
            if re.match(rf"(.*\.)?({pattern})$", module):
                alpha = value
        factor = float(alpha) / (math.sqrt(rank) if config.get("use_rslora") else rank)
        out.append(LoraModule(module, pair["down"], pair["up"], factor))
    return out


def _original_modules(tensors, layout, file, what) -> list[LoraModule]:
    out = []
    for name, pair in _pairs(tensors, layout.LORA_PREFIX, file, what).items():
        module = layout.diffusers_name(name)
        check(module is not None, f"{what}={file}: module {name} has no place in a {layout.FAMILY} transformer; "
                                  "a LoRA for another model?")
        alpha = tensors.get(f"{layout.LORA_PREFIX}{name}.alpha")
        out.append(LoraModule(module, pair["down"], pair["up"],
                              1.0 if alpha is None else float(alpha) / pair["down"].shape[0]))
    return out


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
    from slidefusion.io.layouts import LAYOUTS
    from slidefusion.pretrained import build_on_meta

    file = lora_file(path, what)
    adapters = read_lora(file, LAYOUTS.get(folder.adapter().family), what)
    expert = lora_expert(folder, file, what)
    check_lora(build_on_meta(folder, expert), adapters, what)
    return expert, adapters


def apply_lora(parts, path: str | Path, scale: float = 1.0, what: str = "--lora") -> None:
    """Merge a LoRA file or folder into the loaded transformer of `parts` (`PretrainedParts`) it is for."""
    expert, adapters = lora_for(parts.folder, path, what)
    names = [e.name for e in parts.folder.experts()]
    merge_lora(parts.experts[names.index(expert)][0], adapters, scale, what)
