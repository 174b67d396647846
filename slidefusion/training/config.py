"""Training configuration: typed dataclasses, filled from YAML and `section.key=value` overrides.

Every key is checked (`slidefusion.io.config.build`): an unknown one, or a value of the wrong type,
is a `UserError` that names the dotted key and what would be valid.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

from slidefusion import validate
from slidefusion.data.config import DataConfig  # noqa: F401  (re-exported: a config section)
from slidefusion.diffusion.flow import FlowConfig
from slidefusion.errors import check
from slidefusion.io.config import build, read_yaml
from slidefusion.offload.policy import OffloadPolicy
from slidefusion.optim import OptimConfig  # noqa: F401  (re-exported: a config section)
from slidefusion.run_config import SamplingConfig

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a plain folder name: no path, not . or ..
RUN_SEED_MAX = 2**32 - 1  # step seeds are seed * 1_000_003 + step, which must stay below 2**64


@dataclass
class RunConfig:
    """Length of the run, batch, logging and checkpoints (runs/NAME/checkpoint-STEP/)."""

    name: str = "run"
    output_dir: str = "runs"
    steps: int = 1000
    batch_size: int = 8
    seed: int = 0
    log_every: int = 10
    save_every: int = 500
    keep_last: int | None = 3  # older checkpoints are deleted; null keeps all
    device: str = "cpu"
    tensorboard: bool = False

    def __post_init__(self):
        for name in ("steps", "batch_size", "log_every", "save_every"):
            value = getattr(self, name)
            check(value >= 1, f"run.{name}={value} must be >= 1")
        check(self.keep_last is None or self.keep_last >= 1, f"run.keep_last={self.keep_last} must be >= 1 or null")
        check(isinstance(self.name, str) and RUN_NAME.match(self.name) is not None and len(self.name) <= 200,
              f"run.name={self.name!r} must be a plain folder name: letters, digits, '.', '_' or '-', "
              "starting with a letter or digit")
        check(bool(str(self.output_dir).strip()), f"run.output_dir={self.output_dir!r} must name a folder")
        check(bool(str(self.device).strip()), f"run.device={self.device!r} must name a device, e.g. cpu or cuda")
        validate.integer(self.seed, "run.seed", 0, RUN_SEED_MAX)
        check(self.steps <= 2**62, f"run.steps={self.steps} must be <= 2**62")


@dataclass
class TrainConfig(SamplingConfig):
    """A training run: what it trains (`SamplingConfig`'s sections: the model, LoRA, the video, text
    encoder and autoencoder) and how (the objective, the optimizer, the run, the offload engine)."""

    diffusion: FlowConfig = field(default_factory=FlowConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)  # `enabled` (--offload) trains with the engine


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config (or the defaults when `path` is None), apply overrides, validate."""
    return build(TrainConfig, read_yaml(path, overrides))
