"""Prompts -> `TextConditioning`, by the family's own diffusers pipeline (`encode_prompt`).

Each family's pipeline encodes prompts its own way (Wan zero-pads past the prompt, CogVideoX and LTX
run the encoder without a mask, Mochi may zero an empty prompt, HunyuanVideo wraps the prompt in a
template, crops it, reads Llama's third state from the end and CLIP's pooled output, Latte cuts
after the longest prompt). Calling the pipeline's own method reproduces all of it; the small
functions below only say how to call it and how to read its result. Training caches and sampling
both come through `encode_prompts`, so a fine-tuned model sees at inference what it was trained on.
"""

from __future__ import annotations

import torch

from slidefusion.adapters import TextConditioning
from slidefusion.errors import check


def _device(parts) -> torch.device:
    return next(parts.text_encoder.parameters()).device


def _states_only(pipe, prompts, parts, **options) -> TextConditioning:
    """Wan, CogVideoX: (prompt_embeds, negative_embeds); no mask (Wan's states past the prompt are zeros)."""
    states, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=_device(parts),
                                   max_sequence_length=parts.adapter.text.max_length, **options)
    return TextConditioning(states.float())


def _with_mask(pipe, prompts, parts) -> TextConditioning:
    """LTX, Mochi: (embeds, mask, negative embeds, negative mask)."""
    states, mask, _, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=_device(parts),
                                            max_sequence_length=parts.adapter.text.max_length)
    return TextConditioning(states.float(), mask.bool())


def _hunyuan(pipe, prompts, parts) -> TextConditioning:
    states, pooled, mask = pipe.encode_prompt(prompts, device=_device(parts),
                                              max_sequence_length=parts.adapter.text.max_length)
    return TextConditioning(states.float(), mask.bool(), pooled.float())


def _latte(pipe, prompts, parts) -> TextConditioning:
    """LattePipeline cuts the states after the prompt (`mask_feature`); the adapter does the cut from
    the mask, so whole states and the tokenizer's mask are kept (a batch cuts at its longest prompt).
    clean_caption=False: the pipeline's own fallback when beautifulsoup is absent."""
    states, _ = pipe.encode_prompt(prompts, do_classifier_free_guidance=False, device=_device(parts),
                                   mask_feature=False, clean_caption=False)
    tokens = pipe.tokenizer(prompts, padding="max_length", max_length=states.shape[1], truncation=True,
                            add_special_tokens=True, return_tensors="pt")
    return TextConditioning(states.float(), tokens.attention_mask.bool())


ENCODE = {"wan": _states_only, "cogvideox": _states_only, "ltx": _with_mask, "mochi": _with_mask,
          "hunyuanvideo": _hunyuan, "latte": _latte}


@torch.no_grad()
def encode_prompts(parts, prompts: list[str]) -> TextConditioning:
    """Text conditioning (states (B, L, D) float32, mask, pooled) of `prompts` exactly as the
    folder's pipeline computes it (`parts`: a `PretrainedParts` with text encoders)."""
    check(isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) for p in prompts),
          "prompts must be a non-empty list of strings")
    check(parts.text_encoder is not None, "these parts were loaded without a text encoder")
    return ENCODE[parts.adapter.family](parts.text_pipeline(), list(prompts), parts)
