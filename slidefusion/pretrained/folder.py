"""What a local diffusers folder holds, checked before anything heavy is loaded.

Two layouts are accepted (`slidefusion.io.diffusers` tells them apart): a pipeline folder
(`model_index.json` naming its components, one subfolder each: transformer/ vae/ text_encoder/
tokenizer/ scheduler/, and transformer_2/ for Wan 2.2 A14B) and a bare transformer folder
(`config.json` with `_class_name` plus safetensors weights, sharded or not). Every mistake is a
one-line UserError naming what is wrong.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slidefusion.core.errors import UserError, check
from slidefusion.families import DIFFUSERS_CLASSES, ModelAdapter, adapter_for_class, original_layout
from slidefusion.io.diffusers import (  # noqa: F401  (WEIGHTS, WEIGHTS_INDEX, read_json: re-exported)
    CONFIG,
    LORA,
    MODEL,
    MODEL_INDEX,
    PIPELINE,
    WEIGHTS,
    WEIGHTS_INDEX,
    folder_kind,
    read_json,
    weight_entries,
)
from slidefusion.io.safetensors_stream import TensorEntry
from slidefusion.io.single_file import single_file_entries
from slidefusion.pretrained.index_check import check_index, check_option, check_scheduler

_VALID = ("valid: a diffusers pipeline folder (model_index.json + transformer/ vae/ text_encoder/ tokenizer/ "
          "scheduler/) or a transformer folder (config.json + diffusion_pytorch_model*.safetensors)")


@dataclass(frozen=True)
class Expert:
    """One transformer of a multi-expert pipeline and the timesteps it denoises: low <= t < high."""

    name: str
    low: float
    high: float


@dataclass(frozen=True)
class PretrainedFolder:
    """A checked local diffusers folder; `index` is model_index.json (None for a bare transformer).
    `transformer_files`: transformer name -> a single-file transformer whose weights replace that
    transformer's own (its config.json still defines the model; see `slidefusion.io.single_file`,
    set by `slidefusion.pretrained.source.open_folder_with`)."""

    root: Path
    index: Mapping | None
    transformer_files: Mapping[str, Path] = field(default_factory=dict)
    configs: dict = field(default_factory=dict, compare=False, repr=False)  # transformer config.json by name, read once

    @property
    def is_pipeline(self) -> bool:
        return self.index is not None

    @property
    def pipeline_class(self) -> str | None:
        return None if self.index is None else self.index.get("_class_name")

    def components(self) -> list[str]:
        """The components model_index.json lists with a class (not the [null, null] placeholders)."""
        if self.index is None:
            return []
        return [k for k, v in self.index.items() if not k.startswith("_") and isinstance(v, list) and v[0] is not None
                and v[1] is not None]

    def component_class(self, name: str) -> tuple[str, str]:
        """(library, class name) of a component, e.g. ("transformers", "UMT5EncoderModel")."""
        self.component_dir(name)
        library, class_name = self.index[name]
        return library, class_name

    def component_dir(self, name: str) -> Path:
        """The subfolder of component `name`; UserError naming it if the folder lacks it."""
        check(self.index is not None, f"pretrained={self.root} is a bare transformer folder: it has no {name}/; "
                                      "valid: a pipeline folder with model_index.json")
        check(name in self.components(), f"pretrained={self.root} has no {name} component; "
                                         f"model_index.json lists: {', '.join(self.components()) or 'none'}")
        path = self.root / name
        check(path.is_dir(), f"pretrained={self.root}: component {name}/ is listed in model_index.json "
                             "but missing on disk")
        return path

    # ---------------------------------------------------------------- transformers
    @property
    def transformer_names(self) -> tuple[str, ...]:
        """"transformer" (and "transformer_2" for Wan 2.2 A14B); ("",) for a bare folder."""
        if self.index is None:
            return ("",)
        names = tuple(n for n in ("transformer", "transformer_2") if n in self.components())
        check(bool(names), f"pretrained={self.root} has no transformer component; "
                           f"model_index.json lists: {', '.join(self.components()) or 'none'}")
        return names

    def transformer_dir(self, name: str = "transformer") -> Path:
        return self.root if self.index is None else self.component_dir(name)

    def transformer_config(self, name: str = "transformer") -> dict:
        """A transformer's config.json (read once; a copy, so callers may change it)."""
        if name not in self.configs:
            path = self.transformer_dir(name) / "config.json"
            check(path.is_file(), f"pretrained={self.root}: {path.parent.name or path.parent}/config.json is missing")
            self.configs[name] = read_json(path, "transformer config")
        return dict(self.configs[name])

    def adapter(self, name: str = "transformer") -> ModelAdapter:
        """The transformer's adapter, with the options the pipeline config sets (expand_timesteps, ...)."""
        adapter = adapter_for_class(str(self.transformer_config(name).get("_class_name")))
        options = {k: self.index[k] for k in adapter.options if self.index is not None and k in self.index
                   and self.index[k] is not None}
        for key in options:
            check_option(self.index, key, adapter.options[key], self.root)
        return adapter.with_options(**options) if options else adapter

    def experts(self) -> list[Expert]:
        """Which transformer denoises which timesteps (Wan 2.2 A14B: `transformer` at high noise,
        t >= boundary_ratio * num_train_timesteps, `transformer_2` below)."""
        names = self.transformer_names
        boundary = None if self.index is None else self.index.get("boundary_ratio")
        if len(names) == 1 or boundary is None:
            return [Expert(names[0], float("-inf"), float("inf"))]
        train = float(self.scheduler_config().get("num_train_timesteps", 1000))
        return [Expert(names[0], boundary * train, float("inf")), Expert(names[1], float("-inf"), boundary * train)]

    def component_config(self, name: str) -> dict:
        """A model component's config.json (the VAE's: its compression and latent normalisation)."""
        return read_json(self.component_dir(name) / CONFIG, f"{name} config")

    def scheduler_config(self) -> dict:
        path = self.component_dir("scheduler") / "scheduler_config.json"
        config = read_json(path, "scheduler config")
        check_scheduler(config, path)
        return config

    def weight_entries(self, name: str = "transformer") -> list[TensorEntry]:
        """Every tensor of a transformer's weights, shard by shard, after checking the shard index
        (or those of its single file, under diffusers' names)."""
        file = self.transformer_files.get(name if self.is_pipeline else "")  # a bare folder's one transformer is ""
        if file is None:
            return weight_entries(self.transformer_dir(name))
        adapter = self.adapter(name)
        layout = original_layout(adapter, "model.transformer: a single-file transformer")
        return single_file_entries(file, layout, adapter.class_name)


