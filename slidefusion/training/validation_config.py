"""The `validate:` section of a training config: sample videos and a held-out loss during training.

    validate:
      prompts: [a red fox running through snow, a city street at night]   # or a file: one prompt a line
      every: 250                  # steps between validations (and at the last step)
      frames: 33                  # the sample size (default: data.frames / height / width)
      height: 480
      width: 832
      steps: 30                   # sampling steps of the folder's scheduler
      guidance: 5.0
      seed: 0                     # prompt i starts from the noise of seed + i
      data: [{root: held-out/}]   # optional: a held-out loss at fixed timesteps and noise

Samples go to RUN/samples/step-N/ (one .mp4 per prompt) and to TensorBoard / W&B when those are on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from slidefusion.core import validate
from slidefusion.data.sources import SourceConfig
from slidefusion.core.errors import UserError, check


@dataclass
class ValidateConfig:
    prompts: list[str] | str | None = None  # a list, or a text file of one prompt per line
    every: int = 500
    frames: int | None = None
    height: int | None = None
    width: int | None = None
    steps: int = 30
    guidance: float = 5.0
    seed: int = 0
    data: list[SourceConfig] | None = None  # held-out sources, scanned as data.datasets

    def __post_init__(self):
        check(self.every >= 1, f"validate.every={self.every} must be >= 1 (steps between validations)")
        for name in ("frames", "height", "width"):
            value = getattr(self, name)
            check(value is None or value >= 1, f"validate.{name}={value} must be >= 1 or null")
        check(1 <= self.steps <= 10_000, f"validate.steps={self.steps} must be in 1..10000")
        validate.finite(self.guidance, "validate.guidance", 0, 100)
        validate.seed(self.seed, "validate.seed")
        if isinstance(self.prompts, list):
            check(all(isinstance(p, str) and p.strip() for p in self.prompts) and self.prompts,
                  "validate.prompts must be a non-empty list of non-empty prompts, or a file of one prompt per line")
        elif isinstance(self.prompts, str):
            path = Path(self.prompts).expanduser()
            check(path.is_file(), f"validate.prompts={self.prompts!r}: no such file (give a list of prompts, or a "
                                  "text file of one prompt per line)")
        if self.data is not None:
            check(len(self.data) > 0, "validate.data=[] is empty; list held-out sources or set it to null")
            for index, source in enumerate(self.data):
                source.check(f"validate.data[{index}]")

    @property
    def enabled(self) -> bool:
        return self.prompts is not None or self.data is not None

    def prompt_list(self) -> list[str]:
        """The prompts (a file's non-empty lines), or [] when none are set."""
        if self.prompts is None:
            return []
        if isinstance(self.prompts, list):
            return [p.strip() for p in self.prompts]
        path = Path(self.prompts).expanduser()
        try:
            lines = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"validate.prompts={self.prompts!r} cannot be read as UTF-8 text: {error}") from None
        prompts = [line for line in lines if line]
        check(prompts, f"validate.prompts={self.prompts!r} holds no prompt (one per line)")
        return prompts
