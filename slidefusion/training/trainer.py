"""The training loop: data -> text + autoencoder -> rectified-flow loss -> optimizer -> checkpoints.

Every step's randomness (which clips, which captions are dropped, noise, timesteps) comes from a
generator seeded by (run seed, step), so a run resumed from a checkpoint repeats exactly the loss
sequence of an uninterrupted one. The optimizer sits behind a small `train_step(loss_fn)` seam, so
an offload engine with the same methods can replace `ResidentOptimizer` without touching the loop.
"""

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from slidefusion.data import build_dataset
from slidefusion.diffusion import flow_loss
from slidefusion.errors import UserError
from slidefusion.models import build_model
from slidefusion.offload.training import offload_optimizer
from slidefusion.text import CaptionCache, build_text_encoder
from slidefusion.training.checkpoint import load_checkpoint, load_matching, save_checkpoint
from slidefusion.training.config import OptimConfig, TrainConfig, build
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
        self.run_dir = Path(config.run.output_dir) / config.run.name
        self.device = torch.device(config.run.device)
        data = config.data
        options = dict(kind=data.kind, frames=data.frames, height=data.height, width=data.width)
        if data.kind == "shapes":
            options.update(num_samples=data.num_samples, seed=data.seed, max_objects=data.max_objects,
                           start=data.start)
        else:
            options.update(root=data.root, stride=data.stride)
        self.dataset = build_dataset(**options)
        self.autoencoder = build_autoencoder(config.autoencoder).to(self.device)
        latent = self.autoencoder.latent_shape(data.frames, data.height, data.width)  # fails early on a bad size
        if latent[0] != config.model.in_channels:
            raise UserError(f"model.in_channels={config.model.in_channels} must equal the autoencoder's latent channels {latent[0]}")
        encoder = build_text_encoder(config.text_encoder, config.text_max_length, width=config.model.text_dim)
        self.captions = CaptionCache(encoder, self.run_dir / "captions.safetensors")
        torch.manual_seed(config.run.seed)  # the initial weights are a function of the config alone
        offload = config.offload.enabled  # the engine places the weights itself: build them on the host
        self.model = build_model(config.model, "cpu" if offload else self.device)
        grid = self.model.token_grid((1, *latent))  # a size the patch does not divide fails here, by name
        self.optimizer = offload_optimizer(self.model, config, math.prod(grid)) if offload else ResidentOptimizer(self.model, config.optim)
        self.ema = EMA(self.model.state_dict(), config.optim.ema_decay) if config.optim.ema_decay else None
        self.step = 0

    # -- starting points ------------------------------------------------------------------------

    def resume(self, checkpoint: str | Path) -> Path:
        """Continue a run exactly where `checkpoint` left it ('latest' = this run's newest)."""
        path = self.run_dir if checkpoint == "latest" else Path(checkpoint)
        ckpt = load_checkpoint(path, with_state=True)
        saved_model = build(TrainConfig, ckpt.config).model
        if saved_model != self.config.model:
            raise UserError(f"--resume {ckpt.path}: its model config differs from this run's; use --init-from to adapt weights")
        self.model.load_state_dict(ckpt.model)
        self.optimizer.load_state_dict(ckpt.state["optimizer"])
        if self.ema is not None and ckpt.ema is not None:
            self.ema.shadow = {k: v.float() for k, v in ckpt.ema.items()}
        self.step = ckpt.state["step"]
        torch.set_rng_state(ckpt.state["torch_rng"])
        return ckpt.path

    def init_from(self, checkpoint: str | Path) -> tuple[list[str], list[str]]:
        """Start from pretrained weights: every name+shape match loads, the rest is listed."""
        ckpt = load_checkpoint(checkpoint)
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

    def save(self) -> Path:
        state = {"optimizer": self.optimizer.state_dict(), "step": self.step, "torch_rng": torch.get_rng_state()}
        path = save_checkpoint(self.run_dir, self.step, self.config.to_dict(), self.optimizer.model_state_dict(),
                               None if self.ema is None else self.ema.shadow, state, self.config.run.keep_last)
        self.captions.save()
        return path

    def train(self, until: int | None = None) -> TrainResult:
        """Run from the current step to `until` (default: run.steps), logging and checkpointing."""
        run, until = self.config.run, until or self.config.run.steps
        result = TrainResult(self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.json").write_text(json.dumps(self.config.to_dict(), indent=2))
        writer = _tensorboard(self.run_dir) if run.tensorboard else None
        log = open(self.run_dir / "metrics.jsonl", "a")
        start = time.perf_counter()
        bar = tqdm(total=until, initial=self.step, desc=run.name, disable=self.quiet, dynamic_ncols=True)
        self.model.train()
        while self.step < until:
            lr = warmup_lr(self.config.optim, self.step)
            self.optimizer.set_lr(lr)
            loss = self.optimizer.train_step(self.loss_fn(step_generator(run.seed, self.step)))
            if not math.isfinite(loss):
                raise RuntimeError(f"loss became {loss} at step {self.step}; lower optim.lr or set optim.max_grad_norm")
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
        bar.close()
        log.close()
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
