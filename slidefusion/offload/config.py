"""The `offload:` section of a training config (see `slidefusion.training.config.TrainConfig`).

The user-facing form of `OffloadPolicy`: `slidefusion.offload.training` derives the typed policy
from it and the `optim:` section.
"""

from dataclasses import dataclass

from slidefusion.errors import check
from slidefusion.offload.planner import parse_bytes
from slidefusion.offload.policy import COMPUTE_DTYPES, MASTERS, MOMENTS, ROUNDINGS

DTYPES = COMPUTE_DTYPES


@dataclass
class OffloadConfig:
    """Train with `OffloadEngine`: weights and AdamW state in host memory, blocks streamed."""

    enabled: bool = False
    compute_dtype: str = "float32"  # the streamed copy; bfloat16 halves PCIe traffic on a GPU
    prefetch: int = 1  # blocks uploading ahead of the one computing
    checkpoint: bool = True  # recompute each block in backward (activation memory: block inputs only)
    master: str = "fp32"  # fp32 | bf16 (stochastic rounding): the weights AdamW updates, on the host
    moments: str = "fp32"  # fp32 | bf16 | int8 (blockwise, as in 8-bit Adam): AdamW's moments
    rounding: str = "stochastic"  # bf16 master: stochastic | kahan (+2 B/param of compensation)
    resident_blocks: int | str = 0  # N blocks kept on the device, or "auto": as many as fit
    pin_budget: str | None = None  # most page-locked host memory, e.g. 64GB (null: no limit)

    def __post_init__(self):
        check(self.compute_dtype in DTYPES, f"offload.compute_dtype={self.compute_dtype!r} is unknown; valid: {', '.join(DTYPES)}")
        check(self.prefetch >= 0, f"offload.prefetch={self.prefetch} must be >= 0")
        for key, valid in (("master", MASTERS), ("moments", MOMENTS), ("rounding", ROUNDINGS)):
            check(getattr(self, key) in valid, f"offload.{key}={getattr(self, key)!r} is unknown; valid: {', '.join(valid)}")
        check(self.resident_blocks == "auto" or (isinstance(self.resident_blocks, int) and self.resident_blocks >= 0),
              f"offload.resident_blocks={self.resident_blocks!r} must be an int >= 0 or auto")
        self.pin_budget_bytes  # noqa: B018 - validates the size

    @property
    def pin_budget_bytes(self) -> int | None:
        return None if self.pin_budget is None else parse_bytes(self.pin_budget, "offload.pin_budget")
