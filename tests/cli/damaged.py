"""Damaged copies of a tiny Wan pipeline folder, one per way a downloaded or hand-edited folder goes
wrong: configs that diffusers would build nonsense from, a broken pipeline index or scheduler, cut
shards, special files. Each function copies `wan` to `root / name`, damages the copy, returns it."""

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def _copy(wan: Path, root: Path, name: str) -> Path:
    target = Path(root) / name
    shutil.copytree(wan, target)
    return target


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data, allow_nan=True))


def transformer_config(wan: Path, root: Path, name: str, **changes) -> Path:
    """transformer/config.json with `changes` (e.g. num_attention_heads=0)."""
    folder = _copy(wan, root, name)
    _edit_json(folder / "transformer" / "config.json", **changes)
    return folder


def raw_transformer_config(wan: Path, root: Path, name: str, key: str, raw: str) -> Path:
    """transformer/config.json with `key` set to `raw` JSON text (NaN, which json.dumps cannot write
    unquoted in every mode)."""
    folder = _copy(wan, root, name)
    path = folder / "transformer" / "config.json"
    data = json.loads(path.read_text())
    data[key] = "__RAW__"
    path.write_text(json.dumps(data).replace('"__RAW__"', raw))
    return folder


def int_weight(wan: Path, root: Path, name: str) -> Path:
    """A float weight of the transformer stored as int64."""
    folder = _copy(wan, root, name)
    path = folder / "transformer" / "diffusion_pytorch_model.safetensors"
    weights = load_file(path)
    key = next(k for k in sorted(weights) if k.endswith("to_q.weight"))
    weights[key] = weights[key].round().to(torch.int64)
    save_file(weights, path, metadata={"format": "pt"})
    return folder


def model_index(wan: Path, root: Path, name: str, **changes) -> Path:
    folder = _copy(wan, root, name)
    _edit_json(folder / "model_index.json", **changes)
    return folder


def scheduler_config(wan: Path, root: Path, name: str, key: str, raw: str) -> Path:
    folder = _copy(wan, root, name)
    path = folder / "scheduler" / "scheduler_config.json"
    data = json.loads(path.read_text())
    data[key] = "__RAW__"
    path.write_text(json.dumps(data).replace('"__RAW__"', raw))
    return folder


def truncated(wan: Path, root: Path, name: str, component: str) -> Path:
    """The component's safetensors file cut to half its size (an interrupted download)."""
    folder = _copy(wan, root, name)
    path = next((folder / component).glob("*.safetensors"))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return folder


def without(wan: Path, root: Path, name: str, component: str) -> Path:
    folder = _copy(wan, root, name)
    shutil.rmtree(folder / component)
    return folder


def garbage_tokenizer(wan: Path, root: Path, name: str) -> Path:
    folder = _copy(wan, root, name)
    (folder / "tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "model": 42}')
    return folder


def nan_decoder(wan: Path, root: Path, name: str) -> Path:
    """The VAE's last decoder convolution's bias set to NaN: finite latents decode to NaN pixels."""
    folder = _copy(wan, root, name)
    path = folder / "vae" / "diffusion_pytorch_model.safetensors"
    weights = load_file(path)
    key = next(k for k in weights if k.startswith("decoder.conv_out") and k.endswith("bias"))
    weights[key] = torch.full_like(weights[key], float("nan"))
    save_file(weights, path, metadata={"format": "pt"})
    return folder


def special_file(wan: Path, root: Path, name: str, kind: str) -> Path:
    """A named pipe (`fifo`) or a symlink loop (`loop`) inside the folder, next to its components."""
    folder = _copy(wan, root, name)
    if kind == "fifo":
        os.mkfifo(folder / "notes.pipe")
    else:
        os.symlink("loop", folder / "loop")  # a link to itself: resolving it never ends
    return folder
