"""Self-attention on 3D token grids: functional ops, thin modules, and the by-name registry.

Importing this package registers the built-in operators (`dense`, `window`, `neighborhood`, `slide`).
"""

from slidefusion.attention.functional import (
    dense_attention,
    effective_kernel,
    joint_attention,
    neighborhood_attention,
    slide_attention,
    window_attention,
)
from slidefusion.attention.joint import merge_attention
from slidefusion.attention.modules import (
    DenseAttention3d,
    GridAttention,
    NeighborhoodAttention3d,
    OffsetNet,
    SlideAttention3d,
    WindowAttention3d,
)
from slidefusion.attention.registry import (
    FUSED,
    AttentionKind,
    available_attention,
    build_attention,
    memory_model,
    memory_models,
    register_attention,
    swappable,
)

__all__ = [
    "FUSED",
    "AttentionKind",
    "DenseAttention3d",
    "GridAttention",
    "NeighborhoodAttention3d",
    "OffsetNet",
    "SlideAttention3d",
    "WindowAttention3d",
    "available_attention",
    "build_attention",
    "dense_attention",
    "effective_kernel",
    "joint_attention",
    "memory_model",
    "memory_models",
    "merge_attention",
    "neighborhood_attention",
    "register_attention",
    "slide_attention",
    "swappable",
    "window_attention",
]
