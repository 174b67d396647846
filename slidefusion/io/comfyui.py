"""ComfyUI's files for a fine-tune of a Wan folder (`slidefusion export --format comfyui`, whose
orchestration is `slidefusion.training.finetune.export.export_comfyui`).

A LoRA becomes one file for ComfyUI's LoRA loaders (models/loras). Each adapted module appears under
its original Wan name with the "diffusion_model." prefix ComfyUI gives the model's own weights:
"<module>.lora_A.weight" (rank, in), "<module>.lora_B.weight" (out, rank) and "<module>.alpha" (a
0-d tensor). ComfyUI scales a module by alpha / rank (rank = lora_A's rows), which is the run's
lora.alpha / lora.rank, peft's own scaling. diffusers' `load_lora_weights` reads the same file (it
converts this layout itself); outside the blocks its reader ignores ".alpha", so there alpha / rank
is folded into lora_B and no alpha is written: ComfyUI then uses scale 1, the same strength.

A full fine-tune becomes one original-layout transformer file (models/diffusion_models), bf16 by
default, as Wan's own releases are laid out: ComfyUI loads it as one of those, and diffusers with
`WanTransformer3DModel.from_single_file(FILE, config=<the source folder's transformer/>)`.

File names, in OUT/: "<run name>.safetensors" (LoRA) or "<run name>_<bf16|fp16|fp32>.safetensors"
(full), with "_high_noise" / "_low_noise" after the run name for a Wan 2.2 A14B expert
(transformer / transformer_2), the names ComfyUI's Wan 2.2 workflows load the pair by.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor

from slidefusion.core.dtypes import short_name
from slidefusion.core.errors import check
from slidefusion.io.checkpoint import contiguous_state
from slidefusion.io.files import atomic_folder

_LORA = re.compile(r"^(.+)\.(lora_[AB])\.weight$")


def comfyui_lora_state(adapters: dict[str, Tensor], alpha: float, layout) -> dict[str, Tensor]:
    """diffusers-layout LoRA weights ("blocks.0.attn1.to_q.lora_A.weight", peft's scaling alpha / rank)
    -> ComfyUI's ("diffusion_model.blocks.0.self_attn.q.lora_A.weight" + ".alpha"), same strength;
    `layout`: the family's original-layout module (`ModelAdapter.layout`, e.g. `wan_layout`)."""
    modules: dict[str, dict[str, Tensor]] = {}
    for name, tensor in adapters.items():
        match = _LORA.match(name)
        check(match is not None, f"LoRA weight {name} is not a lora_A / lora_B weight")
        modules.setdefault(match.group(1), {})[match.group(2)] = tensor
    out = {}
    for module, pair in sorted(modules.items()):
        check(set(pair) == {"lora_A", "lora_B"}, f"LoRA module {module} lacks its lora_A or lora_B weight")
        original = layout.original_name(module)
        check(original is not None, f"LoRA module {module} has no name in the family's original layout")
        key, rank = layout.LORA_PREFIX + original, pair["lora_A"].shape[0]
        down, up = pair["lora_A"], pair["lora_B"]
        if layout.alpha_is_read(original):
            out[f"{key}.alpha"] = torch.tensor(float(alpha))
        else:
            up = up * (alpha / rank)
        out[f"{key}.lora_A.weight"], out[f"{key}.lora_B.weight"] = down, up
    return out


def file_name(run_name: str, folder, expert: str, dtype: torch.dtype | None) -> str:
    """See the module docstring: run name, the A14B expert's noise level, the full file's dtype."""
    experts = [e.name for e in folder.experts()]
    noise = "" if len(experts) == 1 else ("_high_noise" if expert == experts[0] else "_low_noise")
    return f"{run_name}{noise}{'' if dtype is None else '_' + short_name(dtype)}.safetensors"


def write_comfyui(destination: Path, name: str, state: dict[str, Tensor]) -> Path:
    """The folder `destination` holding one file `name` with `state`, written atomically; returns the file."""
    with atomic_folder(Path(destination)) as tmp:
        save_file(contiguous_state(state), tmp / name, metadata={"format": "pt"})
    return Path(destination) / name
