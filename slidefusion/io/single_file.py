"""A single-file transformer (Wan's original layout, as the Wan repository and ComfyUI ship it, or
a diffusers one) read as the transformer of a diffusers folder.

    entries = single_file_entries(path, layout, cls)  # the file's tensors under their diffusers names
    check_entries(entries, meta_model, path, root)    # names and shapes against the folder's config

Only the header is read here. Every original name maps to one diffusers name and no tensor changes
shape, so the conversion is a rename of the header's entries: the tensors then stream one at a time
(`slidefusion.io.safetensors_stream.stream_tensors`, each cast to the dtype asked for), and host
memory peaks at the converted weights plus one tensor, as for a folder's shards.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from torch import nn

from slidefusion.core.errors import UserError, check
from slidefusion.io.safetensors_stream import TensorEntry, read_header

_SCALED_FP8 = ("scale_weight", "scaled_fp8", "weight_scale", "comfy_quant")  # ComfyUI's quantised releases


def single_file_entries(path: str | Path, layout, class_name: str, what: str = "model.transformer") -> list[TensorEntry]:
    """The tensors of `path` under the diffusers names of `class_name`, in file order; `layout`: the
    family's original-layout module (`ModelAdapter.layout`). A one-line UserError for a missing file,
    another format, another family or layout."""
    path = Path(path)
    check(path.is_file(), f"{what}={path} is not a file; give a .safetensors transformer file")
    check(path.suffix == ".safetensors", f"{what}={path} is not a .safetensors file; valid: a {class_name} "
                                         "in safetensors (GGUF, .pt and .ckpt files are not read)")
    try:
        entries = read_header(path)
    except UserError as error:
        raise UserError(f"{what}={path}: {error}") from None
    names = [e.name for e in entries]
    check(bool(names), f"{what}={path} holds no tensors")
    scaled = next((n for n in names if n.rsplit(".", 1)[-1] in _SCALED_FP8), None)
    check(scaled is None, f"{what}={path} is a scaled-fp8 release (it holds {scaled}); give the bf16, fp16 or fp32 "
                          "file of the same model")
    kind = layout.layout_of(names)
    check(kind is not None, f"{what}={path} is not a {class_name} in its original layout or diffusers' (it holds "
                            f"e.g. {names[0]}); a LoRA, another family's model or a VAE?")
    if kind == "diffusers":
        return entries
    renamed = []
    for entry in entries:
        name = layout.diffusers_name(entry.name)
        check(name is not None, f"{what}={path}: weight {entry.name} has no place in {class_name} (a variant "
                                "of the family it does not cover, e.g. VACE or Animate?)")
        renamed.append(dataclasses.replace(entry, name=name))
    return renamed


def check_entries(entries: list[TensorEntry], model: nn.Module, path: Path, root: Path,
                  what: str = "model.transformer") -> None:
    """Every weight of `model` (meta is enough) once in `entries`, with its shape, and nothing else."""
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    held = {e.name: e.shape for e in entries}
    config = f"the transformer config of {root}"
    wrong = next((n for n, s in held.items() if n in expected and s != expected[n]), None)
    if wrong is not None:
        raise UserError(f"{what}={path}: weight {wrong} is {held[wrong]} in the file but {expected[wrong]} in "
                        f"{config}: a model of another size (e.g. a 14B file for a 1.3B folder)")
    extra = [n for n in held if n not in expected]
    if extra:
        raise UserError(f"{what}={path} holds {len(extra)} weight(s) {config} does not build, e.g. {extra[0]} "
                        "(an image-to-video file for a text-to-video folder, or the reverse?)")
    missing = [n for n in expected if n not in held]
    if missing:
        raise UserError(f"{what}={path} lacks {len(missing)} weight(s) of {config}, e.g. {missing[0]} "
                        "(a text-to-video file for an image-to-video folder, or a truncated file?)")
