"""What a local diffusers folder holds, checked before anything heavy is loaded.

Two layouts are accepted: a pipeline folder (`model_index.json` naming its components, one
subfolder each: transformer/ vae/ text_encoder/ tokenizer/ scheduler/, and transformer_2/ for
Wan 2.2 A14B) and a bare transformer folder (`config.json` with `_class_name` plus safetensors
weights, sharded or not). Every mistake is a one-line UserError naming what is wrong.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from slidefusion.adapters import DIFFUSERS_CLASSES, ModelAdapter, adapter_for_class
from slidefusion.errors import UserError, check
from slidefusion.pretrained.safetensors_io import TensorEntry, read_header

WEIGHTS = "diffusion_pytorch_model.safetensors"
WEIGHTS_INDEX = WEIGHTS + ".index.json"
_VALID = ("valid: a diffusers pipeline folder (model_index.json + transformer/ vae/ text_encoder/ tokenizer/ "
          "scheduler/) or a transformer folder (config.json + diffusion_pytorch_model*.safetensors)")


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"{what} {path} is unreadable: {type(err).__name__}") from None
    check(isinstance(data, dict), f"{what} {path} is not a JSON object")
    return data


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
    transformer's own (its config.json still defines the model; see `slidefusion.io.single_file`)."""

    root: Path
    index: Mapping | None
    transformer_files: Mapping[str, Path] = field(default_factory=dict)

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
        path = self.transformer_dir(name) / "config.json"
        check(path.is_file(), f"pretrained={self.root}: {path.parent.name or path.parent}/config.json is missing")
        return read_json(path, "transformer config")

    def adapter(self, name: str = "transformer") -> ModelAdapter:
        """The transformer's adapter, with the options the pipeline config sets (expand_timesteps, ...)."""
        adapter = adapter_for_class(str(self.transformer_config(name).get("_class_name")))
        options = {k: self.index[k] for k in adapter.options if self.index is not None and k in self.index}
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

    def scheduler_config(self) -> dict:
        return read_json(self.component_dir("scheduler") / "scheduler_config.json", "scheduler config")

    def weight_entries(self, name: str = "transformer") -> list[TensorEntry]:
        """Every tensor of a transformer's weights, shard by shard, after checking the shard index
        (or those of its single file, under diffusers' names)."""
        file = self.transformer_files.get(name if self.is_pipeline else "")  # a bare folder's one transformer is ""
        if file is not None:
            from slidefusion.io.single_file import single_file_entries

            return single_file_entries(file, self.adapter(name))
        return weight_entries(self.transformer_dir(name))


def open_folder(path: str | Path | PretrainedFolder, transformer: str | Path | None = None,
                expert: str = "transformer", what: str = "model.transformer") -> PretrainedFolder:
    """Check that `path` is a local diffusers folder of a supported model; see the module docstring.
    With `transformer` (a single-file transformer), its weights replace those of `expert` (see
    `PretrainedFolder.transformer_files`), after checking its names and shapes against the folder's
    config (`what` names it in errors). An opened folder is returned as it is."""
    if isinstance(path, PretrainedFolder):
        check(transformer is None, "open_folder: give the single-file transformer when opening the folder")
        return path
    folder = _open(path)
    return folder if transformer is None else with_transformer_file(folder, transformer, expert, what)


def with_transformer_file(folder: PretrainedFolder, path: str | Path, expert: str = "transformer",
                          what: str = "model.transformer") -> PretrainedFolder:
    """`folder` with `expert`'s weights read from the single file `path` (checked against its config)."""
    from slidefusion.io.single_file import check_entries, single_file_entries
    from slidefusion.pretrained.build import build_on_meta

    name = expert if folder.is_pipeline else ""
    check(name in folder.transformer_names, f"{what}: {folder.root} has no {expert}; valid: "
                                            f"{', '.join(folder.transformer_names)}")
    path = Path(path).expanduser()
    entries = single_file_entries(path, folder.adapter(name), what)
    check_entries(entries, build_on_meta(folder, name), path, folder.root, what)
    return PretrainedFolder(folder.root, folder.index, {**folder.transformer_files, name: path})


def _open(path: str | Path) -> PretrainedFolder:
    root = Path(path).expanduser()
    check(root.is_dir(), f"pretrained={path} is not a directory; {_VALID}")
    if (root / "model_index.json").is_file():
        folder = PretrainedFolder(root, read_json(root / "model_index.json", "pipeline index"))
    elif (root / "config.json").is_file():
        config = read_json(root / "config.json", "transformer config")
        check("_class_name" in config, f"pretrained={path}: config.json has no _class_name, so it is not a "
                                       f"diffusers model; {_VALID}")
        folder = PretrainedFolder(root, None)
    else:
        lora = (root / "pytorch_lora_weights.safetensors").is_file()
        check(not lora, f"pretrained={path} holds LoRA weights, not a model: give the base model's folder as "
                        f"pretrained and this one as --lora {path}")
        raise UserError(f"pretrained={path} is not a diffusers model folder (no model_index.json or config.json); {_VALID}")
    for name in folder.transformer_names:
        check_supported(folder.transformer_config(name).get("_class_name"), root)
    return folder


def check_supported(class_name, root: Path) -> None:
    check(class_name in DIFFUSERS_CLASSES, f"pretrained={root}: transformer class {class_name!r} is not supported; "
                                           f"supported: {', '.join(DIFFUSERS_CLASSES)}")


def weight_entries(directory: Path) -> list[TensorEntry]:
    """The tensors of `directory`'s safetensors weights, single file or sharded, after checking that
    every shard the index names exists and holds exactly the tensors the index maps to it."""
    index_path, single = directory / WEIGHTS_INDEX, directory / WEIGHTS
    if index_path.is_file():
        return _sharded_entries(directory, read_json(index_path, "shard index"))
    if single.is_file():
        return read_header(single)
    others = sorted(p.name for p in directory.glob("diffusion_pytorch_model*"))
    hint = f"found {', '.join(others)}; valid: safetensors weights (save_pretrained(safe_serialization=True))" \
        if others else f"expected {WEIGHTS} or {WEIGHTS_INDEX}"
    raise UserError(f"no safetensors weights in {directory}: {hint}")


def _sharded_entries(directory: Path, index: dict) -> list[TensorEntry]:
    weight_map = index.get("weight_map")
    check(isinstance(weight_map, dict) and weight_map, f"shard index {directory / WEIGHTS_INDEX} has no weight_map")
    entries = []
    for shard in dict.fromkeys(weight_map.values()):  # file order of first mention
        path = directory / str(shard)
        check(path.is_file(), f"missing weights shard {shard} in {directory} (listed in {WEIGHTS_INDEX})")
        held = read_header(path)
        for entry in held:
            check(weight_map.get(entry.name) == shard,
                  f"shard index mismatch in {directory}: {shard} holds {entry.name}, which {WEIGHTS_INDEX} "
                  f"maps to {weight_map.get(entry.name)}")
        names = {e.name for e in held}
        absent = [n for n, s in weight_map.items() if s == shard and n not in names]
        if absent:
            raise UserError(f"shard index mismatch in {directory}: {WEIGHTS_INDEX} maps {absent[0]} to {shard}, "
                            f"which does not hold it ({len(absent)} such)")
        entries.extend(held)
    return entries
