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
from slidefusion.training.finetune.caches import FinetuneCache, component_identity
from slidefusion.training.finetune.loss import FolderObjective
from slidefusion.training.task import ResidentOptimizer, dataset_of, draw_batch, offload_policy

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


def dataset_caption(dataset, index: int) -> str:
    """A clip's caption without decoding its video where the dataset allows."""
    if hasattr(dataset, "captions"):
        return dataset.captions[index]
    if hasattr(dataset, "scene"):
        from slidefusion.data import caption

        return caption(dataset.scene(index))
    return dataset[index]["caption"]


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
    return mode


class FolderTask:
    """See the module docstring. Steps 2 and 3 wait for `prepare()` (the trainer calls it once the run
    goes ahead: after --resume checked its checkpoint), so bad input costs no cache. Attributes the
    trainer reads then: `model`, `optimizer`."""

    lazy = True

    def __init__(self, config, device: torch.device, run_dir: Path, quiet: bool = False):
        from slidefusion.pretrained.source import open_source

        self.config, self.device, cfg, data = config, device, config.model, config.data
        check(config.diffusion.direction_contrast == 0, f"diffusion.direction_contrast="
              f"{config.diffusion.direction_contrast} is for our own models on the moving shapes; set it to 0 here")
        source = open_source(cfg.pretrained, cfg.expert, data.frames, data.height, data.width, cfg.transformer)
        self.folder, self.adapter, self.latent, self.grid = source.folder, source.adapter, source.latent, source.grid
        meta = source.meta
        self.image_mode = checked_image_mode(self.folder, config)
        check(slide_attention_handle(meta) is None, f"model.pretrained={cfg.pretrained}: its {cfg.expert} was saved "
              "with slide attention; fine-tuning a saved slide-attention model again is not supported: resume the "
              "run that trained it, or sample it with generate --pretrained")
        self.slide = slide_for_grid(cfg, self.grid)
        self._adapt(meta)
        if not quiet:
            self._say_window()
        self.objective = FolderObjective(source.adapter, source.scheduler, config.diffusion, source.timesteps)
        check(config.lora.base_dtype is None or config.offload.enabled,
              f"lora.base_dtype={config.lora.base_dtype} stores the frozen base on the host for the offload engine; "
              "add --offload, or drop lora.base_dtype")
        self.policy = self._fit(meta, device)  # the planner's refusal now, not after the caches
        if data.cache_dir:  # a file there, or a folder nothing can be written to, fails now, not after loading
            validate.output_path(data.cache_dir, "data.cache_dir", folder=True, inside=True)
        self.dataset = dataset_of(data)
        self.captions = [dataset_caption(self.dataset, i) for i in range(len(self.dataset))]
        self.run_dir, self.quiet = run_dir, quiet
        self.model, self.optimizer, self.cache = meta, None, None

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
        self.cache = self._cache(self.run_dir, self.quiet)
        self.optimizer = self._offloaded() if self.config.offload.enabled else self._resident()

    # ---------------------------------------------------------------- caches
    def _cache(self, run_dir: Path, quiet: bool) -> FinetuneCache:
        from slidefusion.pretrained import PretrainedParts

        text = self.adapter.text
        text_components = [*text.encoders, *text.tokenizers]
        root = Path(self.config.data.cache_dir) if self.config.data.cache_dir else run_dir / "cache"
        image = None
        if self.image_mode is not None:  # what conditions each clip: its first frame
            encoder = [c for c in ("image_encoder", "image_processor") if c in self.folder.components()]
            image = (self.image_mode, component_identity(self.folder, encoder), self.latent)
        cache = FinetuneCache(root, self.config.data, self.dataset, component_identity(self.folder, ["vae"]),
                              component_identity(self.folder, text_components), text, image)
        self.cache = cache  # before filling: a stop on bad input midway takes back what was written
        clips, texts = cache.missing([*self.captions, ""])
        if clips or texts:
            parts = PretrainedParts.load(self.folder, transformers=False)
            written = cache.fill(parts, self.device, quiet, [*self.captions, ""])
            del parts  # the VAE and text encoders go before the transformer comes
            if not quiet:
                print(f"cached {written} files under {root}")
        return cache

    # ---------------------------------------------------------------- the model
    def _lora_init(self, model: nn.Module) -> dict:
        return lora_lib.initial_lora_weights(model, self.config.run.seed) if self.config.lora.enabled else {}

    def _resident(self) -> ResidentOptimizer:
        from slidefusion.pretrained import load_transformer

        model = load_transformer(self.folder, self.config.model.expert, torch.float32)
        self._adapt(model, weights=True)
        self.model = model.to(self.device).train()
        return ResidentOptimizer(self.model, self.config.optim)

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
        engine = OffloadEngine(model, self.blocks, self.policy)
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
    def loss_fn(self, generator: torch.Generator):
        """The step's loss as a function of the model: cached latents and text of the drawn clips."""
        run = self.config.run
        indices, captions = draw_batch(self.dataset, run.batch_size, self.config.diffusion.caption_dropout, generator,
                                       lambda i: self.captions[i])
        latents = self.cache.latents(indices).to(self.device)
        text = self.cache.text(captions)
        text = type(text)(text.states.to(self.device), None if text.mask is None else text.mask.to(self.device),
                          None if text.pooled is None else text.pooled.to(self.device))
        if self.image_mode is not None:
            text = self.cache.with_image(text, indices, self.config.diffusion.image_dropout, generator, self.device)

        def loss(model: nn.Module) -> torch.Tensor:
            return self.objective.loss(model, latents, text, generator)

        return loss

    def weights(self, state: dict) -> dict:
        """Every weight, or LoRA's adapters only (and slide attention's offset networks)."""
        if not self.config.lora.enabled:
            return state
        return {k: v for k, v in state.items() if lora_lib.is_lora_weight(k) or is_offset_weight(k)}

    def load_weights(self, weights: dict, source: Path) -> None:
        if not self.config.lora.enabled:
            self.model.load_state_dict(weights)
            return
        expected = set(self.weights(self.model.state_dict()))
        if set(weights) != expected:
            odd = sorted(set(weights) ^ expected)
            raise UserError(f"--resume {source}: its LoRA weights do not fit this run's adapters (e.g. {odd[0]}); "
                            "was it trained with other lora.rank or lora.target_modules?")
        self.model.load_state_dict(weights, strict=False)

    def after_save(self) -> None:
        pass

    def discard_written(self) -> None:
        """The cache files this run computed (see `Trainer`: a new run stopped by bad input)."""
        if self.cache is not None:
            self.cache.discard_written()
