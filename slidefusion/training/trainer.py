"""The training loop: a task's loss (data, text, latents, model) -> optimizer -> checkpoints.

The task (`training.task`) is one of our presets or a diffusers folder's transformer; the loop,
checkpoints, resume, EMA, NaN stops and the run folder's lock are the same for both.

Every step's randomness (which clips, which captions are dropped, noise, timesteps) comes from a
generator seeded by (run seed, step), so a run resumed from a checkpoint repeats exactly the loss
sequence of an uninterrupted one. The optimizer sits behind a small `train_step(loss_fn)` seam, so
an offload engine with the same methods can replace `ResidentOptimizer` without touching the loop.
"""

import dataclasses
import json
import math
import shutil
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from slidefusion.core import validate
from slidefusion.core.errors import DiskFullError, NonFiniteError, UserError
from slidefusion.io import diskfull
from slidefusion.io.checkpoint import (
    CHECKPOINT,
    checkpoint_steps,
    first_nonfinite,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from slidefusion.io.files import write_text
from slidefusion.training import optimizer_state
from slidefusion.training.config import OptimConfig, TrainConfig, build
from slidefusion.training.run_folder import LOCK_NAME, RunLock, remove_stale_temporaries, truncate_metrics
from slidefusion.training.weights import load_matching
from slidefusion.training.task import OwnModelTask, ResidentOptimizer  # noqa: F401  (ResidentOptimizer: re-exported)


class EMA:
    """An fp32 exponential moving average of the weights, with DiT-style warm-up of the decay."""

    def __init__(self, weights: dict[str, torch.Tensor], decay: float):
        self.decay = decay
        self.shadow = {k: v.detach().float().clone() for k, v in weights.items()}

    @torch.no_grad()
    def update(self, weights: dict[str, torch.Tensor], step: int) -> None:
        decay = min(self.decay, (1 + step) / (10 + step))
        for name, value in weights.items():
            self.shadow[name].lerp_(value.float(), 1 - decay)


def warmup_lr(optim: OptimConfig, step: int) -> float:
    """Linear warm-up over `warmup_steps`, then constant."""
    return optim.lr * min(1.0, (step + 1) / max(1, optim.warmup_steps))


def step_generator(seed: int, step: int) -> torch.Generator:
    """The step's own random stream: a function of (seed, step) only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)  # one per step run in this call
    last_checkpoint: Path | None = None
    seconds: float = 0.0


class Trainer:
    """Owns the pieces of one run and its loop; build it from a `TrainConfig`."""

    def __init__(self, config: TrainConfig, quiet: bool = False):
        self.config = config
        self.quiet = quiet
        validate.output_path(config.run.output_dir, "run.output_dir", folder=True, inside=True)  # before any work
        self.run_dir = Path(config.run.output_dir) / config.run.name
        self.device = validate.device(config.run.device, "run.device")
        self.task = build_task(config, self.device, self.run_dir, quiet)
        self.model = self.optimizer = self.ema = None
        if not getattr(self.task, "lazy", False):
            self.prepare()
        self.step = 0
        self._lock: RunLock | None = None
        self._continues = False  # True once this trainer resumed the run, or wrote into its folder

    def prepare(self) -> None:
        """Build what the task defers until the run is known to go ahead (a diffusers folder's caches
        and weights: after `resume` checked its checkpoint, or when training starts), once."""
        if self.model is not None:
            return
        self.task.prepare()
        self.model, self.optimizer = self.task.model, self.task.optimizer
        decay = self.config.optim.ema_decay
        self.ema = EMA(self._weights(), decay) if decay else None

    # -- the run folder ---------------------------------------------------------------------------

    @contextmanager
    def lock(self):
        """Hold the run folder's lock (re-entrant); a second run on the same folder gets a UserError.
        At first hold, remove the temporaries an interrupted save left behind."""
        if self._lock is not None:
            yield
            return
        lock = RunLock(self.run_dir)
        lock.acquire()
        self._lock = lock
        try:
            removed = remove_stale_temporaries(self.run_dir)
            if removed:
                warnings.warn(f"removed what an interrupted save left in {self.run_dir}: {', '.join(removed)}")
            yield
        finally:
            self._lock = None
            lock.release()

    @contextmanager
    def _nothing_left_on_error(self):
        """A new run that stops on a user mistake before its first checkpoint (a video that does not
        decode, weights that do not fit, a component that does not load) takes back what it wrote:
        the entries it added to the run folder and the cache files it computed. Exit 2 means nothing
        was written; a run that goes on from a checkpoint keeps everything."""
        if self._continues:
            yield
            return
        before = {p.name for p in self.run_dir.iterdir()} if self.run_dir.is_dir() else set()
        try:
            yield
        except UserError as error:
            undo = getattr(error, "exit_code", 2) == 2 or isinstance(error, DiskFullError)
            if undo and not checkpoint_steps(self.run_dir):
                for entry in sorted(self.run_dir.iterdir()):
                    if entry.name not in before and entry.name != LOCK_NAME and not entry.is_symlink():
                        shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                discard = getattr(self.task, "discard_written", None)
                if discard is not None:
                    discard()
                self._continues = False
            raise

    def _claim_folder(self) -> None:
        """Refuse to start a new run over an earlier one's checkpoints; keep one metrics record per step."""
        if not self._continues:
            earlier = checkpoint_steps(self.run_dir)
            if earlier:
                raise UserError(f"run folder {self.run_dir} already holds checkpoint-{max(earlier)} of an earlier run; "
                                "continue it with --resume latest, or choose another run.name (nothing was changed)")
            self._continues = True
        truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        write_text(self.run_dir / "config.json", json.dumps(self.config.to_dict(), indent=2))

    # -- starting points ------------------------------------------------------------------------

    def resume(self, checkpoint: str | Path) -> Path:
        """Continue a run exactly where `checkpoint` left it ('latest' = this run's newest)."""
        path = self.run_dir if checkpoint == "latest" else Path(checkpoint)
        try:
            ckpt = load_checkpoint(path, with_state=True)
        except UserError as error:
            raise UserError(f"{error}{_earlier_hint(path)}") from None
        missing = sorted({"optimizer", "step", "torch_rng"} - set(ckpt.state))
        if missing:
            raise UserError(f"--resume {ckpt.path}: its state.pt lacks {', '.join(missing)}")
        newer = [step for step in checkpoint_steps(self.run_dir) if step > int(ckpt.state["step"])]
        if newer:  # going on from here would write over them, and `latest` would mix two histories
            raise UserError(f"--resume {ckpt.path}: {self.run_dir} holds newer checkpoints (checkpoint-{max(newer)}) "
                            "that the run would write over; resume latest, or move them away first")
        try:
            saved = build(TrainConfig, ckpt.config)
        except UserError as error:
            raise UserError(f"--resume {ckpt.path}: its config.json is invalid: {error}") from None
        if saved.model != self.config.model or saved.lora != self.config.lora:
            raise UserError(f"--resume {ckpt.path}: its model config differs from this run's ({_first_difference(saved, self.config)}); "
                            "use --init-from to adapt weights")
        bad = first_nonfinite(ckpt.model)
        if bad is not None:
            raise UserError(f"--resume {ckpt.path}: weight {bad} holds NaN or infinity; resume from an earlier checkpoint")
        self._warn_changed(saved, ckpt.path)
        self.prepare()
        self.task.load_weights(ckpt.model, ckpt.path)
        try:
            self.optimizer.load_state_dict(self._optimizer_state(ckpt))
        except (KeyError, ValueError, RuntimeError) as error:
            if isinstance(error, UserError):
                raise
            raise UserError(f"--resume {ckpt.path}: its optimizer state does not fit this run: {error}") from None
        if self.ema is not None and ckpt.ema is not None:
            self.ema.shadow = {k: v.float() for k, v in ckpt.ema.items()}
        self.step = int(ckpt.state["step"])
        torch.set_rng_state(ckpt.state["torch_rng"])
        self._continues = True
        return ckpt.path

    def _optimizer_state(self, ckpt) -> dict:
        """The checkpoint's optimizer state in this run's optimizer's format (converted if the run
        switched --offload on or off since)."""
        state = ckpt.state["optimizer"]
        kind = optimizer_state.state_kind(state)
        wanted = optimizer_state.ENGINE if self.config.offload.enabled else optimizer_state.TORCH
        if kind is None:
            raise UserError(f"--resume {ckpt.path}: state.pt holds no optimizer state this trainer can read")
        if kind == wanted:
            return state
        warnings.warn(f"--resume {ckpt.path}: its optimizer state was saved by the {kind}; converted for the "
                      f"{wanted} (offload.enabled={str(self.config.offload.enabled).lower()})")
        if wanted == optimizer_state.ENGINE:
            return optimizer_state.torch_to_engine(state, self.model, self.optimizer)
        return optimizer_state.engine_to_torch(state, self.model, self.optimizer.state_dict())

    def _warn_changed(self, saved: TrainConfig, path: Path) -> None:
        """One warning line if the data a resumed run sees differs from what the checkpoint saw."""
        changes = [f"data.{k} {v!r} -> {getattr(self.config.data, k)!r}" for k, v in vars(saved.data).items()
                   if getattr(self.config.data, k) != v]
        if saved.run.batch_size != self.config.run.batch_size:
            changes.append(f"run.batch_size {saved.run.batch_size} -> {self.config.run.batch_size}")
        if changes:
            warnings.warn(f"--resume {path}: the data changed since it was saved ({', '.join(changes)}); "
                          "the run continues, but not as the uninterrupted run would have")

    def init_from(self, checkpoint: str | Path) -> tuple[list[str], list[str]]:
        """Start from pretrained weights: every name+shape match loads, the rest is listed."""
        ckpt = load_checkpoint(checkpoint)
        bad = first_nonfinite(ckpt.sampling_weights)
        if bad is not None:
            raise UserError(f"--init-from {ckpt.path}: weight {bad} holds NaN or infinity; use another checkpoint")
        self.prepare()
        loaded, skipped = load_matching(self.model, ckpt.sampling_weights)
        if self.ema is not None:
            self.ema = EMA(self._weights(), self.ema.decay)
        return loaded, skipped

    # -- the loop -------------------------------------------------------------------------------

    def loss_fn(self, generator: torch.Generator):
        """The step's loss as a function of the model, as the optimizer seam wants it."""
        return self.task.loss_fn(generator)

    def _weights(self) -> dict:
        """The weights a checkpoint holds (every weight, or LoRA's adapters only), from the optimizer."""
        return self.task.weights(self.optimizer.model_state_dict())

    def check_finite(self, loss: float, lr: float) -> None:
        """Stop (NonFiniteError) if the step just run gave a non-finite loss or left non-finite
        weights, naming the step (1-based, as logged) and which of the two it was."""
        optim = self.config.optim
        clip = (f"optim.max_grad_norm={optim.max_grad_norm:g} was set, so clipping did not prevent it"
                if optim.max_grad_norm is not None
                else "optim.max_grad_norm is null: setting it (e.g. 1.0) clips the gradients")
        advice = (f"lower optim.lr (now {optim.lr:g}, {lr:.3g} at this step); {clip}; "
                  "no checkpoint was written from this step")
        if not math.isfinite(loss):
            raise NonFiniteError(f"loss became {loss} at step {self.step + 1} although the weights before it were "
                                 f"finite; {advice}")
        bad = first_nonfinite(self.optimizer.model_state_dict())
        if bad is not None:
            raise NonFiniteError(f"the update of step {self.step + 1} made weight {bad} non-finite although its loss "
                                 f"{loss:.4g} was finite (the gradients or the update overflowed); {advice}")

    def save(self) -> Path:
        weights = self._weights()
        bad = first_nonfinite(weights)
        if bad is not None:  # check_finite stops the loop first; this guards direct callers
            raise NonFiniteError(f"weight {bad} holds NaN or infinity at step {self.step}; no checkpoint was written")
        state = {"optimizer": self.optimizer.state_dict(), "step": self.step, "torch_rng": torch.get_rng_state()}
        ema = None if self.ema is None else self.ema.shadow
        previous = checkpoint_steps(self.run_dir)
        intact = (f"checkpoint-{max(previous)} is intact and --resume latest continues from it" if previous
                  else "no checkpoint was written")
        with diskfull.writing(f"checkpoint-{self.step}", self.run_dir, diskfull.tensor_bytes(weights, ema, state), intact):
            path = save_checkpoint(self.run_dir, self.step, self.config.to_dict(), weights, ema, state,
                                   self.config.run.keep_last)
        with diskfull.writing("the caption cache", self.run_dir, None, f"{path.name} is complete"):
            self.task.after_save()
        return path

    def train(self, until: int | None = None) -> TrainResult:
        """Run from the current step to `until` (default: run.steps), logging and checkpointing."""
        run, until = self.config.run, until or self.config.run.steps
        result = TrainResult(self.run_dir)
        with self.lock(), self._nothing_left_on_error():
            self._claim_folder()
            self.prepare()
            writer = _tensorboard(self.run_dir) if run.tensorboard else None
            start = time.perf_counter()
            bar = tqdm(total=until, initial=self.step, desc=run.name, disable=self.quiet, dynamic_ncols=True)
            self.model.train()
            try:
                with open(self.run_dir / "metrics.jsonl", "a") as log:
                    while self.step < until:
                        lr = warmup_lr(self.config.optim, self.step)
                        self.optimizer.set_lr(lr)
                        loss = self.optimizer.train_step(self.loss_fn(step_generator(run.seed, self.step)))
                        self.check_finite(loss, lr)
                        if self.ema is not None:
                            self.ema.update(self._weights(), self.step)
                        self.step += 1
                        result.losses.append(loss)
                        bar.update(1)
                        bar.set_postfix(loss=f"{loss:.4f}")
                        if self.step % run.log_every == 0 or self.step == until:
                            self._log(log, writer, loss, lr, time.perf_counter() - start, len(result.losses))
                        if self.step % run.save_every == 0 or self.step == until:
                            result.last_checkpoint = self.save()
            finally:
                bar.close()
                if writer is not None:
                    writer.close()
        result.seconds = time.perf_counter() - start
        return result

    def _log(self, log, writer, loss: float, lr: float, elapsed: float, done: int) -> None:
        record = {"step": self.step, "loss": loss, "lr": lr, "elapsed_s": round(elapsed, 2)}
        log.write(json.dumps(record) + "\n")
        log.flush()
        if writer is not None:
            writer.add_scalar("train/loss", loss, self.step)
            writer.add_scalar("train/lr", lr, self.step)
        if not self.quiet:
            tqdm.write(f"step {self.step}/{self.config.run.steps}  loss {loss:.4f}  lr {lr:.2e}  {elapsed / done:.2f} s/step")


def _earlier_hint(path: Path) -> str:
    """For a checkpoint that does not load: the newest earlier one of its run that does (after an
    interrupted copy or a disk error), as the next thing to try."""
    folder = Path(path) if CHECKPOINT.match(Path(path).name) else latest_checkpoint(Path(path))
    if folder is None:
        return ""
    step = int(CHECKPOINT.match(folder.name).group(1))
    for earlier in reversed([p for s, p in checkpoint_steps(folder.parent).items() if s < step]):
        try:
            load_checkpoint(earlier, with_state=True)
        except UserError:
            continue
        return (f"; the previous good checkpoint is {earlier}: move {folder.name} out of the run folder and "
                "--resume latest continues from it")
    return "; no earlier checkpoint of the run loads either"


def build_task(config: TrainConfig, device: torch.device, run_dir: Path, quiet: bool = False):
    """The task of a config: a diffusers folder's transformer (`model.pretrained`) or one of our presets."""
    if config.pretrained:
        from slidefusion.training.finetune.task import FolderTask

        return FolderTask(config, device, run_dir, quiet)
    return OwnModelTask(config, device, run_dir, quiet)


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("run.tensorboard=true needs the tensorboard package: pip install 'slidefusion[tensorboard]'") from None
    return SummaryWriter(str(run_dir / "tensorboard"))


def _first_difference(saved, config) -> str:
    """The first model.* or lora.* key whose value differs, e.g. "lora.rank: 16 in the checkpoint, 8 here"."""
    for section in ("model", "lora"):
        a, b = getattr(saved, section), getattr(config, section)
        if type(a) is not type(b):
            return f"{section}: {type(a).__name__} in the checkpoint, {type(b).__name__} here"
        for key in dataclasses.fields(a):
            old, new = getattr(a, key.name), getattr(b, key.name)
            if old != new:
                return f"{section}.{key.name}: {old!r} in the checkpoint, {new!r} here"
    return "model"
