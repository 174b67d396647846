"""`adapter_for`: the record for a model, found by its class name (or a base class's)."""

from __future__ import annotations

from torch import nn

from slidefusion.adapters.base import ModelAdapter
from slidefusion.adapters.families import DIFFUSERS_ADAPTERS
from slidefusion.adapters.ours import OUR_ADAPTERS
from slidefusion.errors import UserError

ADAPTERS: dict[str, ModelAdapter] = {a.class_name: a for a in OUR_ADAPTERS + DIFFUSERS_ADAPTERS}
DIFFUSERS_CLASSES: tuple[str, ...] = tuple(a.class_name for a in DIFFUSERS_ADAPTERS)


def supported_classes() -> str:
    """The supported class names, for error messages."""
    return ", ".join(ADAPTERS)


def adapter_for_class(class_name: str, **options) -> ModelAdapter:
    """The adapter of a class named `class_name` (e.g. a config.json's `_class_name`)."""
    if class_name not in ADAPTERS:
        raise UserError(f"model class {class_name!r} is not supported; supported: {supported_classes()}")
    return ADAPTERS[class_name].with_options(**options) if options else ADAPTERS[class_name]


def adapter_for(model: nn.Module, **options) -> ModelAdapter:
    """The adapter for `model` (its class or the nearest base class with a record), with `options`
    (e.g. `expand_timesteps=True` for Wan 2.2 TI2V); UserError naming the supported classes."""
    for cls in type(model).__mro__:
        if cls.__name__ in ADAPTERS:
            return adapter_for_class(cls.__name__, **options)
    raise UserError(f"model class {type(model).__name__!r} is not supported; supported: {supported_classes()}")
