"""Records for slidefusion's own DiT3D and STDiT, through the same interface as diffusers models."""

from __future__ import annotations

from slidefusion.adapters.base import ModelAdapter
from slidefusion.adapters.records import BlockList, Objective


def _call_ours(adapter, model, x, t, text):
    return model(x, t, text.states, None if text.mask is None else text.mask.bool())


# Rectified flow as slidefusion.diffusion.flow defines it: flow time t in [0, 1], velocity noise - x0.
_FLOW = Objective("flow", "sigma", 1.0, "slidefusion.diffusion.sample", velocity="noise-x0")
_PATCH = ("patch_size.0", "patch_size.1", "patch_size.2")

DIT3D = ModelAdapter(
    family="dit3d", class_name="DiT3D",
    block_lists=(BlockList("blocks", "full", "attn"),),
    call=_call_ours, patch=_PATCH, objective=_FLOW, text=None,
)

# Spatial and temporal blocks alternate in one list; each block carries its own `kind`. The
# self-attention is the grid operator inside the frame / time view (what the parallel plans wrap).
STDIT = ModelAdapter(
    family="stdit", class_name="STDiT",
    block_lists=(BlockList("blocks", None, "attn.inner"),),
    call=_call_ours, patch=_PATCH, objective=_FLOW, text=None,
)

OUR_ADAPTERS = (DIT3D, STDIT)
