"""The engine behind the trainer's optimizer seam (`Trainer` with `offload.enabled`)."""

from torch import nn

from slidefusion.adapters import adapter_for
from slidefusion.offload.config import DTYPES
from slidefusion.offload.engine import OffloadEngine
from slidefusion.offload.planner import Workload, activation_parts


def offload_optimizer(model: nn.Module, config, tokens: int) -> OffloadEngine:
    """An `OffloadEngine` for a `TrainConfig`; `tokens` per sample size the fit check."""
    off, optim, run = config.offload, config.optim, config.run
    dtype = DTYPES[off.compute_dtype]
    work = Workload(batch=run.batch_size, tokens=tokens, attention=_attention_kind(config.model.attention))
    activations = sum(activation_parts(config.model, work, 4 if off.compute_dtype == "float32" else 2).values())
    return OffloadEngine(model, engine_blocks(model), device=run.device, compute_dtype=dtype, lr=optim.lr, betas=optim.betas,
                         eps=optim.eps, weight_decay=optim.weight_decay, max_grad_norm=optim.max_grad_norm,
                         prefetch=off.prefetch, checkpoint=off.checkpoint, activation_bytes=activations)


def engine_blocks(model: nn.Module) -> nn.ModuleList:
    """The blocks the engine streams, in call order, whatever the model class (its groups follow them)."""
    return nn.ModuleList(adapter_for(model).blocks(model))


def _attention_kind(name: str) -> str:
    return name if name in ("dense", "window", "slide") else "dense"  # unknown operators: the worst case
