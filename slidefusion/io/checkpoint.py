"""Our checkpoint layout, written and read here only: a folder with config.json (the run's config
as plain data), model.safetensors, ema.safetensors (when the run keeps an EMA) and state.pt (what
resuming needs: optimizer, step, RNG). A run folder holds checkpoint-STEP/ folders; an export or a
`VideoPipeline.save_pretrained` is the same layout without EMA and state.

A checkpoint is written into a hidden temporary folder and renamed into place in one step
(`io.files.atomic_folder`), so a crash never leaves a checkpoint that loads half-written; only
complete folders carry the name.
"""

import json
import re
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from slidefusion.core.errors import UserError
from slidefusion.io.files import atomic_folder

CONFIG, MODEL, EMA, STATE = "config.json", "model.safetensors", "ema.safetensors", "state.pt"
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
REQUIRED = (CONFIG, MODEL)
# The hidden names `atomic_folder` gives a checkpoint while it is written (mkdtemp's 8 random
# characters) and while an old one is moved aside; only these are ever cleaned up as stale.
TEMPORARY = re.compile(r"^\.(old-)?checkpoint-\d+-[a-z0-9_]+$")


def checkpoint_steps(run_dir: Path) -> dict[int, Path]:
    """The complete checkpoints in `run_dir` by step."""
    if not run_dir.is_dir():
        return {}
    found = {}
    for child in run_dir.iterdir():
        match = CHECKPOINT.match(child.name)
        if match and child.is_dir():
            found[int(match.group(1))] = child
    return dict(sorted(found.items()))


def latest_checkpoint(run_dir: Path) -> Path | None:
    steps = checkpoint_steps(run_dir)
    return steps[max(steps)] if steps else None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a folder path or a run folder (then its latest checkpoint)."""
    path = Path(path)
    if (path / MODEL).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise UserError(f"checkpoint {path} not found: expected a folder with {' and '.join(REQUIRED)} or a run folder with checkpoint-STEP/ inside")
    return latest


_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)  # an fp8 base's frozen codes: quantised from finite weights, never written


def first_nonfinite(weights: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding NaN or infinity, or None."""
    return next((k for k, v in weights.items()
                 if v.is_floating_point() and v.dtype not in _FP8 and not torch.isfinite(v).all()), None)


def contiguous_state(module_or_state: nn.Module | dict) -> dict[str, torch.Tensor]:
    """A state dict safetensors can write: detached, contiguous, no shared storage."""
    state = module_or_state.state_dict() if isinstance(module_or_state, nn.Module) else module_or_state
    return {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}


@dataclass
class Checkpoint:
    path: Path
    config: dict
    model: dict[str, torch.Tensor]
    ema: dict[str, torch.Tensor] | None
    state: dict | None  # optimizer, scheduler, RNG, step: only what resuming needs

    @property
    def sampling_weights(self) -> dict[str, torch.Tensor]:
        """EMA weights when the run kept them (they sample better), else the raw weights."""
        return self.ema if self.ema is not None else self.model


def write_checkpoint(folder: Path, config: dict, model: dict | nn.Module, ema: dict | None = None,
                     state: dict | None = None, metadata: dict[str, str] | None = None) -> Path:
    """The one writer of the layout, atomically: config.json, model.safetensors (with `metadata`),
    ema.safetensors and state.pt when given. An existing `folder` is replaced as a whole."""
    with atomic_folder(Path(folder)) as tmp:
        (tmp / CONFIG).write_text(json.dumps(config, indent=2))
        save_file(contiguous_state(model), tmp / MODEL, metadata=metadata)
        if ema is not None:
            save_file(contiguous_state(ema), tmp / EMA)
        if state is not None:
            torch.save(state, tmp / STATE)
    return Path(folder)


def save_checkpoint(run_dir: Path, step: int, config: dict, model: dict, ema: dict | None = None,
                    state: dict | None = None, keep_last: int | None = None) -> Path:
    """Write checkpoint-STEP atomically into `run_dir`; prune to the newest `keep_last`."""
    final = write_checkpoint(Path(run_dir) / f"checkpoint-{step}", config, model, ema, state)
    if keep_last is not None:
        for old in list(checkpoint_steps(Path(run_dir)).values())[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | Path, with_state: bool = False) -> Checkpoint:
    """Read a checkpoint folder (or a run folder's latest); UserError if it is missing or broken."""
    folder = resolve_checkpoint(path)
    config = _read(folder, CONFIG, lambda f: json.loads(f.read_text()))
    if not isinstance(config, dict):
        raise UserError(f"checkpoint {folder}: config.json must hold a mapping, not a {type(config).__name__}")
    model = _read(folder, MODEL, load_file)
    ema = _read(folder, EMA, load_file) if (folder / EMA).is_file() else None
    state = None
    if with_state:
        if not (folder / STATE).is_file():
            raise UserError(f"checkpoint {folder} has no state.pt, so it cannot be resumed; use --init-from")
        # weights_only: a state.pt is tensors, numbers and dicts; loading it never runs pickled code
        state = _read(folder, STATE, lambda f: torch.load(f, weights_only=True),
                      reason="not a training state slidefusion wrote (damaged, or another program's file)")
        if not isinstance(state, dict):
            raise UserError(f"checkpoint {folder}: state.pt holds a {type(state).__name__}, not a training state")
    return Checkpoint(folder, config, model, ema, state)


