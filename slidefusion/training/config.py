"""Training configuration: typed dataclasses, filled from YAML and `section.key=value` overrides.

Every key is checked: an unknown one, or a value of the wrong type, is a `UserError` that names
the dotted key and what would be valid.
"""

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from slidefusion import validate
from slidefusion.data.shapes import START_MODES
from slidefusion.diffusion.flow import FlowConfig
from slidefusion.errors import UserError, check
from slidefusion.models.config import ModelConfig, preset
from slidefusion.offload.config import OffloadConfig
from slidefusion.optim import OptimConfig  # noqa: F401  (re-exported: a config section)
from slidefusion.training.finetune.config import LoraConfig, PretrainedModelConfig
from slidefusion.training.parallel_config import ParallelTrainConfig, merge_train_alias


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
    start: str = "uniform"  # shapes: "uniform" (may bounce), "clear" (room ahead), "behind" (clear, near the back wall)
    root: str | None = None  # the video folder, for kind="folder"
    stride: int = 1  # frame stride when reading real videos
    fps: int = 8  # playback rate of exported videos
    cache_dir: str | None = None  # latent and text caches of a diffusers fine-tune (null: RUN/cache)

    def __post_init__(self):
        for name in ("frames", "height", "width", "num_samples", "max_objects", "stride", "fps"):
            value = getattr(self, name)
            check(value >= 1, f"data.{name}={value} must be >= 1")
        check(self.fps <= 1000, f"data.fps={self.fps} must be <= 1000 (the playback rate of exported videos)")
        check(self.kind in ("shapes", "folder"), f"data.kind={self.kind!r} is unknown; valid: shapes, folder")
        check(self.start in START_MODES, f"data.start={self.start!r} is unknown; valid: {', '.join(START_MODES)}")
        check(self.kind != "folder" or self.root, "data.root must name the video folder when data.kind=folder")


RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a plain folder name: no path, not . or ..
RUN_SEED_MAX = 2**32 - 1  # step seeds are seed * 1_000_003 + step, which must stay below 2**64


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
        check(isinstance(self.name, str) and RUN_NAME.match(self.name) is not None and len(self.name) <= 200,
              f"run.name={self.name!r} must be a plain folder name: letters, digits, '.', '_' or '-', "
              "starting with a letter or digit")
        check(bool(str(self.output_dir).strip()), f"run.output_dir={self.output_dir!r} must name a folder")
        check(bool(str(self.device).strip()), f"run.device={self.device!r} must name a device, e.g. cpu or cuda")
        validate.integer(self.seed, "run.seed", 0, RUN_SEED_MAX)
        check(self.steps <= 2**62, f"run.steps={self.steps} must be <= 2**62")


@dataclass
class TrainConfig:
    """A training run. `model` is one of our presets (ModelConfig) or, with `model.pretrained=DIR`, the
    transformer of a diffusers pipeline folder, whose text encoders and VAE then come from the folder
    (`text_encoder`, `text_max_length` and `autoencoder` apply to our own models only)."""

    model: ModelConfig | PretrainedModelConfig = field(default_factory=lambda: preset("dit3d-tiny"))
    data: DataConfig = field(default_factory=DataConfig)
    diffusion: FlowConfig = field(default_factory=FlowConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    parallel: ParallelTrainConfig = field(default_factory=ParallelTrainConfig)  # under torchrun: dp x sp ranks
    text_encoder: str = "minilm"
    text_max_length: int = 32
    autoencoder: str = "identity"

    def __post_init__(self):
        check(self.pretrained or not self.lora.enabled,
              f"lora.rank={self.lora.rank} applies to diffusers folders only; add model.pretrained=DIR, "
              "or set lora.rank=null")
        check(self.parallel.sp == 1 or self.offload.tile in ("off", "auto"),
              f"parallel.sp={self.parallel.sp} with offload.tile={self.offload.tile}: tiles inside a sequence-parallel "
              "block are not supported; use offload.tile=off (each rank already holds 1/sp of the tokens)")
        check(not self.parallel.cpu_offload or str(self.run.device).startswith("cuda"),
              f"parallel.cpu_offload=true keeps FSDP2's parameters on the host for a GPU to compute with; "
              f"run.device={self.run.device} has none (use run.device=cuda, or parallel.cpu_offload=false)")
        check(not (self.parallel.fsdp and self.offload.enabled),
              "parallel.fsdp=true shards resident training; --offload (offload.enabled) shards the offload engine's "
              "host state instead: choose one")

    @property
    def pretrained(self) -> bool:
        """A fine-tune of a diffusers folder (`model.pretrained=DIR`)."""
        return isinstance(self.model, PretrainedModelConfig)

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
        _check_finite_inside(value, key)
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


def _model_from_dict(data: dict, key: str) -> ModelConfig | PretrainedModelConfig:
    """A `model:` section: an optional `preset` name, then any ModelConfig fields on top; or
    `pretrained: DIR` (a diffusers folder, whose config.json defines the model)."""
    if not isinstance(data, dict):
        raise UserError(f"{key}={data!r} must be a section (a mapping), e.g. {key}.preset=dit3d-tiny")
    if "pretrained" in data:
        valid = [f.name for f in dataclasses.fields(PretrainedModelConfig)]
        other = [k for k in data if k not in valid]
        if other:
            raise UserError(f"{key}.{other[0]} cannot be combined with {key}.pretrained (the folder's config.json "
                            f"defines the model); valid keys with {key}.pretrained: {', '.join(valid)}")
        return build(PretrainedModelConfig, data, key)
    data = dict(data)
    name = data.pop("preset", None)
    if name is not None and not isinstance(name, str):
        raise UserError(f"{key}.preset={name!r} must be a preset name, e.g. dit3d-tiny")
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
        if cls is TrainConfig and key == "model":
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


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config (or the defaults when `path` is None), apply overrides, validate."""
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
    merge_train_alias(data)
    return build(TrainConfig, data)
