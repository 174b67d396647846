"""model_index.json and scheduler_config.json, checked when a folder is opened.

A pipeline index names its pipeline class and, per component, a [library, class] pair; it also
carries pipeline settings (Wan 2.2's `boundary_ratio`, `expand_timesteps`). A hand-edited or
damaged index would otherwise fail deep inside diffusers (an index error, a missing attribute) or,
worse, be read silently: `boundary_ratio: 2.0` leaves the high-noise expert only sigma 1 to train.
"""

from __future__ import annotations

import math
from pathlib import Path

from slidefusion.core.errors import check, unknown_value

COMPONENTS = ("transformer", "transformer_2", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2",
              "scheduler", "image_encoder", "image_processor", "feature_extractor")
POSITIVE = ("shift", "flow_shift")  # the flow schedulers' sigma shift: > 0


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_index(index: dict, root: Path) -> None:
    """UserError naming the first entry of `index` (model_index.json) that is malformed."""
    import diffusers

    where = f"pretrained={root}: model_index.json"
    name = index.get("_class_name")
    pipeline = getattr(diffusers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(pipeline, type) and issubclass(pipeline, diffusers.DiffusionPipeline)):
        from slidefusion.families import DIFFUSERS_CLASSES, adapter_for_class

        known = [p for c in DIFFUSERS_CLASSES for p in adapter_for_class(c).pipelines]
        raise unknown_value(f"{where}: _class_name", name, known, noun="not a diffusers pipeline class")
    for key, value in index.items():
        if key.startswith("_"):
            continue
        pair = isinstance(value, list) and len(value) == 2 and (
            all(isinstance(v, str) and v for v in value) or value == [None, None])
        check(pair or (key not in COMPONENTS and not isinstance(value, list)),
              f"{where}: {key}={value!r} must be a [library, class] pair, e.g. [\"diffusers\", \"AutoencoderKLWan\"] "
              "(or [null, null] for an absent component)")
    ratio = index.get("boundary_ratio")
    check(ratio is None or (_number(ratio) and 0 < ratio < 1),
          f"{where}: boundary_ratio={ratio!r} must be a number in (0, 1) (the share of the timesteps, from the noisy "
          "end, that transformer denoises) or null")


def check_option(index: dict, key: str, default, root: Path) -> None:
    """A pipeline setting an adapter reads (e.g. expand_timesteps) is of its default's kind."""
    value = index[key]
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif _number(default):
        ok = _number(value) and math.isfinite(value)
    else:
        ok = True
    check(ok, f"pretrained={root}: model_index.json: {key}={value!r} must be "
              + ("true or false" if isinstance(default, bool) else "a finite number"))


def check_scheduler(config: dict, path: Path) -> None:
    """Every number in scheduler_config.json finite, the shift > 0, num_train_timesteps an int >= 1."""
    for key, value in config.items():
        if _number(value):
            check(math.isfinite(value), f"scheduler config {path}: {key}={value!r} must be a finite number")
            check(key not in POSITIVE or value > 0, f"scheduler config {path}: {key}={value!r} must be > 0")
    steps = config.get("num_train_timesteps", 1000)
    check(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1,
          f"scheduler config {path}: num_train_timesteps={steps!r} must be an int >= 1")