def _read(folder: Path, name: str, reader, reason: str | None = None):
    """`reader(folder / name)`, with any failure to parse the file as one UserError line (`reason`,
    or the parser's own first line): a damaged file can make a parser raise nearly anything
    (torch's unpickler: IndexError, KeyError, ...)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # parsers' notes about odd input would precede our one line
            return reader(folder / name)
    except Exception as error:  # noqa: BLE001 - see the docstring
        reason = reason or (str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__)
        raise UserError(f"checkpoint {folder} cannot be read: {name}: {reason}") from None


def base_folder(checkpoint: Path) -> Path | None:
    """The diffusers folder a fine-tune's checkpoint was trained from (its config's model.pretrained),
    or None: read from config.json alone, before anything heavy is loaded."""
    try:
        model = json.loads((Path(checkpoint) / CONFIG).read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        return None  # load_checkpoint says what is wrong with it
    pretrained = model.get("pretrained") if isinstance(model, dict) else None
    return Path(pretrained).expanduser() if isinstance(pretrained, str) and pretrained.strip() else None


def check_export_destination(source: Path, destination: str | Path, force: bool = False) -> Path:
    """Where an export may write, or a UserError: never an existing entry unless `force` (and then
    only a folder), never the checkpoint or its run folder, inside them, or a folder holding them
    or the current folder; never the base folder of a fine-tune (model.pretrained), inside it or
    around it, with or without `force`: sampling the run reads it. Every export format calls this
    before it writes anything."""
    destination = Path(destination)
    target = destination.resolve()
    protected = [Path(source).resolve()]
    if CHECKPOINT.match(protected[0].name):
        protected.append(protected[0].parent)  # the run folder
    for folder in protected:
        if target == folder or folder in target.parents:
            raise UserError(f"--out {destination} is inside the checkpoint or run folder {folder}; "
                            "export somewhere else (it must never touch its source)")
    if target in protected[0].parents:
        raise UserError(f"--out {destination} holds the checkpoint {source}; replacing it would delete the source")
    base = base_folder(source)
    if base is not None:
        base = base.resolve()
        if target == base or base in target.parents or target in base.parents:
            where = "is" if target == base else "is inside" if base in target.parents else "holds"
            raise UserError(f"--out {destination} {where} the base folder {base} this fine-tune was trained from "
                            "(model.pretrained); export somewhere else: sampling the run reads that folder")
    if destination.exists() or destination.is_symlink():
        if not destination.is_dir() or destination.is_symlink():
            raise UserError(f"--out {destination} is an existing file or link; export writes a folder, give a new path")
        if not force:
            raise UserError(f"--out {destination} already exists; add --force to replace it, or give a new path")
        if target == Path.cwd().resolve() or target in Path.cwd().resolve().parents:
            raise UserError(f"--out {destination} holds the current folder; give a new path")
    return destination


def export_checkpoint(source: str | Path, destination: str | Path, dtype: torch.dtype = torch.float16,
                      force: bool = False) -> Path:
    """A sampling-only copy of a checkpoint: config + the EMA (or raw) weights cast to `dtype`.

    This is how the bundled demo model is made: half the bytes, no optimizer state. An existing
    `destination` is replaced only with `force` (see `check_export_destination`).
    """
    destination = check_export_destination(resolve_checkpoint(source), destination, force)
    ckpt = load_checkpoint(source)
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ckpt.sampling_weights.items()}
    bad = first_nonfinite(weights)
    if bad is not None:
        finite_before = torch.isfinite(ckpt.sampling_weights[bad]).all()
        why = (f"does not fit in {dtype} (its range is too small); use --dtype bfloat16 or float32" if finite_before
               else "holds NaN or infinity; export an earlier checkpoint")
        raise UserError(f"weight {bad} of {ckpt.path} {why}")
    from slidefusion.io.diskfull import tensor_bytes, writing

    with writing(f"the export {destination.name}", destination.absolute().parent, tensor_bytes(weights),
                 "the checkpoint and any earlier --out are untouched"):
        return write_checkpoint(destination, ckpt.config, weights, metadata={"source": str(ckpt.path)})
