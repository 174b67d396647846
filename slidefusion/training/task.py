"""What a training run trains: the model, its data and its loss, behind one small interface the
`Trainer` loop reads (`Task`). Two kinds: our own DiT3D/STDiT from a preset (`OwnModelTask`,
here) and the transformer of a diffusers folder (`training.finetune.task.FolderTask`).

A task builds its model and optimizer (resident AdamW or the offload engine), gives each step's
loss as a function of the model (`loss_fn`), and says which weights a checkpoint holds (`weights`,
`load_weights`: all of them, or LoRA's adapters only).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn

from slidefusion import memory
from slidefusion.data import build_dataset
from slidefusion.data.shapes import DIRECTIONS, with_other_direction
from slidefusion.diffusion import contrastive_flow_loss, flow_loss
from slidefusion.core.errors import UserError
from slidefusion.models import build_model
from slidefusion.offload import OffloadEngine, OffloadPolicy, Workload, engine_blocks, fitting_policy
from slidefusion.offload.plan.model_shape import ModelShape, shape_of_config
from slidefusion.text import CaptionCache, build_text_encoder
from slidefusion.vae import build_autoencoder


class ResidentOptimizer:
    """AdamW on a model that lives on one device; `train_step(loss_fn)` does one whole update.

    torch's fused AdamW where it runs (CPU and CUDA): the fastest, and the one the offload engine
    reproduces bitwise on the host."""

    FUSED_DEVICES = ("cpu", "cuda")

    def __init__(self, model: nn.Module, optim):
        self.model = model
        self.max_grad_norm = optim.max_grad_norm
        params = list(model.parameters())
        fused = all(p.device.type in self.FUSED_DEVICES and p.is_floating_point() for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=optim.lr, betas=optim.betas, eps=optim.eps,
                                           weight_decay=optim.weight_decay, fused=fused)

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


def offload_policy(config, model: nn.Module, blocks, grid: tuple[int, int, int], shape: ModelShape) -> OffloadPolicy:
    """The engine's policy: the `offload:` section with the run's device, the `optim:` section and lora's fp8 base,
    its `auto` values resolved against `model` (meta is enough) with `blocks` (the engine's, in call
    order) and one step of `grid` (T, H, W), or the planner's one-line refusal. `shape`: the widths
    the activations scale with."""
    policy = dataclasses.replace(config.offload, device=config.run.device, optim=config.optim,
                                 frozen_dtype=config.lora.base_torch_dtype, frozen_scales=config.lora.base_scales)
    attention = shape.attention if shape.attention in ("dense", "flash", "window", "slide") else "dense"  # unknown: worst
    work = Workload(batch=config.run.batch_size, tokens=math.prod(grid), attention=attention, frames=grid[0])
    return fitting_policy(model, blocks, policy, shape, work)


def data_options(data) -> dict:
    """The dataset's constructor arguments from a `DataConfig`."""
    options = dict(kind=data.kind, frames=data.frames, height=data.height, width=data.width)
    if data.kind == "shapes":
        options.update(num_samples=data.num_samples, seed=data.seed, max_objects=data.max_objects,
                       start=data.start)
    else:
        options.update(root=data.root, stride=data.stride)
    return options


def dataset_of(data):
    """The run's dataset; an error about one of its arguments names the config key ("data.root: ...")."""
    options = data_options(data)
    try:
        return build_dataset(**options)
    except UserError as error:
        field = str(error).split(":")[0].split(" ")[0]
        if field in options and field != "kind":
            raise UserError(f"data.{error}") from None
        raise


def draw_batch(dataset, size: int, caption_dropout: float, generator: torch.Generator, caption_of):
    """(indices, captions) of one batch, some captions dropped to "" for CFG: the same draws for every task."""
    indices = torch.randint(len(dataset), (size,), generator=generator).tolist()
    drop = torch.rand(size, generator=generator) < caption_dropout
    return indices, ["" if d else caption_of(i) for d, i in zip(drop.tolist(), indices)]