def open_folder(path: str | Path | PretrainedFolder) -> PretrainedFolder:
    """Check that `path` is a local diffusers folder of a supported model; see the module docstring.
    An opened folder is returned as it is (with any single-file transformer it was given:
    `slidefusion.pretrained.source.open_folder_with`)."""
    return path if isinstance(path, PretrainedFolder) else _open(path)


def _open(path: str | Path) -> PretrainedFolder:
    root = Path(path).expanduser()
    check(root.is_dir(), f"pretrained={path} is not a directory; {_VALID}")
    kind = folder_kind(root)
    if kind == PIPELINE:
        folder = PretrainedFolder(root, read_json(root / MODEL_INDEX, "pipeline index"))
        check_index(folder.index, root)
    elif kind == MODEL:
        config = read_json(root / CONFIG, "transformer config")
        check("_class_name" in config, f"pretrained={path}: config.json has no _class_name, so it is not a "
                                       f"diffusers model; {_VALID}")
        folder = PretrainedFolder(root, None)
    elif kind == LORA:
        raise UserError(f"pretrained={path} holds LoRA weights, not a model: give the base model's folder as "
                        f"pretrained and this one as --lora {path}")
    else:
        raise UserError(f"pretrained={path} is not a diffusers model folder (no model_index.json or config.json); {_VALID}")
    for name in folder.transformer_names:
        check_supported(folder.transformer_config(name).get("_class_name"), root)
    return folder


def check_supported(class_name, root: Path) -> None:
    check(class_name in DIFFUSERS_CLASSES, f"pretrained={root}: transformer class {class_name!r} is not supported; "
                                           f"supported: {', '.join(DIFFUSERS_CLASSES)}")
