"""The training loop: a task's loss (data, text, latents, model) -> optimizer -> checkpoints.

The task (`training.task`) is one of our presets or a diffusers folder's transformer; the loop,
checkpoints, resume, EMA, NaN stops and the run folder's lock are the same for both.

Every step's randomness (which clips, which captions are dropped, noise, timesteps) comes from a
generator seeded by (run seed, step), so a run resumed from a checkpoint repeats exactly the loss
sequence of an uninterrupted one. The optimizer sits behind a small `train_step(loss_fn)` seam, so
an offload engine with the same methods can replace `ResidentOptimizer` without touching the loop.

Under torchrun every rank runs this loop (`training.distributed`): each computes its rows of the
step's global batch, the optimizer reduces the gradients, the logged loss is the ranks' mean, and
rank 0 alone writes (lock, config, metrics, checkpoints), the others waiting on its outcome.
"""

import dataclasses
import importlib.util
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
from slidefusion.training import distributed, optimizer_state
from slidefusion.training.config import OptimConfig, TrainConfig, build
from slidefusion.training.loggers import RunLog
from slidefusion.training.run_folder import LOCK_NAME, RunLock, remove_stale_temporaries, truncate_metrics
from slidefusion.training.schedule import lr_at
from slidefusion.training.task import OwnModelTask, ResidentOptimizer  # noqa: F401  (ResidentOptimizer: re-exported)
from slidefusion.training.weights import load_matching


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


def warmup_lr(optim: OptimConfig, step: int, total: int | None = None) -> float:
    """The learning rate of `step` (`training.schedule.lr_at`; `total` defaults to warm-up + 1 step)."""
    return lr_at(optim, step, total if total is not None else optim.warmup_steps + 1)


def resolve_device(config: TrainConfig, quiet: bool) -> TrainConfig:
    """`config` with `run.device=auto` resolved (`RunConfig.resolved_device`), and said which."""
    if not config.run.auto_device:
        return config
    chosen = config.run.resolved_device()
    if not quiet:
        print(f"run.device=auto: training on {chosen}" + ("" if chosen == "cuda" else " (no CUDA device here)"))
    return dataclasses.replace(config, run=dataclasses.replace(config.run, device=chosen))


def check_loggers(config: TrainConfig) -> None:
    """The logging packages a config asks for, before any work (one line naming the extra)."""
    if config.run.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise UserError("run.tensorboard=true needs the tensorboard package: pip install 'slidefusion[tensorboard]'")
    if config.run.wandb and importlib.util.find_spec("wandb") is None:
        raise UserError(f"run.wandb={config.run.wandb} needs the wandb package: pip install 'slidefusion[wandb]' "
                        "(set WANDB_MODE=offline to log without a network)")


