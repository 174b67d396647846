"""Export formats other programs read, written atomically (`files.atomic_folder`).

    diffusers pipeline folder   a copy of the source folder with one component written anew
                                (config.json and sharded safetensors weights, `diffusers.write_weights`):
                                what `<Pipeline>.from_pretrained(OUT)` loads
    diffusers LoRA file         pytorch_lora_weights.safetensors with "transformer."-prefixed names and
                                the adapter's peft config as metadata, written by the family pipeline's
                                own `save_lora_weights`: what `pipe.load_lora_weights(OUT)` loads
The callers decide what goes in (`slidefusion.training.finetune.export`); this module only writes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from slidefusion.io.checkpoint import contiguous_state
from slidefusion.io.diffusers import CONFIG, write_weights
from slidefusion.io.files import atomic_folder

DEFAULT_SHARD = 5 * 2**30  # bytes: diffusers' own default largest shard (5GB as it counts)


def write_pipeline_folder(source: Path, destination: Path, component: str, config: Path,
                          weights: dict[str, torch.Tensor], max_shard_size: int = DEFAULT_SHARD) -> Path:
    """`destination`: every entry of pipeline folder `source` copied untouched but `component`
    (and hidden names), which is written anew from `config` (a config.json) and `weights`."""
    with atomic_folder(Path(destination)) as tmp:
        for entry in sorted(Path(source).iterdir()):
            if entry.name == component or entry.name.startswith("."):
                continue
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp / entry.name)
        (tmp / component).mkdir()
        shutil.copy2(config, tmp / component / CONFIG)
        write_weights(tmp / component, contiguous_state(weights), max_shard_size)
    return Path(destination)


def write_lora(pipeline_class: type, destination: Path, state: dict[str, torch.Tensor], metadata: dict) -> Path:
    """`destination` holding the transformer's LoRA weights `state` (peft names) and `metadata`
    (its peft config as a dict), as `pipeline_class.save_lora_weights` writes them."""
    with atomic_folder(Path(destination)) as tmp:
        pipeline_class.save_lora_weights(str(tmp), transformer_lora_layers=contiguous_state(state),
                                         transformer_lora_adapter_metadata=metadata)
    return Path(destination)
