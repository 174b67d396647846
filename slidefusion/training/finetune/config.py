"""The config sections of a fine-tune of a diffusers folder: `model.pretrained=DIR` and `lora:`.

    model:
      pretrained: Wan2.1-T2V-1.3B-Diffusers   # a local diffusers pipeline folder
      expert: transformer                      # Wan 2.2 A14B: transformer (high noise) or transformer_2
    lora:
      rank: 16                                 # null: full fine-tune
      alpha: 16                                # default: the rank
      target_modules: [to_q, to_k, to_v, to_out.0]   # default: the family's attention projections
"""

from __future__ import annotations

from dataclasses import dataclass

from slidefusion import validate
from slidefusion.errors import check

EXPERTS = ("transformer", "transformer_2")


@dataclass
class PretrainedModelConfig:
    """The transformer of a local diffusers pipeline folder; its config.json defines the model."""

    pretrained: str
    expert: str = "transformer"

    def __post_init__(self):
        check(isinstance(self.pretrained, str) and self.pretrained.strip() != "",
              f"model.pretrained={self.pretrained!r} must name a local diffusers pipeline folder")
        check(self.expert in EXPERTS, f"model.expert={self.expert!r} is unknown; valid: {', '.join(EXPERTS)}")


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the transformer; the base weights stay frozen. `rank: null` trains
    every weight instead."""

    rank: int | None = None
    alpha: float | None = None
    target_modules: list[str] | None = None

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

    @property
    def enabled(self) -> bool:
        return self.rank is not None

    @property
    def scale_alpha(self) -> float:
        return float(self.rank if self.alpha is None else self.alpha)
