"""What the parallel engine knows about a model, read off its family record.

`record_for(model)` is the single place that finds a model's facts: `adapter_for(model)` (blocks in
call order, their kinds, the attention sites, the token grid of a call), restricted to the families
whose record has a parallel plan (`ModelAdapter.parallel`, a `ModelAccess`). Nothing else in
`slidefusion.parallel` looks at a model's class.

`ModelAccess` says what the blocks do not: which module is the token-wise output module whose output
is gathered, how a block's token tensor is laid out, which call arguments are per sample (CFG-parallel
halves them) or per token, which block arguments are per row, and whether the model hands each
block's output unchanged to the next. `AttentionAccess` (one per attention class, on the family that
ships it) says how to reach its q/k/v projection, operator and output projection - what head-parallel
attention needs.
"""

from torch import nn

from slidefusion.core.errors import UserError
from slidefusion.families import (
    AttentionAccess,
    AttentionSite,
    ModelAccess,
    ModelAdapter,
    adapter_for,
    adapters_with,
)

__all__ = ["AttentionAccess", "AttentionSite", "ModelAccess", "access_for", "model_access", "record_for"]


def _accesses() -> dict:
    """Every family's attention accesses: class (ours) or "module.ClassName" (diffusers, matched by
    name so that diffusers is imported only when a model uses it) -> AttentionAccess."""
    return {key: access for adapter in adapters_with("attention") for key, access in adapter.attention.items()}


def access_for(module: nn.Module) -> AttentionAccess:
    """The access record of `module`'s class (or a base class's), after its configuration check."""
    accesses = _accesses()
    for cls in type(module).__mro__:
        access = accesses.get(cls) or accesses.get(f"{cls.__module__}.{cls.__name__}")
        if access is not None:
            access.check(module)
            return access
    names = [key if isinstance(key, str) else key.__name__ for key in accesses]
    raise UserError(f"head-parallel attention (ulysses) cannot split {type(module).__name__} by heads; "
                    f"valid operators: {', '.join(n.rsplit('.', 1)[-1] for n in names)}")


def model_access(adapter: ModelAdapter) -> ModelAccess:
    return adapter.parallel


def record_for(model) -> ModelAdapter:
    """The adapter of `model`'s class if the parallel engine has a plan for it, else a UserError
    naming the supported classes."""
    try:
        adapter = adapter_for(model)
    except UserError:
        adapter = None
    if adapter is None or adapter.parallel is None:
        supported = ", ".join(a.class_name for a in adapters_with("parallel"))
        raise UserError(f"model class {type(model).__name__} has no parallel plan; supported: {supported}")
    return adapter
