"""`FolderTask`: the trainer's task for `model.pretrained=DIR`, the transformer of a diffusers folder.

In order, cheap checks first, so that a mistake costs seconds, not a cached dataset:
  1. the folder (a pipeline folder of a supported class), the transformer built on the meta device,
     the data sizes against the VAE and the patch, LoRA's target modules, the memory plan;
  2. the caches: every clip's latents (the folder's VAE) and every caption's text states (the
     folder's text encoders, through the family's own pipeline), computed once; the VAE and the
     text encoders are freed before the transformer is loaded;
  3. the transformer: resident (loaded shard by shard, float32) with torch AdamW, or with --offload
     built on the meta device with its weights streamed from the shards straight into the engine's
     host buffers (`OffloadEngine.load_weights`), never materialised twice.
The loss is the family's own (`loss.FolderObjective`); checkpoints hold every weight, or with
`lora.rank` the adapters only.

`model.attention=slide` (or neighborhood) adapts the dense model to slide attention: the
transformer's video self-attention is swapped (`use_slide_attention`) before LoRA and before any
weight is loaded, and its offset networks get their initial values from `slide_offset_weights`
(the run's seed; last layer zero, so step 0 is the dense model up to the window) on both paths
alike. The offset networks always train, LoRA or not, and are checkpointed with LoRA's adapters.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from pathlib import Path

import torch
from torch import nn

from slidefusion import memory
from slidefusion.core import validate
from slidefusion.core.errors import UserError, check
from slidefusion.offload import OffloadEngine, engine_blocks
from slidefusion.offload.engine.fp8 import check_device
from slidefusion.offload.plan.model_shape import STOCK_QUERY_TILE_PROJECTIONS, ModelShape
from slidefusion.offload.tiling.tile_runner import tiling_refusal
from slidefusion.pretrained import lora as lora_lib
from slidefusion.pretrained.image import check_image_use, image_mode
from slidefusion.swap import is_offset_weight, slide_attention_handle, slide_offset_weights, use_slide_attention
from slidefusion.training.finetune.batches import ClipSizes, FolderData, micro_batch_loss, sample_generator
from slidefusion.training.finetune.caches import FinetuneCache, component_identity
from slidefusion.training.finetune.loss import FolderObjective
from slidefusion.diffusion.rows import local_rows
from slidefusion.training.task import ResidentOptimizer, load_model_weights, offload_policy
from slidefusion.training.validation import Validator

log = logging.getLogger(__name__)
RESIDENT_BYTES_PER_PARAM = 16  # fp32 weight, gradient and two AdamW moments


def model_shape(model: nn.Module, adapter, blocks, attention: str) -> ModelShape:
    """What the offload planner needs of a diffusers transformer (built on meta is enough) whose
    blocks in call order are `blocks`."""
    counts = tuple(sum(p.numel() for p in b.parameters()) for b in blocks)
    cfg = model.config
    heads = int(cfg.num_attention_heads)
    hidden = heads * int(cfg.attention_head_dim)
    ratio = float(getattr(cfg, "ffn_dim", 0) or 4 * hidden) / hidden
    rest = sum(p.numel() for p in model.parameters()) - sum(counts)
    return ModelShape(adapter.class_name, counts, rest, hidden, heads, ratio, adapter.patch_size(model), attention,
                      tileable=tiling_refusal(model) is None, query_tile_projections=STOCK_QUERY_TILE_PROJECTIONS)


def slide_for_grid(cfg, grid: tuple[int, int, int]):
    """The swap's options (None: dense); a window wider than the run's token `grid` builds its offset
    network for that grid (recorded as model.attention_options.grid, so checkpoints rebuild the same
    model)."""
    slide = cfg.slide
    if slide is not None and slide.grid is None and any(k > n for k, n in zip(slide.kernel_size, grid)):
        cfg.attention_options["grid"] = list(grid)
        slide = cfg.slide
    return slide


def checked_image_mode(folder, config) -> str | None:
    """The folder's image mode (None: text-to-video), after the checks that go with it."""
    mode = image_mode(folder, config.model.expert)
    check(mode is not None or not config.diffusion.image_dropout,
          f"diffusion.image_dropout={config.diffusion.image_dropout} applies to image-to-video folders; "
          f"{config.model.pretrained} is text-to-video: set it to 0")
    if mode is not None:
        check_image_use(folder, True, "model.pretrained")  # a Wan 2.1 I2V folder has its image encoder
        data = config.data
        check(data.kind != "folder" or (data.resolution is None and data.frame_buckets is None),
              f"model.pretrained={config.model.pretrained} is image-to-video, which trains one clip size for now: "
              "set data.resolution: null and data.frame_buckets: null (data.frames, data.height, data.width apply)")
    return mode


