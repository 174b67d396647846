"""The `model:` section of a run (one of our presets, or `model.pretrained=DIR`) and `lora:`.

    model:
      pretrained: Wan2.1-T2V-1.3B-Diffusers   # a local diffusers pipeline folder
      expert: transformer                      # Wan 2.2 A14B: transformer (high noise) or transformer_2
      transformer: wan2.1_t2v_1.3B_bf16.safetensors   # optional: that expert's weights from one file
                                               # (Wan's original layout, as ComfyUI ships it, or diffusers')
      attention: slide                         # dense (stock) | slide | neighborhood: adapt to slide attention
      attention_options: {kernel_size: [3, 7, 7], offsets: sample}   # see slidefusion.swap.SlideOptions
    lora:
      rank: 16                                 # null: full fine-tune
      alpha: 16                                # default: the rank
      target_modules: [to_q, to_k, to_v, to_out.0]   # default: the family's attention projections
      base_dtype: float8_e4m3fn                # with --offload: the frozen base on the host as fp8 codes
      base_scales: channel                     # fp8 scales per output channel (or per tensor)
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

from slidefusion.core import validate
from slidefusion.core.errors import UserError, check, choose
from slidefusion.io.config import build
from slidefusion.models.config import ModelConfig, preset
from slidefusion.swap.config import configured_options

EXPERTS = ("transformer", "transformer_2")


@dataclass
class PretrainedModelConfig:
    """The transformer of a local diffusers pipeline folder; its config.json defines the model."""

    pretrained: str
    expert: str = "transformer"
    # A single-file transformer whose weights replace the expert's own (the folder's config.json still
    # defines the model; text encoders, VAE and scheduler come from the folder).
    transformer: str | None = None
    # The video self-attention: "dense" keeps the stock processors; "slide" / "neighborhood" swap
    # them (`use_slide_attention`) with these options, offset networks starting at zero.
    attention: str = "dense"
    attention_options: dict = field(default_factory=dict)

    def __post_init__(self):
        check(isinstance(self.pretrained, str) and self.pretrained.strip() != "",
              f"model.pretrained={self.pretrained!r} must name a local diffusers pipeline folder")
        # absolute, so the run's config.json (which generate, export and --resume read) names the same
        # folder from any working directory
        self.pretrained = os.path.abspath(os.path.expanduser(self.pretrained))
        if self.transformer is not None:
            check(isinstance(self.transformer, str) and self.transformer.strip() != "",
                  f"model.transformer={self.transformer!r} must name a .safetensors transformer file")
            self.transformer = os.path.abspath(os.path.expanduser(self.transformer))
        check(self.expert in EXPERTS, f"model.expert={self.expert!r} is unknown; valid: {', '.join(EXPERTS)}")
        configured_options(self.attention, self.attention_options)  # bad options fail when the config is built

    @property
    def slide(self):
        """The `SlideOptions` of a swapped attention, or None for the stock (dense) one."""
        return configured_options(self.attention, self.attention_options)


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the transformer; the base weights stay frozen. `rank: null` trains
    every weight instead."""

    rank: int | None = None
    alpha: float | None = None
    target_modules: list[str] | None = None
    # The frozen base weights with --offload: null keeps them in offload.compute_dtype; an fp8 dtype
    # stores and streams them as 1-byte codes with float32 scales, dequantised per block on the device.
    base_dtype: str | None = None
    base_scales: str = "channel"  # "channel" (one scale per output row) or "tensor"

    def __post_init__(self):
        if self.rank is not None:
            check(isinstance(self.rank, int) and not isinstance(self.rank, bool) and 1 <= self.rank <= 65536,
                  f"lora.rank={self.rank!r} must be a positive int (e.g. 16), or null for a full fine-tune")
        if self.alpha is not None:
            validate.finite(self.alpha, "lora.alpha", 0, low_open=True)
        if self.target_modules is not None:
            self.target_modules = list(self.target_modules)
            check(len(self.target_modules) > 0 and all(isinstance(m, str) and m.strip() for m in self.target_modules),
                  f"lora.target_modules={self.target_modules!r} must be a non-empty list of module names, "
                  "e.g. [to_q, to_k, to_v, to_out.0]")
        from slidefusion.offload.engine.fp8 import FP8_DTYPES, SCALES

        choose(self.base_dtype, (None, *FP8_DTYPES), "lora.base_dtype")  # None: the compute dtype
        choose(self.base_scales, SCALES, "lora.base_scales")
        check(self.base_dtype is None or self.enabled,
              f"lora.base_dtype={self.base_dtype} stores a LoRA run's frozen base; set lora.rank (e.g. 16) too")

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def base_torch_dtype(self):
        """The torch dtype of `base_dtype`, or None."""
        from slidefusion.offload.engine.fp8 import FP8_DTYPES

        return None if self.base_dtype is None else FP8_DTYPES[self.base_dtype]

    @property
    def scale_alpha(self) -> float:
        return float(self.rank if self.alpha is None else self.alpha)


def model_section(data: dict, key: str) -> ModelConfig | PretrainedModelConfig:
    """A `model:` section: an optional `preset` name, then any ModelConfig fields on top; or
    `pretrained: DIR` (a diffusers folder, whose config.json defines the model)."""
    if not isinstance(data, dict):
        raise UserError(f"{key}={data!r} must be a section (a mapping), e.g. {key}.preset=dit3d-tiny")
    if "pretrained" in data:
        valid = [f.name for f in dataclasses.fields(PretrainedModelConfig)]
        other = [k for k in data if k not in valid]
        if other:
            raise UserError(f"{key}.{other[0]} cannot be combined with {key}.pretrained (the folder's config.json "
                            f"defines the model); valid keys with {key}.pretrained: {', '.join(valid)}")
        return build(PretrainedModelConfig, data, key)
    data = dict(data)
    name = data.pop("preset", None)
    if name is not None and not isinstance(name, str):
        raise UserError(f"{key}.preset={name!r} must be a preset name, e.g. dit3d-tiny")
    base = dataclasses.asdict(preset(name)) if name is not None else {}
    return build(ModelConfig, {**base, **data}, key)
