"""Checkpoints: runs/NAME/checkpoint-STEP/ with config.json, model.safetensors, ema.safetensors,
and training state (optimizer, scheduler, RNG) in state.pt.

A checkpoint is written into a hidden temporary folder and renamed into place in one step, so a
crash never leaves a checkpoint that loads half-written; only complete folders carry the name.
"""

import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from slidefusion.errors import UserError

CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
REQUIRED = ("config.json", "model.safetensors")


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
    if (path / "model.safetensors").is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise UserError(f"checkpoint {path} not found: expected a folder with {' and '.join(REQUIRED)} or a run folder with checkpoint-STEP/ inside")
    return latest


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


def save_checkpoint(run_dir: Path, step: int, config: dict, model: dict, ema: dict | None = None,
                    state: dict | None = None, keep_last: int | None = None) -> Path:
    """Write checkpoint-STEP atomically into `run_dir`; prune to the newest `keep_last`."""
    final = Path(run_dir) / f"checkpoint-{step}"
    with atomic_folder(final) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        save_file(contiguous_state(model), tmp / "model.safetensors")
        if ema is not None:
            save_file(contiguous_state(ema), tmp / "ema.safetensors")
        if state is not None:
            torch.save(state, tmp / "state.pt")
    if keep_last is not None:
        for old in list(checkpoint_steps(Path(run_dir)).values())[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    return final


@contextmanager
def atomic_folder(final: Path):
    """Yield a hidden temporary sibling of `final`; on success it replaces `final` in one rename,
    on any error it is deleted, so `final` is never seen half-written."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    try:
        yield tmp
        _fsync_dir(tmp)
        if final.exists():  # replacing: move the old one aside first, since rename is the atomic step
            shutil.rmtree(final.rename(final.with_name(f".old-{final.name}-{os.getpid()}")))
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _fsync_dir(folder: Path) -> None:
    for child in folder.iterdir():
        with open(child, "rb") as handle:
            os.fsync(handle.fileno())


def load_checkpoint(path: str | Path, with_state: bool = False) -> Checkpoint:
    """Read a checkpoint folder (or a run folder's latest); UserError if it is missing or broken."""
    folder = resolve_checkpoint(path)
    try:
        config = json.loads((folder / "config.json").read_text())
        model = load_file(folder / "model.safetensors")
        ema = load_file(folder / "ema.safetensors") if (folder / "ema.safetensors").is_file() else None
        state = None
        if with_state:
            if not (folder / "state.pt").is_file():
                raise UserError(f"checkpoint {folder} has no state.pt, so it cannot be resumed; use --init-from")
            state = torch.load(folder / "state.pt", weights_only=False)
    except (OSError, ValueError, SafetensorError, RuntimeError) as error:
        if isinstance(error, UserError):
            raise
        raise UserError(f"checkpoint {folder} cannot be read: {str(error).splitlines()[0]}") from None
    return Checkpoint(folder, config, model, ema, state)


def load_matching(model: nn.Module, weights: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    """Copy every weight whose name and shape match into `model`.

    Returns (loaded, not_loaded); the second lists model keys left at their initial value with the
    reason, so adapting a dense-attention checkpoint to another attention is explicit.
    """
    own = model.state_dict()
    loaded, skipped = [], []
    for name, target in own.items():
        source = weights.get(name)
        if source is None:
            skipped.append(f"{name} (not in checkpoint)")
        elif source.shape != target.shape:
            skipped.append(f"{name} (shape {tuple(source.shape)} in checkpoint, {tuple(target.shape)} in model)")
        else:
            with torch.no_grad():
                target.copy_(source)
            loaded.append(name)
    skipped += [f"{name} (not in model)" for name in weights if name not in own]
    return loaded, skipped


def export_checkpoint(source: str | Path, destination: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """A sampling-only copy of a checkpoint: config + the EMA (or raw) weights cast to `dtype`.

    This is how the bundled demo model is made: half the bytes, no optimizer state.
    """
    ckpt = load_checkpoint(source)
    destination = Path(destination)
    weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in ckpt.sampling_weights.items()}
    with atomic_folder(destination) as tmp:
        (tmp / "config.json").write_text(json.dumps(ckpt.config, indent=2))
        save_file(contiguous_state(weights), tmp / "model.safetensors", metadata={"source": str(ckpt.path)})
    return destination
