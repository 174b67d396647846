"""Typed config records from YAML files, JSON and `section.key=value` overrides, and back to plain data.

A config is a tree of dataclasses. `build(cls, data)` fills one from nested dicts, checking every
key and value: an unknown key, or a value of the wrong type, is a `UserError` that names the dotted
key and what would be valid; each record's `__post_init__` then checks its ranges. `plain(record)`
is the inverse (what a run's config.json holds). Field metadata says what is special:
  PROGRAM_SET   set by the program, never by a config file (an engine's device); `plain` leaves it out
  {"parse": f}  a section read by `f(value, dotted_key)` (a model: a preset name, or a folder)
  {"plain": g}  a value `plain` writes as `g(value)`, so that `build` (its "parse") reads it back
"""

import dataclasses
import math
import types
import typing
from pathlib import Path

import torch
import yaml

from slidefusion.core import validate
from slidefusion.core.errors import UserError

PROGRAM_SET = {"config_key": False}  # field metadata: set by the program, never by a config file


def config_keys(cls) -> list[str]:
    """The fields of a config dataclass a config file may set."""
    return [f.name for f in dataclasses.fields(cls) if f.metadata.get("config_key", True)]


def _fields(cls) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls)}


def plain(value):
    """A config dataclass as nested dicts of plain values: its config keys only, dtypes by name."""
    if dataclasses.is_dataclass(value):
        writers = {f.name: f.metadata.get("plain", plain) for f in dataclasses.fields(value)}
        return {key: writers[key](getattr(value, key)) for key in config_keys(type(value))}
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def _coerce(value, annotation, key: str):
    """`value` as the annotated type, or a UserError naming `key` and the expected type."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        options = typing.get_args(annotation)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in (o for o in options if o is not type(None)):
            try:
                return _coerce(value, option, key)
            except UserError as error:
                errors.append(error)
        raise errors[0]
    if dataclasses.is_dataclass(annotation):  # a record inside a list or a union (data.datasets entries)
        return build(annotation, value, key)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key}={value!r} must be a list")
        inner = typing.get_args(annotation)
        many = origin is list or (len(inner) == 2 and inner[1] is Ellipsis)
        indexed = many and dataclasses.is_dataclass(inner[0])  # records of a list are named key[i]
        return origin(_coerce(v, inner[0], f"{key}[{i}]" if indexed else key) for i, v in enumerate(value))
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key}={value!r} must be a mapping")
        _check_finite_inside(value, key)
        return value
    if isinstance(annotation, type) and not dataclasses.is_dataclass(annotation) and annotation not in (int, float, bool, str) \
            and isinstance(value, annotation):  # already the type (a torch.dtype of `dataclasses.asdict`)
        return value
    if annotation is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            float(value)
        except (ValueError, OverflowError):
            pass
        else:  # every float key, present or future, is finite (ranges are each section's own check)
            return validate.finite(value, key)
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return validate.integer(value, key)
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    if annotation is str and isinstance(value, bool):  # YAML 1.1: run.name=off is False, run.name=yes is True
        raise UserError(f"{key}={value!r} must be a str; YAML reads yes/no/on/off/true/false as booleans: quote the "
                        f"value, e.g. '{key}=\"off\"' on the command line")
    raise UserError(f"{key}={value!r} must be a {getattr(annotation, '__name__', annotation)}")


def _check_finite_inside(value, key: str) -> None:
    """No NaN or infinity anywhere inside a free-form mapping or list (e.g. attention_options)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{key}={value!r} must be a finite number")
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for name, inner in items:
        _check_finite_inside(inner, f"{key}.{name}")


def build(cls, data: dict, prefix: str = ""):
    """Instantiate dataclass `cls` from a nested dict, checking every key and value."""
    if not isinstance(data, dict):
        raise UserError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = config_keys(cls)  # fields the program sets (the engine's device, ...) are no config keys
    data = {k: v for k, v in data.items() if not _program_default(cls, k, v)}  # as `dataclasses.asdict` writes them
    for key in data:
        if key not in names:
            where = f" under {prefix}" if prefix else ""
            raise UserError(f"unknown config key {prefix + '.' if prefix else ''}{key}; valid keys{where}: {', '.join(names)}")
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        parse = _fields(cls)[key].metadata.get("parse")
        if parse is not None:  # a section with its own reading (a preset name, or a folder)
            kwargs[key] = parse(value, dotted)
        elif dataclasses.is_dataclass(hints[key]):
            kwargs[key] = build(hints[key], value, dotted)
        else:
            kwargs[key] = _coerce(value, hints[key], dotted)
    try:
        return cls(**kwargs)
    except TypeError as error:  # a required field missing
        raise UserError(f"{prefix or 'config'}: {error}") from None


def _program_default(cls, key: str, value) -> bool:
    """`key` is a field the program sets (not a config key) and `value` its default, as a dict of a
    default config holds it; any other value of such a field is refused as an unknown key."""
    field_ = _fields(cls).get(key)
    if field_ is None or field_.metadata.get("config_key", True):
        return False
    default = field_.default_factory() if field_.default_factory is not dataclasses.MISSING else field_.default
    return value == default or (dataclasses.is_dataclass(default) and value == dataclasses.asdict(default))


def apply_override(data: dict, override: str) -> None:
    """Apply one `dotted.key=value` (value parsed as YAML) to the nested dict `data`."""
    key, sep, raw = override.partition("=")
    key = key.strip()
    if not sep or not key or "" in key.split("."):
        raise UserError(f"override {override!r} must look like section.key=value (e.g. optim.lr=1e-4)")
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key}: {part} is not a section")
    try:
        node[leaf] = yaml.safe_load(raw) if raw else None
    except yaml.YAMLError as error:
        reason = str(error).splitlines()[0]
        raise UserError(f"override {key}={raw!r}: the value is not valid YAML ({reason})") from None


def read_yaml(path: str | Path | None, overrides: list[str] = ()) -> dict:
    """A YAML config file as nested dicts (empty when `path` is None), `overrides` applied."""
    data = {}
    if path is not None:
        path = Path(path)
        if path.is_dir():
            raise UserError(f"config file {path} is a folder; give a YAML file, e.g. configs/tiny.yaml")
        if not path.is_file():
            raise UserError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise UserError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
        except (UnicodeDecodeError, OSError) as error:
            raise UserError(f"config file {path} cannot be read as text: {error}") from None
        if not isinstance(data, dict):
            raise UserError(f"config file {path} must hold a mapping of sections (model:, data:, run:, ...), "
                            f"not a {type(data).__name__}")
    for override in overrides:
        apply_override(data, override)
    return data
