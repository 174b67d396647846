"""The families, and `adapter_for`: the record of a model, found by its class name (or a base class's).

A family is a module of this package with an `ADAPTERS` tuple; adding one is adding its file (see
docs/design/adding-a-family.md). Every list below derives from the modules' `ADAPTERS`: our own
models first, then the diffusers families by module name.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from torch import nn

from slidefusion.core.errors import UserError
from slidefusion.families.base import ModelAdapter

_SUPPORT = ("base", "records", "registry", "shared")  # the package's own machinery, not families


def _family_modules() -> list[str]:
    names = sorted(m.name for m in pkgutil.iter_modules([str(Path(__file__).parent)]) if m.name not in _SUPPORT)
    return ["ours", *(n for n in names if n != "ours")]


_ALL: tuple[ModelAdapter, ...] = tuple(adapter for name in _family_modules()
                                       for adapter in importlib.import_module(f"slidefusion.families.{name}").ADAPTERS)
ADAPTERS: dict[str, ModelAdapter] = {a.class_name: a for a in _ALL}
FAMILIES: tuple[str, ...] = tuple(dict.fromkeys(a.family for a in _ALL))
# The diffusers transformer classes (every family but our own models).
DIFFUSERS_CLASSES: tuple[str, ...] = tuple(a.class_name for a in _ALL if a.text is not None)


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


def adapters_with(field: str) -> list[ModelAdapter]:
    """The adapters whose `field` is set (not None, not empty), in registry order."""
    return [a for a in _ALL if getattr(a, field)]


def original_layout(adapter: ModelAdapter, what: str):
    """The module of `adapter`'s original single-file layout (`ModelAdapter.layout`), or a UserError
    (`what` leads it) naming the classes that have one."""
    if adapter.layout is None:
        raise UserError(f"{what} has no layout for {adapter.class_name}; supported: "
                        f"{', '.join(a.class_name for a in adapters_with('layout'))}")
    return adapter.layout


def vae_facts(vae_class: str):
    """(image VAE?, its decoder split or None) for a VAE class name, from the families that ship it."""
    image = any(vae_class in a.vae.image for a in _ALL)
    split = next((a.vae.splits[vae_class] for a in _ALL if vae_class in a.vae.splits), None)
    return image, split
