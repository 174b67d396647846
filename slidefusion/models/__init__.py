"""Plain nn.Module video DiTs built from `ModelConfig`; see `PRESETS`."""

from slidefusion.models.config import PRESETS, ModelConfig, preset
from slidefusion.models.dit import DiT3D, STDiT, VideoDiT, build_model

__all__ = ["PRESETS", "ModelConfig", "preset", "DiT3D", "STDiT", "VideoDiT", "build_model"]
