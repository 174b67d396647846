"""A transformer's config.json and weights, checked before diffusers builds anything from them.

diffusers builds whatever a config says: 0 heads divide by zero, a negative head count makes a
negative tensor size, a string layer count or a NaN width fails deep inside torch, 0 layers builds
a model with no blocks, and a million layers keeps the constructor busy for an hour. The checks
here read the class's own signature (a size whose default is an int must be an int, a float a
finite number, a tuple of ints as many ints), then count the parameters the config implies on the
meta device from a model of one and two layers (no memory, milliseconds) and compare them with the
tensors the weight files hold (their headers only), before the real model is built.
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

from torch import nn

from slidefusion.core.errors import UserError, check

LAYER_KEY = re.compile(r"^num_(\w+_)?layers$")  # num_layers, num_single_layers, num_refiner_layers


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _problem(default, value) -> str | None:
    """What is wrong with `value` for a parameter whose default is `default`, or None."""
    if value is None or isinstance(default, bool):
        return None  # None: the class's own rule (e.g. out_channels = in_channels); flags are not sizes
    if _is_int(default) or (default is None and _is_int(value)):
        low = 0 if default == 0 else 1
        return None if _is_int(value) and value >= low else f"must be an int >= {low}"
    if isinstance(default, float) or (default is None and isinstance(value, float)):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        return None if ok else "must be a finite number >= 0"
    if isinstance(default, (tuple, list)) and default and all(_is_int(d) for d in default):
        ok = isinstance(value, (list, tuple)) and len(value) == len(default) and all(_is_int(v) and v >= 1 for v in value)
        return None if ok else f"must be {len(default)} ints >= 1, like {list(default)}"
    return None


def check_transformer_config(cls: type[nn.Module], config: dict, where: str) -> None:
    """UserError naming the first size in `config` that `cls` cannot be built with."""
    params = inspect.signature(cls.__init__).parameters
    for key, value in config.items():
        if key in params and not key.startswith("_"):
            problem = _problem(params[key].default, value)
            if problem:
                raise UserError(f"{where}: {key}={value!r} {problem} (a size of {cls.__name__}); "
                                "the file is damaged or was edited by hand")


def _count(cls, config: dict) -> tuple[int, int]:
    """(state-dict elements, buffer bytes) of `cls(config)`, built wholly on the meta device."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=True):
        model = cls.from_config(config)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return sum(t.numel() for t in model.state_dict().values()), buffers


def expected_elements(cls, config: dict) -> tuple[int, int]:
    """(state-dict elements, buffer bytes) the config implies, from models of one and two layers per
    layer count (every layer of a list is alike, so the count is linear in each)."""
    layers = {k: v for k, v in config.items() if LAYER_KEY.match(k) and _is_int(v)}
    one, buffers = _count(cls, {**config, **dict.fromkeys(layers, 1)})
    total = one
    for key, n in layers.items():
        two = _count(cls, {**config, **dict.fromkeys(layers, 1), key: 2})[0]
        total += (n - 1) * (two - one)
    return total, buffers


def check_size(cls, config: dict, entries, where: str) -> None:
    """The parameters `config` implies against the tensors the weight files hold (`entries`), and
    its computed buffers against the host memory, before building: a wrong layer count fails here."""
    from slidefusion.offload.plan.plan import available_host_memory, human

    try:
        implied, buffers = expected_elements(cls, config)
    except (TypeError, ValueError, ArithmeticError, RuntimeError, AttributeError, KeyError) as error:
        raise UserError(f"{where}: diffusers cannot build a {cls.__name__} from it ({type(error).__name__}: "
                        f"{str(error).splitlines()[0] if str(error) else ''})") from None
    held = sum(math.prod(e.shape) for e in entries)
    layers = ", ".join(f"{k}={v}" for k, v in config.items() if LAYER_KEY.match(k))
    # far more than the files hold: refused before building (a near miss is built, cheaply, and
    # `check_weights_fit` names the first tensor that differs)
    check(implied <= 2 * held + 2**20,
          f"{where} describes a model of {implied:,} weights ({layers}) but the weight files hold {held:,}; "
          "config.json and the weights do not match")
    free = available_host_memory()
    check(free is None or buffers <= free, f"{where}: the tables {cls.__name__} computes from it (e.g. rope_max_seq_len) "
                                           f"need {human(buffers)} of host memory; {human(free)} is available")


def check_weights_fit(model: nn.Module, entries, where: str) -> None:
    """Every tensor the model needs is in the weight files (`entries`), with its shape, a float weight
    stored as a float, and the files hold little the model lacks: judged from the headers, before
    any weight is read (or any cache computed)."""
    state = model.state_dict(keep_vars=True)
    for entry in entries:  # in file order, as they would be read
        tensor = state.get(entry.name)
        if tensor is None:
            continue
        check(tuple(entry.shape) == tuple(tensor.shape),
              f"{where}: weight {entry.name} has shape {tuple(entry.shape)} in the folder but {tuple(tensor.shape)} "
              "in the model config.json describes")
        check(entry.dtype.is_floating_point or not tensor.is_floating_point(),
              f"{where}: weight {entry.name} is stored as {entry.dtype} in {entry.path.name}; the model needs "
              "floating-point values there (float32, float16 or bfloat16): the file is damaged or not this model's")
    stored = {e.name for e in entries}
    missing = [n for n in state if n not in stored]
    check(not missing, f"{where}: the folder's weights lack {len(missing)} tensor(s) of the model, e.g. "
                       f"{missing[0] if missing else ''}; config.json and the weights do not match")
    extra = [e for e in entries if e.name not in state]
    # a few stray tensors load with a warning, as in diffusers; a share of the weights (a layer count
    # smaller than the weights') would silently drop trained layers
    check(sum(math.prod(e.shape) for e in extra) <= 0.01 * sum(math.prod(e.shape) for e in entries),
          f"{where}: the weight files hold {len(extra)} tensor(s) the model lacks, e.g. "
          f"{extra[0].name if extra else ''}; config.json and the weights do not match")


def check_transformer_folder(folder: str | Path, key: str = "--model") -> None:
    """A transformer folder (or a pipeline folder's transformer/) of a diffusers class: its sizes as
    `check_transformer_config` judges them and, where it holds weights, the parameters they imply
    against those weights; a plan of a model that cannot be built, or of another model than its
    weights, would be nonsense. A folder that is not such a transformer (of a class the planner sizes)
    is left to the caller."""
    import diffusers

    from slidefusion.families import adapters_with
    from slidefusion.io.diffusers import WEIGHTS, WEIGHTS_INDEX, read_json, weight_entries

    folder = Path(folder)
    path = next((p for p in (folder / "config.json", folder / "transformer" / "config.json") if p.is_file()), None)
    if path is None:
        return
    try:
        config = read_json(path, "transformer config")
    except UserError:
        return  # the caller reads it and says what is wrong in its own words
    name = config.get("_class_name")
    if not isinstance(name, str) or name not in {a.class_name for a in adapters_with("widths")}:
        return  # not a class the planner sizes: the caller says so
    cls = getattr(diffusers, name)
    check_transformer_config(cls, config, f"{key}: {path}")
    if (path.parent / WEIGHTS).is_file() or (path.parent / WEIGHTS_INDEX).is_file():
        check_size(cls, {k: v for k, v in config.items() if not k.startswith("_")}, weight_entries(path.parent),
                   f"{key}: {path}")