def with_negatives(captions: list[str], generator: torch.Generator) -> tuple[list[str], torch.Tensor]:
    """`captions` followed by one negative each (every direction turned by the same random offset,
    `with_other_direction`), and the (B,) bool mask of the captions that have one; a caption
    without a direction (a dropped one) is its own placeholder, outside the mask."""
    offsets = torch.randint(1, len(DIRECTIONS), (len(captions),), generator=generator).tolist()
    negatives = [with_other_direction(c, o) for c, o in zip(captions, offsets)]
    has_negative = torch.tensor([n is not None for n in negatives])
    return captions + [c if n is None else n for c, n in zip(captions, negatives)], has_negative


class OwnModelTask:
    """One of our presets trained by rectified flow, text from `config.text_encoder` (captions cached
    per run), latents from `config.autoencoder`."""

    def __init__(self, config, device: torch.device, run_dir: Path, quiet: bool = False):
        self.config, self.device = config, device
        data = config.data
        if config.diffusion.image_dropout:
            raise UserError(f"diffusion.image_dropout={config.diffusion.image_dropout} applies to image-to-video "
                            "fine-tunes of a diffusers folder (model.pretrained=DIR); set it to 0")
        self.autoencoder = build_autoencoder(config.autoencoder).to(device)
        latent = self.autoencoder.latent_shape(data.frames, data.height, data.width)  # fails early on a bad size
        if latent[0] != config.model.in_channels:
            raise UserError(f"model.in_channels={config.model.in_channels} must equal the autoencoder's latent channels {latent[0]}")
        offload = config.offload.enabled  # the engine places the weights itself (and checks their fit)
        parts = memory.training_parts(config.model, latent, (data.frames, data.height, data.width),
                                      config.run.batch_size * (2 if config.diffusion.direction_contrast > 0 else 1),
                                      ema=config.optim.ema_decay is not None, offload=offload)
        memory.check_fits(parts, device, "a training step", "lower run.batch_size, data.frames, data.height "
                          "or data.width, or choose a smaller model" + ("" if offload else ", or train with --offload"))
        self.dataset = dataset_of(data)
        encoder = build_text_encoder(config.text_encoder, config.text_max_length, width=config.model.text_dim)
        self.captions = CaptionCache(encoder, run_dir / "captions.safetensors")
        torch.manual_seed(config.run.seed)  # the initial weights are a function of the config alone
        self.model = build_model(config.model, "cpu" if offload else device)
        grid = self.model.token_grid((1, *latent))  # a size the patch does not divide fails here, by name
        if offload:
            blocks = engine_blocks(self.model)
            policy = offload_policy(config, self.model, blocks, grid, shape_of_config(config.model))
            self.optimizer = OffloadEngine(self.model, blocks, policy)
        else:
            self.optimizer = ResidentOptimizer(self.model, config.optim)

    def batch(self, generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
        """A batch of clips (B, 3, T, H, W) and captions, some dropped to "" for CFG."""
        indices, captions = draw_batch(self.dataset, self.config.run.batch_size, self.config.diffusion.caption_dropout,
                                       generator, lambda i: self.dataset[i]["caption"])
        return torch.stack([self.dataset[i]["video"] for i in indices]), captions

    def loss_fn(self, generator: torch.Generator):
        """The step's loss as a function of the model, as the optimizer seam wants it."""
        video, captions = self.batch(generator)
        with torch.no_grad():
            latents = self.autoencoder.encode(video.to(self.device))
        diffusion = self.config.diffusion
        if diffusion.direction_contrast > 0:
            captions, has_negative = with_negatives(captions, generator)
        states, mask = self.captions.get(captions)
        states, mask = states.to(self.device), mask.to(self.device)

        def loss(model: nn.Module) -> torch.Tensor:
            velocity = lambda x, t: model(x, t, states, mask)  # noqa: E731
            if diffusion.direction_contrast > 0:
                return contrastive_flow_loss(velocity, latents, has_negative, diffusion, generator)
            return flow_loss(velocity, latents, diffusion, generator)

        return loss

    def prepare(self) -> None:
        """Nothing is deferred: the model and optimizer are built with the task."""

    def weights(self, state: dict) -> dict:
        """What a checkpoint's model.safetensors holds, from the optimizer's `model_state_dict()`."""
        return state

    def load_weights(self, weights: dict, source: Path) -> None:
        self.model.load_state_dict(weights)

    def after_save(self) -> None:
        self.captions.save()
