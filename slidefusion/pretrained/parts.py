"""A pipeline folder's components, loaded once: what sampling, prompt encoding and training read.

    parts = PretrainedParts.load("Wan2.1-T2V-1.3B-Diffusers")                 # everything, resident
    parts = PretrainedParts.load(path, transformers=False)                     # text encoders + VAE only

The adapter carries the options the folder implies: model_index.json's (Wan 2.2's
expand_timesteps) and those the family's pipeline derives from the folder's VAE (`folder_options`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from slidefusion.core.errors import check
from slidefusion.families import ModelAdapter
from slidefusion.pretrained.folder import PretrainedFolder, open_folder


@dataclass
class PretrainedParts:
    """A folder's components on the CPU. `experts`: (transformer, lowest timestep it denoises) from
    high noise to low (one entry, or Wan 2.2 A14B's two; empty when loaded without transformers).
    `tokenizer_2` / `text_encoder_2`: HunyuanVideo's CLIP; `image_encoder` / `image_processor`:
    Wan 2.1 I2V's CLIP vision tower."""

    folder: PretrainedFolder | None
    adapter: ModelAdapter
    experts: list[tuple[nn.Module, float]]
    tokenizer: object
    text_encoder: nn.Module | None
    vae: nn.Module | None
    scheduler: object
    tokenizer_2: object = None
    text_encoder_2: nn.Module | None = None
    image_encoder: nn.Module | None = None  # Wan 2.1 I2V's CLIP vision tower, and its image processor
    image_processor: object = None
    _pipeline: object = field(default=None, repr=False)

    @classmethod
    def load(cls, path: str | Path | PretrainedFolder, dtype: torch.dtype = torch.float32,
             transformers: bool = True) -> PretrainedParts:
        """Every component of a pipeline folder (`dtype` for the transformers), or a one-line UserError."""
        from slidefusion.pretrained.build import load_transformer
        from slidefusion.pretrained.components import load_component, load_scheduler, load_text_encoders, load_vae

        folder = path if isinstance(path, PretrainedFolder) else open_folder(path)
        require_pipeline(folder, "this")
        vae = load_vae(folder)
        adapter = folder_adapter(folder, vae.config)
        encoders = load_text_encoders(folder)
        experts = [(load_transformer(folder, e.name, dtype).eval(), e.low) for e in folder.experts()] if transformers else []
        second = encoders[1] if len(encoders) > 1 else (None, None)
        image = [load_component(folder, name) if name in folder.components() else None
                 for name in ("image_encoder", "image_processor")]
        return cls(folder, adapter, experts, *encoders[0], vae, load_scheduler(folder), *second,
                   None if image[0] is None else image[0].eval(), image[1])

    @property
    def transformer(self) -> nn.Module:
        return self.experts[0][0]

    def expert_for(self, timestep: float) -> nn.Module:
        """The transformer that denoises `timestep` (model units)."""
        return next(model for model, low in self.experts if float(timestep) >= low)

    def pipeline(self):
        """The family's diffusers pipeline around these components, transformers included (none
        when loaded without them): its `encode_prompt` encodes prompts and its `__call__` is the
        family's denoising loop. Built once; its modules are these parts' own objects."""
        if self._pipeline is None:
            import diffusers

            cls = getattr(diffusers, self.adapter.pipelines[0])
            accepted = inspect.signature(cls.__init__).parameters
            parts = {name: getattr(self, name, None) for name in accepted if name in (
                "tokenizer", "text_encoder", "tokenizer_2", "text_encoder_2", "vae", "scheduler")}
            models = [model for model, _ in self.experts]
            parts["transformer"] = models[0] if models else None
            if "transformer_2" in accepted:
                parts["transformer_2"] = models[1] if len(models) > 1 else None
            index = self.folder.index if self.folder is not None and self.folder.index else {}
            extras = {k: v for k, v in {**self.adapter.options, **index}.items()
                      if k in accepted and k not in parts and not isinstance(v, list)}
            self._pipeline = cls(**parts, **extras)
            self._pipeline.set_progress_bar_config(disable=True)
        return self._pipeline

    def text_pipeline(self):
        """The pipeline whose `encode_prompt` encodes prompts (`pipeline`)."""
        return self.pipeline()


def require_pipeline(folder: PretrainedFolder, what: str) -> None:
    check(folder.is_pipeline, f"pretrained={folder.root} is a bare transformer folder; {what} needs a pipeline folder "
                              "(model_index.json with text_encoder/, tokenizer/, vae/, scheduler/)")


def folder_adapter(folder: PretrainedFolder, vae_config, name: str = "transformer") -> ModelAdapter:
    """The transformer's adapter with the options its pipeline derives from the folder."""
    adapter = folder.adapter(name)
    if adapter.folder_options is not None:
        adapter = adapter.with_options(**adapter.folder_options(vae_config))
    return adapter
