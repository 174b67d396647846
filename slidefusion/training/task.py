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
from slidefusion.core.errors import UserError, check
from slidefusion.diffusion.rows import local_rows
from slidefusion.models import build_model
from slidefusion.offload import OffloadEngine, OffloadPolicy, Workload, engine_blocks, fitting_policy
from slidefusion.offload.policy import AUTO
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
        """Forward + backward of `loss_fn(model)`, optional clipping, one AdamW step; the loss.
        A list of loss functions (micro-batches, each scaled by its share) adds up their gradients
        before the one step; returns the sum of their losses."""
        self.optimizer.zero_grad(set_to_none=True)
        value = 0.0
        for fn in loss_fn if isinstance(loss_fn, (list, tuple)) else [loss_fn]:
            loss = fn(self.model)
            loss.backward()
            value += loss.item()
        if self.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        return value

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
    if config.parallel.sp > 1 and policy.tile == AUTO:  # tiles do not split over a sample's ranks: whole blocks
        policy = dataclasses.replace(policy, tile=None)
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


def dataset_of(data, quiet: bool = True):
    """The run's dataset; an error about one of its arguments names the config key ("data.root: ...").
    Real files are scanned (`slidefusion.data.sources`) into clips of the one size the keys give,
    the skip table printed unless `quiet`."""
    if data.kind == "folder":
        from slidefusion.data.sources import Rules, format_table, scan

        for name in ("resolution", "frame_buckets"):
            check(getattr(data, name) is None, f"data.{name} applies to fine-tunes of diffusers folders "
                                               "(model.pretrained); our own models train on one clip size")
        dataset, reports = scan(data.sources(), Rules((data.frames,), (data.height, data.width), None, 1), data.strict)
        if not quiet:
            print(format_table(reports))
        return dataset
    if data.ignored_buckets() and not quiet:
        print(data.ignored_buckets())
    options = data_options(data)
    try:
        return build_dataset(**options)
    except UserError as error:
        field = str(error).split(":")[0].split(" ")[0]
        if field in options and field != "kind":
            raise UserError(f"data.{error}") from None
        raise


def draw_batch(dataset, size: int, caption_dropout: float, generator: torch.Generator, caption_of):
    """(indices, captions) of one batch, some captions dropped to "" for CFG: the same draws for every task.
    A data-parallel rank draws the whole global batch (`size`) and keeps its `Rows`."""
    indices = torch.randint(len(dataset), (size,), generator=generator).tolist()
    drop = torch.rand(size, generator=generator) < caption_dropout
    return indices, ["" if d else caption_of(i) for d, i in zip(drop.tolist(), indices)]


def dataset_caption(dataset, index: int) -> str:
    """A clip's caption without decoding its video where the dataset allows."""
    if hasattr(dataset, "captions"):
        return dataset.captions[index]
    if hasattr(dataset, "scene"):
        from slidefusion.data import caption

        return caption(dataset.scene(index))
    return dataset[index]["caption"]


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
    per run), latents from `config.autoencoder`. `rows` (set by a data-parallel trainer): this
    rank's share of each step's batch (None: all of it)."""

    rows = None

    def __init__(self, config, device: torch.device, run_dir: Path, quiet: bool = False, ranks=None):
        self.config, self.device = config, device
        check(not config.validate.enabled, "validate.prompts and validate.data apply to fine-tunes of diffusers folders "
                                           "(model.pretrained=DIR); sample our own models with generate --checkpoint")
        self.rows = None if ranks is None else ranks.rows(config.run.batch_size)
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
        self.dataset = dataset_of(data, quiet)
        encoder = build_text_encoder(config.text_encoder, config.text_max_length, width=config.model.text_dim)
        self.captions = CaptionCache(encoder, run_dir / "captions.safetensors")
        torch.manual_seed(config.run.seed)  # the initial weights are a function of the config alone
        self.model = build_model(config.model, "cpu" if offload else device)
        grid = self.model.token_grid((1, *latent))  # a size the patch does not divide fails here, by name
        if ranks is not None:
            ranks.sequence_parallel(self.model)  # before the offload engine's hooks, which then run the hooked blocks
        if offload:
            blocks = engine_blocks(self.model)
            policy = offload_policy(config, self.model, blocks, grid, shape_of_config(config.model))
            groups = None if ranks is None else ranks.engine_groups()
            self.optimizer = OffloadEngine(self.model, blocks, policy, ranks=groups)
        elif ranks is None:
            self.optimizer = ResidentOptimizer(self.model, config.optim)
        else:
            self.optimizer = ranks.resident_optimizer(self.model)

    @property
    def steps_per_epoch(self) -> int:
        """Batches drawn with replacement: an epoch is as many clips as the dataset holds."""
        run = self.config.run
        return max(1, math.ceil(len(self.dataset) / (run.batch_size * run.grad_accum)))

    def describe_data(self) -> str | None:
        return None

    def batch(self, generator: torch.Generator) -> tuple[torch.Tensor, list[str]]:
        """This rank's clips (B, 3, T, H, W) of the step's batch, and the whole batch's captions,
        some dropped to "" for CFG."""
        rows = local_rows(self.rows, self.config.run.batch_size)
        indices, captions = draw_batch(self.dataset, rows.total, self.config.diffusion.caption_dropout,
                                       generator, lambda i: dataset_caption(self.dataset, i))
        return torch.stack([self.dataset[i]["video"] for i in rows.take(indices)]), captions

    def loss_fn(self, generator: torch.Generator, step: int = 0):
        """The step's loss as a function of the model, as the optimizer seam wants it; with
        `run.grad_accum` > 1 a list of micro-batch losses, each scaled by 1 / grad_accum."""
        accum = self.config.run.grad_accum
        fns = [self._micro_loss(generator, 1.0 / accum) for _ in range(accum)]
        return fns[0] if accum == 1 else fns

    def _micro_loss(self, generator: torch.Generator, weight: float):
        rows = local_rows(self.rows, self.config.run.batch_size)
        video, captions = self.batch(generator)
        with torch.no_grad():
            latents = self.autoencoder.encode(video.to(self.device))
        diffusion = self.config.diffusion
        if diffusion.direction_contrast > 0:
            captions, has_negative = with_negatives(captions, generator)
            captions = rows.take(captions[:rows.total]) + rows.take(captions[rows.total:])
        else:
            captions = rows.take(captions)
        states, mask = self.captions.get(captions)
        states, mask = states.to(self.device), mask.to(self.device)

        def loss(model: nn.Module) -> torch.Tensor:
            velocity = lambda x, t: model(x, t, states, mask)  # noqa: E731
            if diffusion.direction_contrast > 0:
                value = contrastive_flow_loss(velocity, latents, has_negative, diffusion, generator, rows)
            else:
                value = flow_loss(velocity, latents, diffusion, generator, rows)
            return value if weight == 1.0 else value * weight

        return loss

    def prepare(self) -> None:
        """Nothing is deferred: the model and optimizer are built with the task."""

    def weights(self, state: dict) -> dict:
        """What a checkpoint's model.safetensors holds, from the optimizer's `model_state_dict()`."""
        return state

    def load_weights(self, weights: dict, source: Path) -> None:
        load_model_weights(self.optimizer, self.model, weights)

    def after_save(self) -> None:
        self.captions.save()


def load_model_weights(optimizer, model: nn.Module, weights: dict, strict: bool = True) -> None:
    """`model.load_state_dict(weights)`, through the optimizer where it owns the weights' layout (FSDP2)."""
    load = getattr(optimizer, "load_model_weights", None)
    if load is not None:
        return load(weights, strict=strict)
    model.load_state_dict(weights, strict=strict)
