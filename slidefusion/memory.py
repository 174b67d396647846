"""Up-front memory estimates: refuse work that cannot fit, in one line, before allocating any of it.

A 65536x65536 video or a 105 B-parameter model on a laptop should fail at once with what it would
take, not minutes later inside an allocator. The estimates count what is known from the config:
latents and decoded pixels, parameter bytes (plus gradients and AdamW state when training), the
activations a block holds and the attention working set of the operators the planner models
(dense, window, slide; others are left out rather than guessed). They are estimates, so the check
only refuses work that needs more than the memory available right now.
"""

import math

import torch

from slidefusion.attention import memory_model
from slidefusion.core import grids
from slidefusion.core.errors import UserError
from slidefusion.models import ModelConfig, build_model
from slidefusion.models.dit import ARCHITECTURES
from slidefusion.offload.plan.plan import available_host_memory, human
from slidefusion.offload.tiling.activations import WORKING_VALUES_PER_TOKEN, Workload, attention_workspace

FP32 = 4


def parameter_count(config: ModelConfig) -> int:
    """Parameters of the model `config` describes, counted on the meta device (nothing allocated)."""
    return sum(p.numel() for p in build_model(config, "meta").parameters())


def token_grid(config: ModelConfig, latent: tuple[int, int, int, int]) -> tuple[int, int, int]:
    """(T', H', W') tokens for a latent (C, T, H, W), by the one rule (`core.grids`)."""
    return grids.token_grid(latent[1:], config.patch_size, ARCHITECTURES[config.arch].__name__)


def attention_bytes(config: ModelConfig, batch: int, grid: tuple[int, int, int], value_bytes: int = FP32) -> int:
    """The largest self-attention working set of one block (0 for operators not modelled)."""
    t, h, w = grid
    if config.arch == "stdit":  # inside each frame, then through time at each position (always dense)
        calls = [(batch * t, h * w, config.attention), (batch * h * w, t, "dense")]
    else:
        calls = [(batch, t * h * w, config.attention)]
    sizes = [attention_workspace(Workload(b, n, memory_model(kind)), config.heads, config.hidden, value_bytes)[0]
             for b, n, kind in calls if memory_model(kind) is not None]
    return max(sizes, default=0)


def sampling_parts(config: ModelConfig, latent: tuple[int, int, int, int], pixels: tuple[int, int, int],
                   batch: int = 1, params: int | None = None) -> dict[str, int]:
    """Bytes of sampling `batch` videos of `pixels` (T, H, W) from latents (C, T', H', W') with CFG."""
    grid = token_grid(config, latent)
    tokens = 2 * batch * math.prod(grid)  # conditional and unconditional halves together
    return {
        "latents": 4 * 2 * batch * math.prod(latent) * FP32,  # x, noise, both velocity halves
        "weights": (parameter_count(config) if params is None else params) * FP32,
        "block activations": int(tokens * config.hidden * (6 + config.mlp_ratio) * FP32),
        "attention": attention_bytes(config, 2 * batch, grid),
        "decoded video": batch * 3 * math.prod(pixels) * (FP32 + 1),  # float frames and their uint8 copy
    }


def training_parts(config: ModelConfig, latent: tuple[int, int, int, int], pixels: tuple[int, int, int],
                   batch: int, ema: bool, offload: bool = False) -> dict[str, int]:
    """Bytes of one training step: weights, gradients, AdamW moments (and EMA), the clips, and every
    block's activations kept for backward. With `offload` only what the engine's own fit check
    leaves out: the clips and one block's working set (it recomputes blocks one at a time)."""
    grid = token_grid(config, latent)
    tokens = batch * math.prod(grid)
    blocks = 1 if offload else config.depth * (2 if config.arch == "stdit" else 1)
    per_block = tokens * config.hidden * (WORKING_VALUES_PER_TOKEN + 3 * config.mlp_ratio) * FP32
    parts = {
        "clips and latents": batch * (3 * math.prod(pixels) + 3 * math.prod(latent)) * FP32,
        "block activations": int(blocks * per_block),
        "attention": blocks * attention_bytes(config, batch, grid),
    }
    if not offload:
        kinds = "weights, gradients, AdamW" + (", EMA" if ema else "")
        parts[kinds] = parameter_count(config) * FP32 * (5 if ema else 4)
    return parts


def available_bytes(device: torch.device) -> int | None:
    """Free memory where tensors on `device` live (host MemAvailable for the CPU), None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        return available_host_memory()
    return None


def check_fits(parts: dict[str, int], device: torch.device, what: str, hint: str) -> None:
    """UserError in one line if `parts` (bytes by kind) exceed the memory available on `device`."""
    available = available_bytes(torch.device(device))
    total = sum(parts.values())
    if available is None or total <= available:
        return
    largest = sorted(parts, key=parts.get, reverse=True)[:3]
    detail = ", ".join(f"{name} {human(parts[name])}" for name in largest)
    raise UserError(f"{what} needs about {human(total)} ({detail}) but {device} has {human(available)} available; "
                    f"{hint}")
