"""Self-attention operators chosen by name.

A model asks for its self-attention by name (`dense`, `window`, ...). Each entry is a factory
`factory(dim, heads, *, block_index, **options) -> nn.Module` whose module maps tokens on a 3D grid
(B, T, H, W, C) to (B, T, H, W, C), projections included. `block_index` lets an operator vary by
depth (Swin shifts its windows on odd blocks). New operators register themselves with
`@register_attention("name")` in their own module; nothing else in the model changes.
"""

from collections.abc import Callable

from torch import nn

from slidefusion.errors import UserError

AttentionFactory = Callable[..., nn.Module]
_REGISTRY: dict[str, AttentionFactory] = {}


def register_attention(name: str) -> Callable[[AttentionFactory], AttentionFactory]:
    """Decorator: make `factory` available to models as `attention=name`."""

    def add(factory: AttentionFactory) -> AttentionFactory:
        if name in _REGISTRY:
            raise ValueError(f"attention {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return add


def available_attention() -> list[str]:
    """Names that `build_attention` accepts, sorted."""
    return sorted(_REGISTRY)


def build_attention(name: str, dim: int, heads: int, *, block_index: int = 0, **options) -> nn.Module:
    """Build the self-attention registered as `name` for a block at depth `block_index`."""
    if name not in _REGISTRY:
        raise UserError(f"attention={name!r} is unknown; valid: {', '.join(available_attention())}")
    return _REGISTRY[name](dim, heads, block_index=block_index, **options)
