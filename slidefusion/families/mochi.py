"""Mochi (diffusers' MochiTransformer3DModel): everything slidefusion knows about it.

The call reproduces what MochiPipeline passes the transformer (inverted sigmas: the model sees
(1 - sigma) * 1000 and predicts x0 - noise); how its pipeline encodes prompts (T5 states and mask) and
sets its linear-quadratic timesteps; its joint attention puts the text tokens last.
"""

from __future__ import annotations

import numpy as np

from slidefusion.families.base import ModelAdapter
from slidefusion.families.records import BlockList, Objective, SwapRecord, TextSpec
from slidefusion.families.shared import ONE_T5, encode_with_mask

def _call_mochi(adapter, model, x, t, text):
    return model(hidden_states=x, encoder_hidden_states=text.states, timestep=t,
                 encoder_attention_mask=text.bool_mask(), return_dict=False)[0]


def _timesteps(scheduler, steps: int, shape: tuple[int, ...]) -> None:
    """MochiPipeline: its linear-quadratic sigmas; the begin index is set, as its inverted timesteps
    are not searched for."""
    from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

    scheduler.set_timesteps(sigmas=np.array(linear_quadratic_schedule(steps, 0.025)))
    scheduler.set_begin_index(0)


MOCHI = ModelAdapter(
    family="mochi", class_name="MochiTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "full", "attn1", joint=True),),
    call=_call_mochi, patch=(1, "patch_size", "patch_size"),
    # Mochi's scheduler inverts the sigmas: the model sees (1 - sigma) * 1000 and predicts x0 - noise.
    objective=Objective("flow", "1-sigma", 1000.0, "FlowMatchEulerDiscreteScheduler", velocity="x0-noise"),
    text=TextSpec(**ONE_T5, max_length=256, padding="encoder"),
    pipelines=("MochiPipeline",), text_dim="text_embed_dim", timesteps=_timesteps, encode=encode_with_mask, fps=30,
    swap=SwapRecord(("MochiAttnProcessor2_0",), text="last"),
)

ADAPTERS = (MOCHI,)