def step_generator(seed: int, step: int) -> torch.Generator:
    """The step's own random stream: a function of (seed, step) only."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step)


@dataclass
class TrainResult:
    run_dir: Path
    losses: list[float] = field(default_factory=list)  # one per step run in this call
    last_checkpoint: Path | None = None
    seconds: float = 0.0  # training, validation excluded
    validation_seconds: float = 0.0


class Trainer:
    """Owns the pieces of one run and its loop; build it from a `TrainConfig`."""

    def __init__(self, config: TrainConfig, quiet: bool = False):
        self.config = config = resolve_device(config, quiet)
        validate.output_path(config.run.output_dir, "run.output_dir", folder=True, inside=True)  # before any work
        check_loggers(config)
        self.run_dir = Path(config.run.output_dir) / config.run.name
        self.device = validate.device(config.run.device, "run.device")
        self.ranks = distributed.start(config)  # one process, or this rank of a torchrun world (checked here)
        if self.ranks.active and config.validate.enabled:
            raise UserError("validate.prompts / validate.data run on one process; under torchrun leave them unset "
                            "and sample the checkpoints with slidefusion generate")
        if self.ranks.place.dp > 1 and config.offload.enabled and config.run.grad_accum > 1:
            raise UserError(f"run.grad_accum={config.run.grad_accum} with --offload on {self.ranks.place.dp} data-parallel "
                            "ranks is not supported yet; raise run.batch_size or the number of ranks instead, or "
                            "train resident (without --offload)")
        self.device, self.quiet = self.ranks.device, quiet or not self.ranks.writer
        self.task = self.ranks.together(build_task, config, self.device, self.run_dir, self.quiet, self.ranks)
        self.total_steps = total_steps(config, self.task, self.quiet)
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
        self.ranks.agree(lock.acquire)  # rank 0 holds it for every rank
        self._lock = lock
        try:
            removed = self.ranks.agree(remove_stale_temporaries, self.run_dir)
            if removed:
                warnings.warn(f"removed what an interrupted save left in {self.run_dir}: {', '.join(removed)}")
            yield
        except UserError as error:
            if getattr(error, "exit_code", 2) == 2 and lock.created and not checkpoint_steps(self.run_dir):
                _discard_new_run(self.run_dir)  # a mistake found after the folder was made: leave nothing
            raise
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
        self.ranks.agree(self._claim_on_disk)
        self._continues = True

    def _claim_on_disk(self) -> None:
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
        """Continue a run exactly where `checkpoint` left it ('latest' = this run's newest), on any
        number of ranks (every rank reads it)."""
        return self.ranks.together(self._resume, checkpoint)

    def _resume(self, checkpoint: str | Path) -> Path:
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
        self._warn_changed(saved, ckpt.path, int(ckpt.state.get("global_batch", saved.run.batch_size)))
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

    def _warn_changed(self, saved: TrainConfig, path: Path, global_batch: int) -> None:
        """One warning line if the data a resumed run sees differs from what the checkpoint saw (the
        global batch, data-parallel ranks x run.batch_size, decides which samples a step draws)."""
        changes = [f"data.{k} {v!r} -> {getattr(self.config.data, k)!r}" for k, v in vars(saved.data).items()
                   if getattr(self.config.data, k) != v]
        for key in ("grad_accum", *(("steps", "epochs") if self.config.optim.schedule != "constant" else ())):
            old, new = getattr(saved.run, key), getattr(self.config.run, key)
            if old != new:
                changes.append(f"run.{key} {old} -> {new}")
        if global_batch != self._global_batch():
            one_process = global_batch == saved.run.batch_size and self.ranks.place.dp == 1
            changes.append(f"run.batch_size {saved.run.batch_size} -> {self.config.run.batch_size}" if one_process else
                           f"global batch (data-parallel ranks x run.batch_size) {global_batch} -> {self._global_batch()}")
        if changes:
            warnings.warn(f"--resume {path}: the data changed since it was saved ({', '.join(changes)}); "
                          "the run continues, but not as the uninterrupted run would have")

    def init_from(self, checkpoint: str | Path) -> tuple[list[str], list[str]]:
        """Start from pretrained weights: every name+shape match loads, the rest is listed."""
        return self.ranks.together(self._init_from, checkpoint)

    def _init_from(self, checkpoint: str | Path) -> tuple[list[str], list[str]]:
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
        """The step's loss as a function of the model (or, with run.grad_accum, a list: one per
        micro-batch), as the optimizer seam wants it."""
        return self.task.loss_fn(generator, self.step)

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
        bad = self._nonfinite_weight()
        if bad is not None:
            raise NonFiniteError(f"the update of step {self.step + 1} made weight {bad} non-finite although its loss "
                                 f"{loss:.4g} was finite (the gradients or the update overflowed); {advice}")

    def _global_batch(self) -> int:
        return self.ranks.place.dp * self.config.run.batch_size

    def _nonfinite_weight(self) -> str | None:
        """The first non-finite weight, asked of the optimizer where its weights are spread over ranks."""
        check = getattr(self.optimizer, "first_nonfinite", None)
        return check() if check is not None else first_nonfinite(self.optimizer.model_state_dict())

    def save(self) -> Path:
        """checkpoint-STEP, written by rank 0 (every rank takes part in gathering what it holds)."""
        weights = self._weights()
        bad = first_nonfinite(weights)
        if bad is not None:  # check_finite stops the loop first; this guards direct callers
            raise NonFiniteError(f"weight {bad} holds NaN or infinity at step {self.step}; no checkpoint was written")
        state = {"optimizer": self.optimizer.state_dict(), "step": self.step, "torch_rng": torch.get_rng_state(),
                 "global_batch": self._global_batch()}
        ema = None if self.ema is None else self.ema.shadow

        def write() -> Path:
            previous = checkpoint_steps(self.run_dir)
            intact = (f"checkpoint-{max(previous)} is intact and --resume latest continues from it" if previous
                      else "no checkpoint was written")
            with diskfull.writing(f"checkpoint-{self.step}", self.run_dir, diskfull.tensor_bytes(weights, ema, state),
                                  intact):
                path = save_checkpoint(self.run_dir, self.step, self.config.to_dict(), weights, ema, state,
                                       self.config.run.keep_last)
            with diskfull.writing("the caption cache", self.run_dir, None, f"{path.name} is complete"):
                self.task.after_save()
            return path

        return self.ranks.agree(write) or self.run_dir / f"checkpoint-{self.step}"

    def train(self, until: int | None = None) -> TrainResult:
        """Run from the current step to `until` (default: the run's length), logging, checkpointing
        and validating; validation time is counted apart from training time."""
        run, until = self.config.run, until or self.total_steps
        result = TrainResult(self.run_dir)
        with self.lock(), self._nothing_left_on_error():
            self._claim_folder()
            self.prepare()
            validator = getattr(self.task, "validator", None)
            table = self.task.describe_data() if self.step < until else None
            if table and not self.quiet:
                print(table)
            log = RunLog(self.run_dir, self.config) if self.ranks.writer else None  # rank 0 writes
            start, self.validation_s = time.perf_counter(), 0.0
            bar = tqdm(total=until, initial=self.step, desc=run.name, disable=self.quiet, dynamic_ncols=True)
            self.model.train()
            try:
                while self.step < until:
                    lr = lr_at(self.config.optim, self.step, self.total_steps)
                    self.optimizer.set_lr(lr)
                    loss = self.optimizer.train_step(self.loss_fn(step_generator(run.seed, self.step)))
                    loss = self.ranks.mean(loss)  # the global batch's loss, the same on every rank
                    self.check_finite(loss, lr)
                    if self.ema is not None:
                        self.ema.update(self._weights(), self.step)
                    self.step += 1
                    result.losses.append(loss)
                    bar.update(1)
                    bar.set_postfix(loss=f"{loss:.4f}")
                    if self.step % run.log_every == 0 or self.step == until:
                        self._log(log, loss, lr, time.perf_counter() - start - self.validation_s, len(result.losses))
                    if self.step % run.save_every == 0 or self.step == until:
                        result.last_checkpoint = self.save()
                    if validator is not None and validator.due(self.step, until):
                        self._validate(validator, log)
            finally:
                bar.close()
                if log is not None:
                    log.close()
        result.seconds = time.perf_counter() - start - self.validation_s
        result.validation_seconds = self.validation_s
        return result

    def _validate(self, validator, log: RunLog) -> None:
        record = validator.run(self, log)
        self.validation_s += record["validation_s"]
        log.scalars(self.step, record, prefix="validate")
        if not self.quiet:
            held = f"  held-out loss {record['heldout_loss']:.4f}" if "heldout_loss" in record else ""
            samples = f"  {record['samples']} samples in samples/step-{self.step}" if record.get("samples") else ""
            tqdm.write(f"validation at step {self.step}:{samples}{held}  ({record['validation_s']:.1f} s)")

    def _log(self, log: RunLog | None, loss: float, lr: float, elapsed: float, done: int) -> None:
        if log is None:  # not rank 0
            return
        log.scalars(self.step, {"loss": loss, "lr": lr, "elapsed_s": round(elapsed, 2)})
        if not self.quiet:
            tqdm.write(f"step {self.step}/{self.total_steps}  loss {loss:.4f}  lr {lr:.2e}  {elapsed / done:.2f} s/step")


def total_steps(config: TrainConfig, task, quiet: bool) -> int:
    """run.steps, or run.epochs of the task's steps per epoch (said when it replaces run.steps)."""
    run = config.run
    if run.epochs is None:
        return run.steps
    per_epoch = task.steps_per_epoch
    if not quiet:
        print(f"run.epochs={run.epochs}: {run.epochs} x {per_epoch} steps = {run.epochs * per_epoch} steps "
              f"(instead of run.steps={run.steps})")
    return run.epochs * per_epoch


def cache_only(trainer: Trainer) -> Path:
    """`slidefusion cache`: the latents and text states a run of this config needs, and nothing else."""
    prepare_cache = getattr(trainer.task, "prepare_cache", None)
    if prepare_cache is None:
        raise UserError("slidefusion cache applies to fine-tunes of diffusers folders (model.pretrained=DIR); "
                        "our own models encode each batch as they train")
    with trainer.lock():
        prepare_cache()
    return trainer.task.cache.root


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


def build_task(config: TrainConfig, device: torch.device, run_dir: Path, quiet: bool = False, ranks=None):
    """The task of a config: a diffusers folder's transformer (`model.pretrained`) or one of our presets;
    `ranks` (`distributed.Distributed`): this rank's part in a multi-rank run."""
    ranks = ranks if ranks is not None and ranks.active else None
    if config.pretrained:
        from slidefusion.training.finetune.task import FolderTask

        return FolderTask(config, device, run_dir, quiet, ranks)
    return OwnModelTask(config, device, run_dir, quiet, ranks)


def _discard_new_run(run_dir: Path) -> None:
    """Remove what a run wrote into the folder its lock created (config.json, metrics, caches), so
    that an exit with a user error leaves nothing behind; the lock's release removes the folder."""
    for child in Path(run_dir).iterdir():
        if child.name == LOCK_NAME:
            continue
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()


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
