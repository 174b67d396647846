"""Training configuration: typed dataclasses, filled from YAML and `section.key=value` overrides.

Every key is checked: an unknown one, or a value of the wrong type, is a `UserError` that names
the dotted key and what would be valid.
"""

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from slidefusion.data.shapes import START_MODES
from slidefusion.diffusion.flow import FlowConfig
from slidefusion.errors import UserError, check
from slidefusion.models.config import ModelConfig, preset
from slidefusion.offload.config import OffloadConfig
from slidefusion.optim import OptimConfig  # noqa: F401  (re-exported: a config section)


@dataclass
class DataConfig:
    """Where clips come from and their size in pixels (before the autoencoder)."""

    kind: str = "shapes"  # "shapes" (procedural, captioned) or "folder" (videos + captions file)
    frames: int = 8
    height: int = 32
    width: int = 32
    num_samples: int = 100_000  # distinct procedural clips; the folder's own size for "folder"
    seed: int = 0
    max_objects: int = 1
    start: str = "uniform"  # shapes: "uniform" (objects may bounce within a clip) or "clear" (room ahead)
    root: str | None = None  # the video folder, for kind="folder"
    stride: int = 1  # frame stride when reading real videos
    fps: int = 8  # playback rate of exported videos

    def __post_init__(self):
        for name in ("frames", "height", "width", "num_samples", "max_objects", "stride", "fps"):
            value = getattr(self, name)
            check(value >= 1, f"data.{name}={value} must be >= 1")
        check(self.kind in ("shapes", "folder"), f"data.kind={self.kind!r} is unknown; valid: shapes, folder")
        check(self.start in START_MODES, f"data.start={self.start!r} is unknown; valid: {', '.join(START_MODES)}")
        check(self.kind != "folder" or self.root, "data.root must name the video folder when data.kind=folder")


@dataclass
class RunConfig:
    """Length of the run, batch, logging and checkpoints (runs/NAME/checkpoint-STEP/)."""

    name: str = "run"
    output_dir: str = "runs"
    steps: int = 1000
    batch_size: int = 8
    seed: int = 0
    log_every: int = 10
    save_every: int = 500
    keep_last: int | None = 3  # older checkpoints are deleted; null keeps all
    device: str = "cpu"
    tensorboard: bool = False

    def __post_init__(self):
        for name in ("steps", "batch_size", "log_every", "save_every"):
            value = getattr(self, name)
            check(value >= 1, f"run.{name}={value} must be >= 1")
        check(self.keep_last is None or self.keep_last >= 1, f"run.keep_last={self.keep_last} must be >= 1 or null")
        check(self.name and "/" not in self.name, f"run.name={self.name!r} must be a non-empty name without '/'")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=lambda: preset("dit3d-tiny"))
    data: DataConfig = field(default_factory=DataConfig)
    diffusion: FlowConfig = field(default_factory=FlowConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    text_encoder: str = "minilm"
    text_max_length: int = 32
    autoencoder: str = "identity"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


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
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key}={value!r} must be a list")
        inner = typing.get_args(annotation)
        return origin(_coerce(v, inner[0], key) for v in value)
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key}={value!r} must be a mapping")
        return value
    if annotation is float and isinstance(value, (int, float, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is bool and isinstance(value, bool):
        return value
    if annotation is str and isinstance(value, (str, int, float)) and not isinstance(value, bool):
        return str(value)
    raise UserError(f"{key}={value!r} must be a {getattr(annotation, '__name__', annotation)}")


def _model_from_dict(data: dict, key: str) -> ModelConfig:
    """A `model:` section: an optional `preset` name, then any ModelConfig fields on top."""
    data = dict(data)
    name = data.pop("preset", None)
    base = dataclasses.asdict(preset(name)) if name is not None else {}
    return build(ModelConfig, {**base, **data}, key)


def build(cls, data: dict, prefix: str = ""):
    """Instantiate dataclass `cls` from a nested dict, checking every key and value."""
    if not isinstance(data, dict):
        raise UserError(f"{prefix or 'config'} must be a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            where = f" under {prefix}" if prefix else ""
            raise UserError(f"unknown config key {prefix + '.' if prefix else ''}{key}; valid keys{where}: {', '.join(names)}")
    kwargs = {}
    for key, value in data.items():
        dotted = f"{prefix}.{key}" if prefix else key
        if hints[key] is ModelConfig:
            kwargs[key] = _model_from_dict(value, dotted)
        elif dataclasses.is_dataclass(hints[key]):
            kwargs[key] = build(hints[key], value, dotted)
        else:
            kwargs[key] = _coerce(value, hints[key], dotted)
    try:
        return cls(**kwargs)
    except TypeError as error:  # a required field missing
        raise UserError(f"{prefix or 'config'}: {error}") from None


def apply_override(data: dict, override: str) -> None:
    """Apply one `dotted.key=value` (value parsed as YAML) to the nested dict `data`."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise UserError(f"override {override!r} must look like section.key=value (e.g. optim.lr=1e-4)")
    *parents, leaf = key.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"override {key}: {part} is not a section")
    node[leaf] = yaml.safe_load(raw) if raw else None


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config (or the defaults when `path` is None), apply overrides, validate."""
    data = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise UserError(f"config file {path} does not exist")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as error:
            raise UserError(f"config file {path} is not valid YAML: {str(error).splitlines()[0]}") from None
    for override in overrides:
        apply_override(data, override)
    return build(TrainConfig, data)
