"""Prompts -> `TextConditioning`, by the family's own diffusers pipeline (`encode_prompt`).

Each family's pipeline encodes prompts its own way (padding, masks, templates, pooled outputs);
calling the pipeline's own method reproduces all of it, and the family's record says how to call it
and read its result (`ModelAdapter.encode`). Training caches and sampling both come through
`encode_prompts`, so a fine-tuned model sees at inference what it was trained on.
"""

from __future__ import annotations

import torch

from slidefusion.core.errors import check
from slidefusion.families import TextConditioning


@torch.no_grad()
def encode_prompts(parts, prompts: list[str]) -> TextConditioning:
    """Text conditioning (states (B, L, D) float32, mask, pooled) of `prompts` exactly as the
    folder's pipeline computes it (`parts`: a `PretrainedParts` with text encoders)."""
    check(isinstance(prompts, (list, tuple)) and prompts and all(isinstance(p, str) for p in prompts),
          "prompts must be a non-empty list of strings")
    check(parts.text_encoder is not None, "these parts were loaded without a text encoder")
    encode = parts.adapter.encode
    check(encode is not None, f"{parts.adapter.class_name} has no prompt encoding")
    return encode(parts.text_pipeline(), list(prompts), parts)
