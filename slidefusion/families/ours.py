"""slidefusion's own DiT3D and STDiT, through the same records as the diffusers families.

Our models compute on the token grid (B, T, H, W, C) already: their blocks can run on a slab of it
(`grid_blocks`), the slide swap replaces their grid operators as modules (an empty `SwapRecord`), and
head-parallel attention reaches those operators directly.
"""

from __future__ import annotations

from types import MappingProxyType

from torch import Tensor

from slidefusion.attention import DenseAttention3d, GridAttention, NeighborhoodAttention3d, WindowAttention3d
from slidefusion.families.base import ModelAdapter
from slidefusion.families.records import GRID, AttentionAccess, BlockList, ModelAccess, Objective, SwapRecord


def _call_ours(adapter, model, x, t, text):
    return model(x, t, text.states, None if text.mask is None else text.mask.bool())


# ---------------------------------------------------------------- head-parallel attention
def _grid_project(m: GridAttention, x: Tensor, args=(), kwargs=None, span=None) -> Tensor:
    g, n, c = x.shape
    return m.qkv(x).view(g, n, 3, m.heads, c // m.heads)  # (G, n, 3, heads, D)


def _grid_access(dense: bool) -> AttentionAccess:
    return AttentionAccess(heads=lambda m: m.heads, project=_grid_project, attend=lambda m, q, k, v: m.attend(q, k, v),
                           output=lambda m, o: m.proj(o.flatten(-2)), dense=dense)


# Slide attention is absent on purpose: its offset network reads every head's channels at once, so
# it cannot run on a subset of heads, and head-parallel attention would change its result.
ATTENTION = MappingProxyType({DenseAttention3d: _grid_access(dense=True), WindowAttention3d: _grid_access(dense=False),
                              NeighborhoodAttention3d: _grid_access(dense=False)})

# Rectified flow as slidefusion.diffusion.flow defines it: flow time t in [0, 1], velocity noise - x0.
_FLOW = Objective("flow", "sigma", 1.0, "slidefusion.diffusion.sample", velocity="noise-x0")
_PATCH = ("patch_size.0", "patch_size.1", "patch_size.2")
_COMMON = dict(family="ours", call=_call_ours, patch=_PATCH, objective=_FLOW, text=None, grid_blocks=True,
               swap=SwapRecord(), attention=ATTENTION,
               parallel=ModelAccess(output="final", layout=GRID, batched=("x", "t", "context", "context_mask"),
                                    chained=True))

DIT3D = ModelAdapter(class_name="DiT3D", block_lists=(BlockList("blocks", "full", "attn"),), **_COMMON)

# Spatial and temporal blocks alternate in one list; each block carries its own `kind`. The
# self-attention is the grid operator inside the frame / time view (what the parallel plans wrap).
STDIT = ModelAdapter(class_name="STDiT", block_lists=(BlockList("blocks", None, "attn.inner"),), **_COMMON)

ADAPTERS = (DIT3D, STDIT)
