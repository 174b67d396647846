"""The training loop: data -> text + autoencoder -> rectified-flow loss -> optimizer -> checkpoints.

Every step's randomness (which clips, which captions are dropped, noise, timesteps) comes from a
generator seeded by (run seed, step), so a run resumed from a checkpoint repeats exactly the loss
sequence of an uninterrupted one. The optimizer sits behind a small `train_step(loss_fn)` seam, so
an offload engine with the same methods can replace `ResidentOptimizer` without touching the loop.
"""

import json
import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from slidefusion import memory, validate
from slidefusion.data import build_dataset
from slidefusion.diffusion import flow_loss
from slidefusion.errors import NonFiniteError, UserError
from slidefusion.models import build_model
from slidefusion.offload.training import offload_optimizer
from slidefusion.text import CaptionCache, build_text_encoder
from slidefusion.training import optimizer_state
from slidefusion.training.checkpoint import checkpoint_steps, first_nonfinite, load_checkpoint, load_matching, save_checkpoint
from slidefusion.training.config import OptimConfig, TrainConfig, build
from slidefusion.training.run_folder import RunLock, remove_stale_temporaries, truncate_metrics
from slidefusion.vae import build_autoencoder


class ResidentOptimizer:
    """AdamW on a model that lives on one device; `train_step(loss_fn)` does one whole update."""

    def __init__(self, model: nn.Module, optim: OptimConfig):
        self.model = model
        self.max_grad_norm = optim.max_grad_norm
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                           weight_decay=optim.weight_decay)

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, loss_fn) -> float:
        """Forward + backward of `loss_fn(model)`, optional clipping, one AdamW step; the loss."""
        self.optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(self.model)
        loss.backward()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return loss.item()

    def model_state_dict(self) -> dict:
        """The weights being trained (an offload engine returns its fp32 master copy here)."""
        return self.model.state_dict()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


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
        validate.output_path(config.run.output_dir, "run.output_dir", folder=True)  # before any work
        self.run_dir = Path(config.run.output_dir) / config.run.name
        self.device = validate.device(config.run.device, "run.device")
        data = config.data
        options = dict(kind=data.kind, frames=data.frames, height=data.height, width=data.width)
        if data.kind == "shapes":
            options.update(num_samples=data.num_samples, seed=data.seed, max_objects=data.max_objects)
        else:
            options.update(root=data.root, stride=data.stride)
        self.autoencoder = build_autoencoder(config.autoencoder).to(self.device)
        latent = self.autoencoder.latent_shape(data.frames, data.height, data.width)  # fails early on a bad size
        if latent[0] != config.model.in_channels:
            raise UserError(f"model.in_channels={config.model.in_channels} must equal the autoencoder's latent channels {latent[0]}")
        offload = config.offload.enabled  # the engine places the weights itself (and checks their fit)
        parts = memory.training_parts(config.model, latent, (data.frames, data.height, data.width),
                                      config.run.batch_size, ema=config.optim.ema_decay is not None, offload=offload)
        memory.check_fits(parts, self.device, "a training step", "lower run.batch_size, data.frames, data.height "
                          "or data.width, or choose a smaller model" + ("" if offload else ", or train with --offload"))
        self.dataset = build_dataset(**options)
        encoder = build_text_encoder(config.text_encoder, config.text_max_length, width=config.model.text_dim)
        self.captions = CaptionCache(encoder, self.run_dir / "captions.safetensors")
        torch.manual_seed(config.run.seed)  # the initial weights are a function of the config alone
        self.model = build_model(config.model, "cpu" if offload else self.device)
        grid = self.model.token_grid((1, *latent))  # a size the patch does not divide fails here, by name
        self.optimizer = offload_optimizer(self.model, config, grid) if offload else ResidentOptimizer(self.model, config.optim)
        self.ema = EMA(self.model.state_dict(), config.optim.ema_decay) if config.optim.ema_decay else None
        self.step = 0
        self._lock: RunLock | None = None
        self._continues = False  # True once this trainer resumed the run, or wrote into its folder

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

    def _claim_folder(self) -> None:
        """Refuse to start a new run over an earlier one's checkpoints; keep one metrics record per step."""
        if not self._continues:
            earlier = checkpoint_steps(self.run_dir)
            if earlier:
                raise UserError(f"run folder {self.run_dir} already holds checkpoint-{max(earlier)} of an earlier run; "
                                "continue it with --resume latest, or choose another run.name (nothing was changed)")
            self._continues = True
        truncate_metrics(self.run_dir / "metrics.jsonl", self.step)
        tmp = self.run_dir / ".config.json.tmp"
        tmp.write_text(json.dumps(self.config.to_dict(), indent=2))
        tmp.replace(self.run_dir / "config.json")

    # -- starting points ------------------------------------------------------------------------

    def resume(self, checkpoint: str | Path) -> Path:
        """Continue a run exactly where `checkpoint` left it ('latest' = this run's newest)."""
        path = self.run_dir if checkpoint == "latest" else Path(checkpoint)
        ckpt = load_checkpoint(path, with_state=True)
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
        if saved.model != self.config.model:
            raise UserError(f"--resume {ckpt.path}: its model config differs from this run's; use --init-from to adapt weights")
        bad = first_nonfinite(ckpt.model)
        if bad is not None:
            raise UserError(f"--resume {ckpt.path}: weight {bad} holds NaN or infinity; resume from an earlier checkpoint")
        self._warn_changed(saved, ckpt.path)
        self.model.load_state_dict(ckpt.model)
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
        loaded, skipped = load_matching(self.model, ckpt.sampling_weights)
        if self.ema is not None:
            self.ema = EMA(self.model.state_dict(), self.ema.decay)
        return loaded, skipped

    # -- the loop -------------------------------------------------------------------------------

    def batch(self, generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
        """A batch of clips (B, 3, T, H, W) and captions, some dropped to "" for CFG."""
        size = self.config.run.batch_size
        indices = torch.randint(len(self.dataset), (size,), generator=generator).tolist()
        items = [self.dataset[i] for i in indices]
        drop = torch.rand(size, generator=generator) < self.config.diffusion.caption_dropout
        captions = ["" if d else item["caption"] for d, item in zip(drop.tolist(), items)]
        return torch.stack([item["video"] for item in items]), captions

    def loss_fn(self, generator: torch.Generator):
        """The step's loss as a function of the model, as the optimizer seam wants it."""
        video, captions = self.batch(generator)
        with torch.no_grad():
            latents = self.autoencoder.encode(video.to(self.device))
        states, mask = self.captions.get(captions)
        states, mask = states.to(self.device), mask.to(self.device)

        def loss(model: nn.Module) -> torch.Tensor:
            velocity = lambda x, t: model(x, t, states, mask)  # noqa: E731
            return flow_loss(velocity, latents, self.config.diffusion, generator)

        return loss

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
        weights = self.optimizer.model_state_dict()
        bad = first_nonfinite(weights)
        if bad is not None:  # check_finite stops the loop first; this guards direct callers
            raise NonFiniteError(f"weight {bad} holds NaN or infinity at step {self.step}; no checkpoint was written")
        state = {"optimizer": self.optimizer.state_dict(), "step": self.step, "torch_rng": torch.get_rng_state()}
        path = save_checkpoint(self.run_dir, self.step, self.config.to_dict(), weights,
                               None if self.ema is None else self.ema.shadow, state, self.config.run.keep_last)
        self.captions.save()
        return path

    def train(self, until: int | None = None) -> TrainResult:
        """Run from the current step to `until` (default: run.steps), logging and checkpointing."""
        run, until = self.config.run, until or self.config.run.steps
        result = TrainResult(self.run_dir)
        with self.lock():
            self._claim_folder()
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
                            self.ema.update(self.optimizer.model_state_dict(), self.step)
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


def _tensorboard(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("run.tensorboard=true needs the tensorboard package: pip install 'slidefusion[tensorboard]'") from None
    return SummaryWriter(str(run_dir / "tensorboard"))
