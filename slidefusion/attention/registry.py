"""Self-attention operators chosen by name: the one list of attention kinds.

A model asks for its self-attention by name (`dense`, `window`, ...). Each entry is a factory
`factory(dim, heads, *, block_index, **options) -> nn.Module` whose module maps tokens on a 3D grid
(B, T, H, W, C) to (B, T, H, W, C), projections included. `block_index` lets an operator vary by
depth (Swin shifts its windows on odd blocks). New operators register themselves with
`@register_attention("name", ...)` in their own module; nothing else in the model changes.

Every other list of attention kinds derives from this one: what a pretrained model's
`model.attention` may name (`swappable`), and how the memory planner models each operator's
activations (`memory_model`; `FUSED` is the fused softmax attention of models we do not build,
such as the diffusers families' stock processors).
"""

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from slidefusion.core.errors import unknown_value

AttentionFactory = Callable[..., nn.Module]
FUSED = "flash"


@dataclass(frozen=True)
class AttentionKind:
    """name: what configs write; factory: builds the module; memory: the planner's activation model
    ("dense" | "window" | "slide"; None: not modelled); swap: a pretrained model's attention can be
    made this kind (`model.attention` of a fine-tune: dense keeps the stock attention)."""

    name: str
    factory: AttentionFactory
    memory: str | None = None
    swap: bool = False


_REGISTRY: dict[str, AttentionKind] = {}


def register_attention(name: str, *, memory: str | None = None, swap: bool = False,
                       ) -> Callable[[AttentionFactory], AttentionFactory]:
    """Decorator: make `factory` available to models as `attention=name` (see `AttentionKind`)."""

    def add(factory: AttentionFactory) -> AttentionFactory:
        if name in _REGISTRY:
            raise ValueError(f"attention {name!r} is already registered")
        _REGISTRY[name] = AttentionKind(name, factory, memory, swap)
        return factory

    return add


def available_attention() -> list[str]:
    """Names that `build_attention` accepts, sorted."""
    return sorted(_REGISTRY)


def swappable() -> tuple[str, ...]:
    """The kinds a pretrained model's self-attention can be made (`model.attention`), in registration order."""
    return tuple(k.name for k in _REGISTRY.values() if k.swap)


def memory_model(name: str) -> str | None:
    """How the memory planner models operator `name`'s activations, or None (not modelled)."""
    kind = _REGISTRY.get(name)
    return None if kind is None else kind.memory


def memory_models() -> tuple[str, ...]:
    """Every activation model the planner has: those of the registered kinds, then `FUSED`."""
    return tuple(dict.fromkeys([*(k.memory for k in _REGISTRY.values() if k.memory), FUSED]))


def build_attention(name: str, dim: int, heads: int, *, block_index: int = 0, **options) -> nn.Module:
    """Build the self-attention registered as `name` for a block at depth `block_index`."""
    if name not in _REGISTRY:
        raise unknown_value("attention", name, available_attention())
    return _REGISTRY[name].factory(dim, heads, block_index=block_index, **options)
