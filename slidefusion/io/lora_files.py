"""LoRA files for sampling (`generate --pretrained DIR --lora FILE_OR_DIR --lora-scale S`): both
layouts slidefusion exports, read back as adapters under diffusers' module names
(`slidefusion.pretrained.lora_merge` checks them against a folder's transformer and merges them).

    adapters = read_lora(path, layout)                 # [LoraModule]: down, up, alpha / rank

Layouts: diffusers' (`export --format diffusers`: pytorch_lora_weights.safetensors, "transformer."
names, peft's `lora_alpha` and `r` in the "lora_adapter_metadata" header entry; without it alpha =
rank, diffusers' rule) and the original one (`export --format comfyui`: "diffusion_model.<original
name>.lora_A/B.weight" or kohya's ".lora_down/up.weight", scaled by ".alpha" / rank where present).
A folder holds exactly one .safetensors file.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from slidefusion.core.errors import UserError, check
from slidefusion.io.diffusers import LORA_WEIGHTS

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
    if (path / LORA_WEIGHTS).is_file():
        return path / LORA_WEIGHTS
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
                    + (f" or the family's original one (\"{layout.LORA_PREFIX}<module>.lora_A.weight\")"
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
        check(module is not None, f"{what}={file}: module {name} has no place in this family's transformer; "
                                  "a LoRA for another model?")
        alpha = tensors.get(f"{layout.LORA_PREFIX}{name}.alpha")
        out.append(LoraModule(module, pair["down"], pair["up"],
                              1.0 if alpha is None else float(alpha) / pair["down"].shape[0]))
    return out
