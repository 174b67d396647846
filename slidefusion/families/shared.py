"""Small pieces several diffusers families share: how their pipelines' `encode_prompt` is called and
read, and how head-parallel attention reaches diffusers' attention modules. A family file picks them
by name; nothing here names a family.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slidefusion.families.records import TextConditioning

# One T5 encoder, as the CogVideoX, LTX, Mochi and Latte pipelines ship it (`TextSpec` fields).
ONE_T5 = dict(encoders=("text_encoder",), tokenizers=("tokenizer",), encoder_classes=("T5EncoderModel",))


def text_device(parts) -> torch.device:
    return next(parts.text_encoder.parameters()).device


def encode_states_only(pipe, prompts: list[str], parts, **options) -> TextConditioning:
    """Pipelines whose `encode_prompt` returns (prompt_embeds, negative_embeds): the states alone, no
    mask (the pipeline passes none; Wan's states past the prompt are zeros)."""
    states, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=text_device(parts),
                                   max_sequence_length=parts.adapter.text.max_length, **options)
    return TextConditioning(states.float())


def encode_with_mask(pipe, prompts: list[str], parts) -> TextConditioning:
    """Pipelines whose `encode_prompt` returns (embeds, mask, negative embeds, negative mask)."""
    states, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=text_device(parts),
                                            max_sequence_length=parts.adapter.text.max_length)
    return TextConditioning(states.float(), mask.bool())


def sdpa(m, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Softmax attention over every token of a grid (G, T, H, W, h, D), as the diffusers processors
    compute it (F.scaled_dot_product_attention at its default scale D^-0.5)."""
    shape = q.shape
    q, k, v = (t.flatten(1, 3).transpose(1, 2) for t in (q, k, v))  # (G, h, N, D)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(shape)


def attention_output(m, o: Tensor) -> Tensor:
    """(G, n, heads, D) -> (G, n, C): a diffusers attention's output projection, then its (inactive)
    dropout."""
    return m.to_out[1](m.to_out[0](o.flatten(-2)))


# ---------------------------------------------------------------- sampling through the family's pipeline
def pipeline_for(parts, noise: Tensor):
    """The family's own pipeline around `parts` (`PretrainedParts.pipeline`), or None where it would
    run elsewhere than `noise` (it moves its latents to the device of its first component)."""
    pipe = parts.pipeline()
    return pipe if pipe._execution_device == noise.device else None


def run_pipeline(pipe, latents: Tensor, steps: int, guidance: float, progress: bool, **kwargs) -> Tensor:
    """`pipe(...)`'s own denoising loop from `latents` (in the pipeline's own layout) with prompt
    embeddings in `kwargs`: its final latents, in that layout (output_type="latent": no decode)."""
    pipe.set_progress_bar_config(disable=not progress)
    return pipe(latents=latents, num_inference_steps=steps, guidance_scale=guidance, output_type="latent",
                return_dict=False, **kwargs)[0].float()


def pixels(pipe, latents_thw: tuple[int, int, int], temporal: str = "vae_scale_factor_temporal",
           spatial: str = "vae_scale_factor_spatial") -> dict:
    """num_frames / height / width in pixels for latents of (T, H, W) cells, by the pipeline's own
    VAE factors (attribute names vary by pipeline)."""
    t, h, w = latents_thw
    time, space = int(getattr(pipe, temporal)), int(getattr(pipe, spatial))
    return dict(num_frames=(t - 1) * time + 1, height=h * space, width=w * space)


def batched_pair(cond: TextConditioning, uncond: TextConditioning | None) -> bool:
    """Whether a pipeline that concatenates [uncond, cond] embeddings can take these: equal shapes
    (its own encoding pads both to one length; other conditioning may not)."""
    return uncond is None or (uncond.states.shape == cond.states.shape
                              and (uncond.mask is None) == (cond.mask is None))
