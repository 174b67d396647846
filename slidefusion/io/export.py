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

from slidefusion.core.errors import check
from slidefusion.io.checkpoint import contiguous_state
from slidefusion.io.diffusers import CONFIG, write_weights
from slidefusion.io.files import atomic_folder

DEFAULT_SHARD = 5 * 2**30  # bytes: diffusers' own default largest shard (5GB as it counts)


def write_pipeline_folder(source: Path, destination: Path, component: str, config: Path,
                          weights: dict[str, torch.Tensor], max_shard_size: int = DEFAULT_SHARD) -> Path:
    """`destination`: every entry of pipeline folder `source` copied untouched but `component`
    (and hidden names), which is written anew from `config` (a config.json) and `weights`."""
    entries = copyable_entries(Path(source), skip=component)
    with atomic_folder(Path(destination)) as tmp:
        for entry in entries:
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, tmp / entry.name)
        (tmp / component).mkdir()
        shutil.copy2(config, tmp / component / CONFIG)
        write_weights(tmp / component, contiguous_state(weights), max_shard_size)
    return Path(destination)


def copyable_entries(root: Path, skip: str) -> list[Path]:
    """The entries of pipeline folder `root` a copy takes (all but `skip` and hidden ones), after
    checking that everything under them is a regular file or folder (links followed): a named pipe
    would block or fail the copy, a link loop or a dangling link fail it halfway."""
    entries = [e for e in sorted(root.iterdir()) if e.name != skip and not e.name.startswith(".")]
    for entry in entries:
        for path in [entry, *(entry.rglob("*") if _is_folder(entry) else ())]:
            try:
                target = path.resolve(strict=True)
                kind = None if target.is_dir() or target.is_file() else "a named pipe, socket or device file"
            except (OSError, RuntimeError) as error:  # ELOOP, or a link to nothing
                kind = f"a link that leads nowhere ({getattr(error, 'strerror', None) or error})"
            check(kind is None, f"the base folder {root} holds {path.relative_to(root)}, {kind}; export copies the "
                                "folder's regular files and folders: move it out of the folder and export again")
    return entries


def _is_folder(path: Path) -> bool:
    try:
        return path.resolve(strict=True).is_dir()
    except (OSError, RuntimeError):
        return False


def write_lora(pipeline_class: type, destination: Path, state: dict[str, torch.Tensor], metadata: dict) -> Path:
    """`destination` holding the transformer's LoRA weights `state` (peft names) and `metadata`
    (its peft config as a dict), as `pipeline_class.save_lora_weights` writes them."""
    with atomic_folder(Path(destination)) as tmp:
        pipeline_class.save_lora_weights(str(tmp), transformer_lora_layers=contiguous_state(state),
                                         transformer_lora_adapter_metadata=metadata)
    return Path(destination)
