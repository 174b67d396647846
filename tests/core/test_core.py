"""The small facts of `slidefusion.core`: the unknown-value message, the token grid, the dtype table
and the native build rule."""

import pytest
import torch

from slidefusion.core import dtypes, grids, native
from slidefusion.core.errors import UserError, choose, unknown_value


def test_unknown_value_names_the_key_and_every_valid_choice():
    error = unknown_value("model.arch", "dit4d", ("dit3d", "stdit"))
    assert isinstance(error, UserError) and str(error) == "model.arch='dit4d' is unknown; valid: dit3d, stdit"
    assert choose("stdit", ("dit3d", "stdit"), "model.arch") == "stdit"
    with pytest.raises(UserError, match=r"^offsets='x' is unknown; valid: sample, shift, None$"):
        choose("x", ("sample", "shift", None), "offsets")


@pytest.mark.parametrize("latent, patch, grid", [((5, 8, 6), (1, 2, 2), (5, 4, 3)), ((2, 2, 2), (2, 2, 2), (1, 1, 1))])
def test_token_grid_is_the_quotient(latent, patch, grid):
    assert grids.token_grid(latent, patch) == grid


@pytest.mark.parametrize("latent, axis", [((4, 7, 6), "height=7"), ((1, 8, 6), "frames=1"), ((4, 8, 0), "width=0")])
def test_token_grid_refuses_what_the_patch_does_not_divide(latent, axis):
    with pytest.raises(UserError, match=f"latent {axis} must be a positive multiple of DiT3D's patch size"):
        grids.token_grid(latent, (2, 2, 2), "DiT3D")


def test_dtype_table_reads_both_spellings_and_names_the_key():
    assert dtypes.dtype_named("bf16") is dtypes.dtype_named("bfloat16") is torch.bfloat16
    assert dtypes.short_name(torch.float16) == "fp16" and dtypes.SAFETENSORS["BF16"] is torch.bfloat16
    with pytest.raises(UserError, match="^--dtype='int8' is unknown; valid: float32, bfloat16, float16$"):
        dtypes.dtype_named("int8", "--dtype")


def test_native_builds_are_named_by_the_cpu(monkeypatch):
    name = native.build_name("k", [b"int x;"], ["-O3"])
    assert name == native.build_name("k", [b"int x;"], ["-O3"]) != native.build_name("k", [b"int y;"], ["-O3"])
    native.cpu_identity.cache_clear()
    monkeypatch.setattr(native, "cpu_identity", lambda: "another CPU")
    assert native.build_name("k", [b"int x;"], ["-O3"]) != name  # -march=native: never shared across CPUs


def test_both_kernels_are_built_by_the_one_helper():
    from slidefusion.attention.backends import cpp
    from slidefusion.offload.optim import kernels

    assert "-march" not in " ".join(cpp.CFLAGS + kernels.FLAGS)  # the rule lives in core.native alone
    lib = kernels.load()
    assert lib is None or native.cache_folder() in __import__("pathlib").Path(lib._name).parents