class FolderTask:
    """See the module docstring. Steps 2 and 3 wait for `prepare()` (the trainer calls it once the run
    goes ahead: after --resume checked its checkpoint), so bad input costs no cache. Attributes the
    trainer reads then: `model`, `optimizer`."""

    lazy = True
    rows = None  # this rank's share of each step's batch (a data-parallel trainer sets it)

    def __init__(self, config, device: torch.device, run_dir: Path, quiet: bool = False, ranks=None):
        from slidefusion.pretrained.source import open_source
        from slidefusion.training.dist_optim import check_sequence_parallel

        self.config, self.device, cfg = config, device, config.model
        self.ranks, self.rows = ranks, None if ranks is None else ranks.rows(config.run.batch_size)
        check(config.diffusion.direction_contrast == 0, f"diffusion.direction_contrast="
              f"{config.diffusion.direction_contrast} is for our own models on the moving shapes; set it to 0 here")
        sizes = ClipSizes(config.data)  # the buckets, checked against the folder's VAE and patch
        source = open_source(cfg.pretrained, cfg.expert, sizes, cfg.transformer)
        self.rules = sizes.rules
        self.folder, self.adapter, self.latent, self.grid = source.folder, source.adapter, source.latent, source.grid
        self.vae_config, meta = source.vae_config, source.meta
        self.image_mode = checked_image_mode(self.folder, config)
        check(slide_attention_handle(meta) is None, f"model.pretrained={cfg.pretrained}: its {cfg.expert} was saved "
              "with slide attention; fine-tuning a saved slide-attention model again is not supported: resume the "
              "run that trained it, or sample it with generate --pretrained")
        self.slide = slide_for_grid(cfg, self.grid)
        self._adapt(meta)
        check_sequence_parallel(meta, config.parallel.sp)  # parallel.sp beyond the heads fails before any cache
        if not quiet:
            self._say_window()
        self.objective = FolderObjective(source.adapter, source.scheduler, config.diffusion, source.timesteps)
        check(config.lora.base_dtype is None or config.offload.enabled,
              f"lora.base_dtype={config.lora.base_dtype} stores the frozen base on the host for the offload engine; "
              "add --offload, or drop lora.base_dtype")
        self.policy = self._fit(meta, device)  # the planner's refusal now, not after the caches
        if config.data.cache_dir:  # a file there, or a folder nothing can be written to, fails now, not after loading
            validate.output_path(config.data.cache_dir, "data.cache_dir", folder=True, inside=True)
        self.model, self.optimizer, self.cache = meta, None, None
        self.validator = Validator(config, self, quiet) if config.validate.enabled else None  # its checks, before the scan
        self.data = FolderData(config, self.rules, quiet, local_rows(self.rows, config.run.batch_size).total)  # every file probed, the skip table printed
        self.dataset, self.steps_per_epoch = self.data.dataset, self.data.steps_per_epoch
        self.captions = [self.data.caption(i) for i in range(len(self.dataset))]
        if self.validator is not None:
            self.validator.scan(self.rules)
        self.run_dir, self.quiet = run_dir, quiet

    def _fit(self, meta: nn.Module, device: torch.device):
        """The engine's resolved policy with --offload (the engine takes this plan), else the resident
        memory check; None when resident."""
        if self.config.offload.enabled:
            attention = "slide" if self.slide is not None else "flash" if device.type == "cuda" else "dense"
            self.blocks = engine_blocks(meta, self.adapter)  # what the engine will stream: `prepare` builds it on these
            shape = model_shape(meta, self.adapter, self.blocks, attention)
            policy = offload_policy(self.config, meta, self.blocks, self.grid, shape)
            if policy.frozen_dtype is not None:  # before any cache: a device without fp8 casts says so now
                check_device(policy.frozen_dtype, policy.torch_device, policy.dtype)
            return policy
        params = sum(p.numel() for p in meta.parameters())
        memory.check_fits({"weights, gradients and AdamW state": params * RESIDENT_BYTES_PER_PARAM}, device,
                          "training resident", "train with --offload, or use lora.rank")
        return None

    def prepare(self) -> None:
        """The caches, then the transformer and its optimizer (see the module docstring)."""
        if self.optimizer is not None:
            return
        if self.ranks is not None and self.ranks.active:  # rank 0 fills the caches; the others then read them
            self.ranks.agree(self.prepare_cache)
            if not self.ranks.writer:
                quiet, self.quiet = self.quiet, True
                self.prepare_cache()
                self.quiet = quiet
        else:
            self.prepare_cache()
        self.optimizer = self._offloaded() if self.config.offload.enabled else self._resident()

    # ---------------------------------------------------------------- caches
    def prepare_cache(self) -> FinetuneCache:
        """Every clip's latents and every caption's (and validation prompt's) text states, computed
        where missing, once; `slidefusion cache` stops here."""
        from slidefusion.pretrained import PretrainedParts

        if self.cache is not None:
            return self.cache
        run_dir, quiet = self.run_dir, self.quiet
        text = self.adapter.text
        text_components = [*text.encoders, *text.tokenizers]
        root = Path(self.config.data.cache_dir) if self.config.data.cache_dir else run_dir / "cache"
        identities = component_identity(self.folder, ["vae"]), component_identity(self.folder, text_components)
        image = None
        if self.image_mode is not None:  # what conditions each clip: its first frame
            encoder = [c for c in ("image_encoder", "image_processor") if c in self.folder.components()]
            image = (self.image_mode, component_identity(self.folder, encoder), self.latent)
        cache = FinetuneCache(root, self.config.data, self.dataset, *identities, text, image)
        self.cache = cache  # before filling: a stop on bad input midway takes back what was written
        caches = [(cache, [*self.captions, ""])]
        if self.validator is not None:
            caches += self.validator.caches(root, identities, text)
        missing = [c.missing(texts) for c, texts in caches]
        if any(clips or texts for clips, texts in missing):
            parts = PretrainedParts.load(self.folder, transformers=False)
            written = sum(c.fill(parts, self.device, quiet, texts) for c, texts in caches)
            del parts  # the VAE and text encoders go before the transformer comes
            if not quiet:
                print(f"cached {written} files under {root}")
        elif not quiet:
            print(f"reusing the caches under {root} ({len(self.dataset)} clips, {len(set(self.captions))} captions)")
        self.cache = cache
        return cache

    # ---------------------------------------------------------------- the model
    def _lora_init(self, model: nn.Module) -> dict:
        return lora_lib.initial_lora_weights(model, self.config.run.seed) if self.config.lora.enabled else {}

    def _resident(self) -> ResidentOptimizer:
        from slidefusion.pretrained import load_transformer

        model = load_transformer(self.folder, self.config.model.expert, torch.float32)
        self._adapt(model, weights=True)
        self.model = model.to(self.device).train()
        if self.ranks is None:
            return ResidentOptimizer(self.model, self.config.optim)
        self.ranks.sequence_parallel(self.model)
        return self.ranks.resident_optimizer(self.model)

    def _adapt(self, model: nn.Module, weights: bool = False) -> None:
        """Slide attention, then LoRA, on `model` (meta or real); with `weights`, their initial values."""
        if self.slide is not None:
            use_slide_attention(model, **dataclasses.asdict(self.slide))
            if weights:
                model.load_state_dict(self._slide_init(model), strict=False)
        if self.config.lora.enabled:
            lora_lib.add_lora(model, self.config.lora, self.adapter.lora_targets)
            if weights:
                model.load_state_dict(self._lora_init(model), strict=False)
            for name, param in model.named_parameters():  # LoRA froze them; adapting means training them
                if is_offset_weight(name):
                    param.requires_grad_(True)

    def _slide_init(self, model: nn.Module) -> dict:
        return slide_offset_weights(model, self.config.run.seed) if self.slide is not None else {}

    def _say_window(self) -> None:
        """One line when the window is wider than the token grid on some axis (it is clamped there)."""
        if self.slide is None:
            return
        wide = [axis for axis, k, n in zip("THW", self.slide.kernel_size, self.grid) if k > n]
        if wide:
            axes = "that axis" if len(wide) == 1 else "those axes"
            print(f"model.attention_options.kernel_size {list(self.slide.kernel_size)} is wider than the token grid "
                  f"{list(self.grid)} along {', '.join(wide)}: slide attention attends {axes} whole (the window is "
                  f"clamped to the grid, and the offset network built for it: model.attention_options.grid="
                  f"{list(self.grid)})")

    def _offloaded(self):
        from slidefusion.pretrained import iter_weights

        model = self.model
        if self.ranks is not None:
            self.ranks.sequence_parallel(model)  # before the engine's hooks
        engine = OffloadEngine(model, self.blocks, self.policy,
                               ranks=None if self.ranks is None else self.ranks.engine_groups())
        names = lora_lib.folder_names(model)
        skipped = []

        def base():
            for name, tensor in iter_weights(self.folder, self.config.model.expert):
                if name in names:
                    yield names[name], tensor
                else:
                    skipped.append(name)

        engine.load_weights(itertools.chain(base(), self._slide_init(model).items(), self._lora_init(model).items()))
        if skipped:
            log.warning("skipped %d weight(s) the model does not have, e.g. %s", len(skipped), skipped[0])
        model.train()
        return engine

    # ---------------------------------------------------------------- the trainer's seam
    def loss_fn(self, generator: torch.Generator, step: int):
        """Step `step`'s loss as a function of the model (one micro-batch), or a list of them, each
        scaled by its share of the step's clips (`run.grad_accum`); under data parallelism this rank's
        `rows` of each micro-batch; see `batches` for the draws.
        `generator` is the trainer's step stream, unused: every sample has its own."""
        parts, rows = self.data.micro_batches(step), local_rows(self.rows, self.config.run.batch_size)
        total = sum(len(p) for p in parts)  # under data parallelism each part holds every rank's rows
        seed = self.config.run.seed  # the image condition's dropout: one draw per micro-batch, the same on every rank
        fns = [micro_batch_loss(self, rows.take(part), step, len(part) / total, sample_generator(seed, step, -1 - k))
               for k, part in enumerate(parts)]
        return fns[0] if len(fns) == 1 else fns

    def describe_data(self) -> str:
        """The bucket table printed before step 1."""
        return self.data.table()

    def weights(self, state: dict) -> dict:
        """Every weight, or LoRA's adapters only (and slide attention's offset networks)."""
        if not self.config.lora.enabled:
            return state
        return {k: v for k, v in state.items() if lora_lib.is_lora_weight(k) or is_offset_weight(k)}

    def load_weights(self, weights: dict, source: Path) -> None:
        if not self.config.lora.enabled:
            load_model_weights(self.optimizer, self.model, weights)
            return
        expected = set(self.weights(self.model.state_dict()))
        if set(weights) != expected:
            odd = sorted(set(weights) ^ expected)
            raise UserError(f"--resume {source}: its LoRA weights do not fit this run's adapters (e.g. {odd[0]}); "
                            "was it trained with other lora.rank or lora.target_modules?")
        load_model_weights(self.optimizer, self.model, weights, strict=False)

    def after_save(self) -> None:
        pass

    def discard_written(self) -> None:
        """The cache files this run computed (see `Trainer`: a new run stopped by bad input)."""
        if self.cache is not None:
            self.cache.discard_written()
