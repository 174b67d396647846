"""Mochi (diffusers' MochiTransformer3DModel): everything slidefusion knows about it.

The call reproduces what MochiPipeline passes the transformer (inverted sigmas: the model sees
(1 - sigma) * 1000 and predicts x0 - noise); how its pipeline encodes prompts (T5 states and mask) and
sets its linear-quadratic timesteps; its joint attention puts the text tokens last.
"""

from __future__ import annotations

import numpy as np

from slidefusion.families.base import ModelAdapter
from slidefusion.families.records import BlockList, Objective, SwapRecord, TextSpec
from slidefusion.families.shared import ONE_T5, batched_pair, encode_with_mask, pipeline_for, pixels, run_pipeline

def _call_mochi(adapter, model, x, t, text):
    return model(hidden_states=x, encoder_hidden_states=text.states, timestep=t,
                 encoder_attention_mask=text.bool_mask(), return_dict=False)[0]


def _timesteps(scheduler, steps: int, shape: tuple[int, ...]) -> None:
    """MochiPipeline: its linear-quadratic sigmas; the begin index is set, as its inverted timesteps
    are not searched for."""
    from diffusers.pipelines.mochi.pipeline_mochi import linear_quadratic_schedule

    scheduler.set_timesteps(sigmas=np.array(linear_quadratic_schedule(steps, 0.025)))
    scheduler.set_begin_index(0)


def _sample(parts, noise, cond, uncond, steps: int, guidance: float, progress: bool, cfg_batch: bool = False):
    """MochiPipeline's own loop: both prompts in one batch [uncond, cond], the guidance in float32."""
    pipe = pipeline_for(parts, noise)
    if pipe is None or not batched_pair(cond, uncond):
        return None
    sizes = pixels(pipe, noise.shape[2:], "vae_temporal_scale_factor", "vae_spatial_scale_factor")
    texts = dict(prompt_embeds=cond.states, prompt_attention_mask=cond.bool_mask())
    if uncond is not None:
        texts.update(negative_prompt_embeds=uncond.states, negative_prompt_attention_mask=uncond.bool_mask())
    return run_pipeline(pipe, noise, steps, guidance if uncond is not None else 1.0, progress, **sizes, **texts)


MOCHI = ModelAdapter(
    family="mochi", class_name="MochiTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "full", "attn1", joint=True),),
    call=_call_mochi, patch=(1, "patch_size", "patch_size"),
    # Mochi's scheduler inverts the sigmas: the model sees (1 - sigma) * 1000 and predicts x0 - noise.
    objective=Objective("flow", "1-sigma", 1000.0, "FlowMatchEulerDiscreteScheduler", velocity="x0-noise"),
    text=TextSpec(**ONE_T5, max_length=256, padding="encoder"),
    pipelines=("MochiPipeline",), text_dim="text_embed_dim", timesteps=_timesteps, encode=encode_with_mask,
    sample=_sample, fps=30,
    swap=SwapRecord(("MochiAttnProcessor2_0",), text="last"),
)

ADAPTERS = (MOCHI,)
