"""The `offload:` section of a training config (see `slidefusion.training.config.TrainConfig`)."""

from dataclasses import dataclass

import torch

from slidefusion.errors import check

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class OffloadConfig:
    """Train with `OffloadEngine`: weights and AdamW state in host memory, blocks streamed."""

    enabled: bool = False
    compute_dtype: str = "float32"  # the streamed copy; bfloat16 halves PCIe traffic on a GPU
    prefetch: int = 1  # blocks uploading ahead of the one computing
    checkpoint: bool = True  # recompute each block in backward (activation memory: block inputs only)

    def __post_init__(self):
        check(self.compute_dtype in DTYPES, f"offload.compute_dtype={self.compute_dtype!r} is unknown; valid: {', '.join(DTYPES)}")
        check(self.prefetch >= 0, f"offload.prefetch={self.prefetch} must be >= 0")
