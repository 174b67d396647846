"""Build a folder's transformer without memory (meta device), stream its weights, materialise it.

    folder = open_folder(path)
    model = build_on_meta(folder)                       # parameters on "meta", buffers real
    for name, tensor in iter_weights(folder, dtype=torch.bfloat16):
        ...                                             # e.g. the offload engine's load_weights
    model = load_transformer(folder, dtype=torch.bfloat16)   # the resident equivalent

The dtype rule is diffusers' own (`_keep_in_fp32_modules` stay float32), so `load_transformer`
gives the same tensors as `ModelClass.from_pretrained(dir, torch_dtype=dtype)`.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import Tensor, nn

from slidefusion.core.errors import UserError, check
from slidefusion.pretrained.folder import PretrainedFolder, open_folder
from slidefusion.io.safetensors_stream import stream_tensors

log = logging.getLogger(__name__)


def _folder(folder: PretrainedFolder | str | Path) -> PretrainedFolder:
    return folder if isinstance(folder, PretrainedFolder) else open_folder(folder)


def transformer_class(folder: PretrainedFolder | str | Path, name: str = "transformer") -> type[nn.Module]:
    """The diffusers class config.json names (`open_folder` checked that it is a supported one)."""
    import diffusers

    return getattr(diffusers, _folder(folder).transformer_config(name)["_class_name"])


def build_on_meta(folder: PretrainedFolder | str | Path, name: str = "transformer",
                  check_weights: bool = True) -> nn.Module:
    """The transformer built from config.json with every parameter on the meta device (no memory);
    buffers computed at construction (RoPE tables, position tables) are real, as in diffusers. A
    transformer saved with slide attention is swapped as it was saved (its offset networks on meta
    too; `slidefusion.swap.persist`). `check_weights`: the weight files' headers against the config
    first (False: the config alone, for weights that come from elsewhere, a single file)."""
    from accelerate import init_empty_weights

    from slidefusion.pretrained.config_check import check_size, check_transformer_config, check_weights_fit
    from slidefusion.swap import use_slide_attention
    from slidefusion.swap.persist import saved_options, without_options

    folder = _folder(folder)
    cls = transformer_class(folder, name)
    saved = folder.transformer_config(name)
    config = without_options(saved)  # the stock class's config; the swap goes on after building
    where = f"pretrained={folder.root}: {(folder.transformer_dir(name) / 'config.json').relative_to(folder.root)}"
    check_transformer_config(cls, config, where)
    entries = folder.weight_entries(name) if check_weights else None
    if entries is not None:
        check_size(cls, config, entries, where)  # before building: a million layers would take an hour
    try:
        with init_empty_weights(include_buffers=False):
            model = cls.from_config(config)
    except (TypeError, ValueError, ArithmeticError, RuntimeError, AttributeError, KeyError) as error:
        raise UserError(f"{where}: diffusers cannot build a {cls.__name__} from it ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''})") from None
    slide = saved_options(saved)
    if slide is not None:
        use_slide_attention(model, **dataclasses.asdict(slide))
    if entries is not None:
        check_weights_fit(model, entries, where)
    return model.eval()


def iter_weights(folder: PretrainedFolder | str | Path, name: str = "transformer",
                 dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(state-dict name, CPU tensor) pairs, shard by shard, one tensor read at a time, converted to
    `dtype` by diffusers' rule (None: as stored). The shard index is checked before the first read."""
    folder = _folder(folder)
    keep = getattr(transformer_class(folder, name), "_keep_in_fp32_modules", None) or ()
    entries = folder.weight_entries(name)
    return stream_tensors(entries, dtype, keep)


def assign_weights(model: nn.Module, named_tensors: Iterable[tuple[str, Tensor]]) -> nn.Module:
    """Put each tensor into `model` in place of its (meta) parameter or buffer, without copying.

    UserError for a shape that differs from the model's or for weights the folder lacks; tensors
    the model does not have are skipped with one warning (as diffusers does), except the ones the
    class declares ignorable."""
    expected = model.state_dict(keep_vars=True)
    seen, unexpected = set(), []
    for name, tensor in named_tensors:
        old = expected.get(name)
        if old is None:
            unexpected.append(name)
            continue
        check(tuple(old.shape) == tuple(tensor.shape),
              f"weight {name} has shape {tuple(tensor.shape)} in the folder but {tuple(old.shape)} in the model "
              "its config.json builds")
        owner, _, leaf = name.rpartition(".")
        module = model.get_submodule(owner)
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(tensor, requires_grad=old.requires_grad)
        else:
            module._buffers[leaf] = tensor
        seen.add(name)
    missing = [n for n in expected if n not in seen]
    if missing:
        raise UserError(f"the folder's weights lack {len(missing)} tensor(s) of the model, e.g. {missing[0]}; "
                        "config.json and the weights do not match")
    ignore = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()]
    unexpected = [n for n in unexpected if not any(p.search(n) for p in ignore)]
    if unexpected:
        log.warning("skipped %d weight(s) the model does not have, e.g. %s", len(unexpected), unexpected[0])
    return model


def load_transformer(folder: PretrainedFolder | str | Path, name: str = "transformer",
                     dtype: torch.dtype | None = None) -> nn.Module:
    """The transformer, resident on the CPU in eval mode, built on meta and filled from
    `iter_weights`: host memory peaks at the weights plus one tensor, not a second copy."""
    folder = _folder(folder)
    return assign_weights(build_on_meta(folder, name), iter_weights(folder, name, dtype))
