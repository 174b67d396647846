"""HunyuanVideo (diffusers' HunyuanVideoTransformer3DModel): everything slidefusion knows about it.

The call reproduces what HunyuanVideoPipeline passes the transformer (a prefix text mask, CLIP's pooled
embedding, guidance embedded as an input of the distilled model); how its pipeline encodes prompts and
sets its timesteps; its joint attention puts the text tokens last (what the slide swap needs).
"""

from __future__ import annotations

from types import MappingProxyType

import numpy as np
import torch

from slidefusion.core.errors import check
from slidefusion.families.base import ModelAdapter
from slidefusion.families.records import BlockList, Objective, SwapRecord, TextConditioning, TextSpec
from slidefusion.families.shared import pipeline_for, pixels, run_pipeline, text_device

def _call_hunyuan(adapter, model, x, t, text):
    check(text.pooled is not None, "text.pooled is required for HunyuanVideo: (B, pooled_projection_dim), "
                                   "the pooled output of its CLIP text_encoder_2")
    mask = text.bool_mask()
    # The model counts real tokens and keeps the first ones, so the mask must be a prefix.
    check(bool((mask.int().diff(dim=1) <= 0).all()), "text.mask must mark a prefix of real tokens for HunyuanVideo")
    guidance = None
    if model.config.guidance_embeds:  # guidance-distilled: the pipeline embeds guidance_scale * 1000
        scale = adapter.options["guidance_scale"] if text.guidance is None else text.guidance
        guidance = torch.as_tensor(scale, dtype=model.dtype, device=x.device).expand(x.shape[0]) * 1000.0
    return model(hidden_states=x, timestep=t, encoder_hidden_states=text.states, encoder_attention_mask=mask,
                 pooled_projections=text.pooled, guidance=guidance, return_dict=False)[0]


def _timesteps(scheduler, steps: int, shape: tuple[int, ...]) -> None:
    """HunyuanVideoPipeline: sigmas 1 .. 1/steps, evenly spaced."""
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])


def _encode(pipe, prompts: list[str], parts) -> TextConditioning:
    """Its `encode_prompt` wraps the prompt in a template, crops it, reads Llama's third state from
    the end and CLIP's pooled output: (states, pooled, mask)."""
    states, pooled, mask = pipe.encode_prompt(prompts, device=text_device(parts),
                                              max_sequence_length=parts.adapter.text.max_length)
    return TextConditioning(states.float(), mask.bool(), pooled.float())


def _sample(parts, noise, cond: TextConditioning, uncond, steps: int, guidance: float, progress: bool,
            cfg_batch: bool = False):
    """HunyuanVideoPipeline's own loop: guidance embedded in the distilled model (no unconditional
    prediction), its linspace sigmas."""
    pipe = pipeline_for(parts, noise)
    if pipe is None or uncond is not None or cond.pooled is None:
        return None
    sizes = pixels(pipe, noise.shape[2:])
    if sizes["height"] % 16 or sizes["width"] % 16:  # the pipeline's own rule for the sizes it takes
        return None
    return run_pipeline(pipe, noise, steps, guidance, progress, **sizes, prompt_embeds=cond.states,
                        pooled_prompt_embeds=cond.pooled, prompt_attention_mask=cond.bool_mask())


HUNYUAN = ModelAdapter(
    family="hunyuanvideo", class_name="HunyuanVideoTransformer3DModel",
    block_lists=(BlockList("transformer_blocks", "full", "attn", joint=True),
                 BlockList("single_transformer_blocks", "full", "attn", joint=True)),
    call=_call_hunyuan, patch=("patch_size_t", "patch_size", "patch_size"),
    objective=Objective("flow", "sigma", 1000.0, "FlowMatchEulerDiscreteScheduler", velocity="noise-x0"),
    text=TextSpec(("text_encoder", "text_encoder_2"), ("tokenizer", "tokenizer_2"), ("LlamaModel", "CLIPTextModel"),
                  256, "encoder", pooled=True),
    pipelines=("HunyuanVideoPipeline",), text_dim="text_embed_dim", pooled_dim="pooled_projection_dim",
    options=MappingProxyType({"guidance_scale": 6.0}),  # HunyuanVideoPipeline's default
    timesteps=_timesteps, encode=_encode, sample=_sample, guidance="embedded", fps=15,
    swap=SwapRecord(("HunyuanVideoAttnProcessor2_0",), text="last"),
)

ADAPTERS = (HUNYUAN,)
