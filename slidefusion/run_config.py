"""`SamplingConfig`: the sections of a run's config that say what to sample, read by the pipelines
from a checkpoint's config.json without the training sections (optimizer, run, offload engine).

    model:            one of our presets (ModelConfig) or model.pretrained=DIR (a diffusers folder)
    lora:             LoRA adapters on a folder's transformer (rank null: none)
    data:             the video size in pixels and its frame rate (the clip length trained on)
    text_encoder, text_max_length, autoencoder   for our own models; a folder brings its own

`slidefusion.training.config.TrainConfig` extends it with the sections of training.
"""

from dataclasses import dataclass, field

from slidefusion.data.config import DataConfig
from slidefusion.errors import UserError, check
from slidefusion.io.config import build, config_keys, plain
from slidefusion.models.config import ModelConfig, preset
from slidefusion.pretrained.config import LoraConfig, PretrainedModelConfig, model_section


@dataclass
class SamplingConfig:
    """What a checkpoint holds a model of; see the module docstring."""

    model: ModelConfig | PretrainedModelConfig = field(default_factory=lambda: preset("dit3d-tiny"),
                                                       metadata={"parse": model_section})
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    text_encoder: str = "minilm"
    text_max_length: int = 32
    autoencoder: str = "identity"

    def __post_init__(self):
        check(self.pretrained or not self.lora.enabled,
              f"lora.rank={self.lora.rank} applies to diffusers folders only; add model.pretrained=DIR, "
              "or set lora.rank=null")

    @property
    def pretrained(self) -> bool:
        """A fine-tune of a diffusers folder (`model.pretrained=DIR`)."""
        return isinstance(self.model, PretrainedModelConfig)

    def to_dict(self) -> dict:
        """The config as plain data (what config.json holds and `build` reads back)."""
        return plain(self)

    @classmethod
    def of_checkpoint(cls, ckpt) -> "SamplingConfig":
        """The sections of a checkpoint's config.json this class has (`ckpt`: an `io.checkpoint.Checkpoint`)."""
        keys = config_keys(cls)
        try:
            return build(cls, {k: v for k, v in ckpt.config.items() if k in keys})
        except UserError as error:
            raise UserError(f"checkpoint {ckpt.path}: config.json: {error}") from None
