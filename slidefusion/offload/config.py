"""The `offload:` section of a training config (see `slidefusion.training.config.TrainConfig`).

The user-facing form of `OffloadPolicy`: `slidefusion.offload.training` derives the typed policy
from it and the `optim:` section.
"""

from dataclasses import dataclass

from slidefusion.errors import check
from slidefusion.offload.planner import parse_bytes
from slidefusion.offload.policy import COMPUTE_DTYPES, MASTERS, MOMENTS, ROUNDINGS

DTYPES = COMPUTE_DTYPES


def _is_count(value) -> bool:
    """An int >= 1 (YAML's true and false are bools, which Python counts as ints)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


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
    tile: int | str | bool = "off"  # frames of the token grid per tile inside a block: N, auto or off
    spill_dir: str | None = None  # a folder on a local disk for the checkpoints past spill_after
    spill_after: int | str = 0  # checkpoint bytes kept in host memory before spilling, e.g. 64GB (0: spill all)
    overlap: bool | str = "auto"  # AdamW on a thread beside the compute: auto (yes, except on a CPU device), true, false
    optimizer_threads: int | str = "auto"  # threads of the host AdamW: auto (half the cores with a GPU) or N >= 1

    def __post_init__(self):
        check(self.compute_dtype in DTYPES, f"offload.compute_dtype={self.compute_dtype!r} is unknown; valid: {', '.join(DTYPES)}")
        check(self.prefetch >= 0, f"offload.prefetch={self.prefetch} must be >= 0")
        for key, valid in (("master", MASTERS), ("moments", MOMENTS), ("rounding", ROUNDINGS)):
            check(getattr(self, key) in valid, f"offload.{key}={getattr(self, key)!r} is unknown; valid: {', '.join(valid)}")
        check(self.resident_blocks == "auto" or (isinstance(self.resident_blocks, int) and self.resident_blocks >= 0),
              f"offload.resident_blocks={self.resident_blocks!r} must be an int >= 0 or auto")
        self.pin_budget_bytes  # noqa: B018 - validates the size
        if self.tile is False:  # YAML reads a bare `off` as false
            self.tile = "off"
        check(self.tile in ("auto", "off") or _is_count(self.tile),
              f"offload.tile={self.tile!r} must be auto, off or a number of frames >= 1")
        check(self.spill_dir is None or bool(str(self.spill_dir).strip()), f"offload.spill_dir={self.spill_dir!r} must name a folder")
        check(self.spill_dir is not None or self.spill_after in (0, "0"), "offload.spill_after needs offload.spill_dir")
        check((self.tile == "off" and self.spill_dir is None) or self.checkpoint,
              "offload.tile and offload.spill_dir need offload.checkpoint=true (they work on recomputed blocks)")
        self.spill_after_bytes  # noqa: B018 - validates the size
        check(self.overlap in ("auto", True, False), f"offload.overlap={self.overlap!r} must be auto, true or false")
        check(self.optimizer_threads == "auto" or _is_count(self.optimizer_threads),
              f"offload.optimizer_threads={self.optimizer_threads!r} must be auto or an int >= 1")

    @property
    def spill_after_bytes(self) -> int:
        return _config_bytes("spill_after", self.spill_after)

    @property
    def pin_budget_bytes(self) -> int | None:
        return None if self.pin_budget is None else _config_bytes("pin_budget", self.pin_budget)


def _config_bytes(key: str, value) -> int:
    """A size a user wrote (YAML or key=value): 0, or a number with its unit (64GB). A bare number is
    refused as on the command line; YAML reads `64` as an int, so ints other than 0 are too."""
    if value in (0, "0") and not isinstance(value, bool):
        return 0
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        check(False, f"offload.{key}={value!r} has no unit; write e.g. {value}GB (units: B, KB, MB, GB, TB or "
                     "KiB, MiB, GiB, TiB), or 0")
    return parse_bytes(str(value), f"offload.{key}")
