"""Kept for imports written before `slidefusion.core`: the same functions as `slidefusion.core.validate`."""

from slidefusion.core.validate import (  # noqa: F401
    INT_MAX,
    SEED_MAX,
    SIZE_UNITS,
    byte_size,
    device,
    finite,
    in_interval,
    integer,
    interval,
    output_path,
    seed,
)
