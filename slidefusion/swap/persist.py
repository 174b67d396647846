"""Slide attention that survives `save_pretrained` / `from_pretrained`.

After `use_slide_attention` on a diffusers model, its config records the swap's options under
"slide_attention" (with a note for whoever reads the file), and its offset networks are submodules,
so the model's own `save_pretrained` writes both: config.json and the "....slide_offsets.*" weights
next to the stock ones. Loading it back:

    model = WanTransformer3DModel.from_pretrained(DIR)            # stock modules, offsets dropped
    use_slide_attention(model, from_pretrained=DIR)               # the swap and its trained offsets
    model = slidefusion.pretrained.load_transformer(DIR)          # or both in one step

diffusers alone (without slidefusion) loads the stock model and warns twice: that the config
attribute "slide_attention" (whose note says what it is and how to load it) is ignored, and that the
"slide_offsets" weights were not used. The model it returns runs its stock dense attention with the
saved projections: a different model from the one trained, not the slide-attention one.
`handle.remove()` / `restore_attention` takes the config entry out again.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from torch import nn

from slidefusion.core.errors import UserError, check
from slidefusion.io.diffusers import CONFIG, model_dir, read_json, weight_entries
from slidefusion.io.safetensors_stream import TensorEntry, stream_tensors
from slidefusion.swap.processor import is_offset_weight
from slidefusion.swap.records import SlideOptions

CONFIG_KEY = "slide_attention"
NOTE = ("trained slide-attention offset networks (the slide_offsets.* weights) that diffusers alone does not load: "
        "it runs stock dense attention without them; load with slidefusion: use_slide_attention(model, "
        "from_pretrained=DIR) or slidefusion.pretrained.load_transformer(DIR)")


def record_options(model: nn.Module, options: SlideOptions, handle) -> None:
    """Write `options` into a diffusers model's config (what `save_pretrained` saves), undone with `handle`."""
    if not hasattr(model, "register_to_config"):
        return
    saved = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(options).items()}
    model.register_to_config(**{CONFIG_KEY: {**saved, "note": NOTE}})
    handle._undo.append(lambda: _forget(model))


def _forget(model: nn.Module) -> None:
    # ConfigMixin has no call that drops a key; `register_to_config` rebuilds this same mapping.
    from diffusers.configuration_utils import FrozenDict

    model._internal_dict = FrozenDict({k: v for k, v in model._internal_dict.items() if k != CONFIG_KEY})


def saved_options(config: Mapping) -> SlideOptions | None:
    """The swap a transformer config.json records, or None for a stock model."""
    raw = config.get(CONFIG_KEY)
    if raw is None:
        return None
    check(isinstance(raw, Mapping), f"config.json: {CONFIG_KEY} must be a mapping of slide-attention options")
    fields = {f.name for f in dataclasses.fields(SlideOptions)}
    unknown = sorted(set(raw) - fields - {"note"})
    check(not unknown, f"config.json: {CONFIG_KEY} has unknown option(s) {unknown}; valid: {', '.join(sorted(fields))}")
    try:
        return SlideOptions(**{k: v for k, v in raw.items() if k in fields})
    except UserError as error:
        raise UserError(f"config.json: {CONFIG_KEY}: {error}") from None


def without_options(config: Mapping) -> dict:
    """A config.json without the swap's entry: what the stock class is built from."""
    return {k: v for k, v in config.items() if k != CONFIG_KEY}


def saved_swap(model: nn.Module, path: str | Path) -> tuple[SlideOptions, list[TensorEntry]]:
    """(the options, the offset networks' tensors) the folder `path` (a `save_pretrained` folder, or
    a pipeline folder with a transformer/) saved `model`'s class with; UserError for a folder that is
    not one, or that holds a stock model or another class."""
    directory = model_dir(path, "transformer")
    check(directory is not None, f"from_pretrained={path} is not a diffusers model folder (no config.json, or a "
                                 "pipeline folder without transformer/config.json)")
    config = read_json(directory / CONFIG, "transformer config")
    options = saved_options(config)
    check(options is not None, f"from_pretrained={path}: its config.json has no {CONFIG_KEY} entry, so it was not "
                               "saved from a model with slide attention")
    check(config.get("_class_name") == type(model).__name__,
          f"from_pretrained={path} holds a {config.get('_class_name')}, not a {type(model).__name__}")
    return options, [e for e in weight_entries(directory) if is_offset_weight(e.name)]


def load_offsets(model: nn.Module, entries: list[TensorEntry], path: str | Path) -> None:
    """Copy the saved offset networks `entries` into a swapped `model`'s, after checking that they
    are exactly its offset weights, with its shapes."""
    expected = {k: v for k, v in model.state_dict().items() if is_offset_weight(k)}
    odd = sorted({e.name for e in entries} ^ set(expected))
    check(not odd, f"from_pretrained={path}: its offset weights do not fit this model (e.g. {odd[0] if odd else ''})")
    for key, tensor in stream_tensors(entries):
        check(tuple(tensor.shape) == tuple(expected[key].shape),
              f"from_pretrained={path}: {key} is {tuple(tensor.shape)} there but {tuple(expected[key].shape)} here")
        expected[key].copy_(tensor)
