"""The dtype table: every name a dtype goes by in slidefusion, in one place.

A dtype is written "bfloat16" in configs and flags (torch's own name), "bf16" in short labels and
the offload state choices, "BF16" in safetensors headers. Every table of dtypes in the package is a
view of `DTYPES`, and `dtype_named` reads any of the first two spellings.
"""

from dataclasses import dataclass

import torch

from slidefusion.core.errors import unknown_value


@dataclass(frozen=True)
class DType:
    """name: torch's name (configs, flags); short: the label; safetensors: the header code;
    floating: a compute dtype (weights, activations) rather than an integer storage type."""

    name: str
    short: str
    torch: torch.dtype
    safetensors: str
    floating: bool = True

    @property
    def bytes(self) -> int:
        return self.torch.itemsize


DTYPES: tuple[DType, ...] = (
    DType("float64", "fp64", torch.float64, "F64"),
    DType("float32", "fp32", torch.float32, "F32"),
    DType("bfloat16", "bf16", torch.bfloat16, "BF16"),
    DType("float16", "fp16", torch.float16, "F16"),
    DType("float8_e4m3fn", "fp8e4m3", torch.float8_e4m3fn, "F8_E4M3"),
    DType("float8_e5m2", "fp8e5m2", torch.float8_e5m2, "F8_E5M2"),
    DType("int64", "i64", torch.int64, "I64", floating=False),
    DType("int32", "i32", torch.int32, "I32", floating=False),
    DType("int16", "i16", torch.int16, "I16", floating=False),
    DType("int8", "i8", torch.int8, "I8", floating=False),
    DType("uint8", "u8", torch.uint8, "U8", floating=False),
    DType("bool", "bool", torch.bool, "BOOL", floating=False),
)
# The dtypes a model computes or is exported in (configs, --dtype flags), by torch's name.
COMPUTE = ("float32", "bfloat16", "float16")
SAFETENSORS: dict[str, torch.dtype] = {d.safetensors: d.torch for d in DTYPES}
SHORT: dict[torch.dtype, str] = {d.torch: d.short for d in DTYPES}


def dtype_named(name: str, key: str = "dtype", allowed: tuple[str, ...] = COMPUTE) -> torch.dtype:
    """The torch dtype called `name` ("bfloat16" or "bf16"), one of `allowed` (torch names); else
    the one-line unknown-value error naming `key`."""
    for entry in DTYPES:
        if entry.name in allowed and name in (entry.name, entry.short):
            return entry.torch
    raise unknown_value(key, name, allowed)


def short_name(dtype: torch.dtype) -> str:
    """"bf16" for torch.bfloat16, and so on."""
    return SHORT[dtype]


__all__ = ["COMPUTE", "DTYPES", "DType", "SAFETENSORS", "SHORT", "dtype_named", "short_name"]
