"""The data an adapter is made of: text conditioning, block lists, text and objective facts.

Everything here is plain data plus the few lines of arithmetic that define it (the objective's
timestep units and targets), so that the training loss, the samplers and the parallel and attention
plans all read one definition per fact.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from slidefusion.errors import UserError, check

BLOCK_KINDS = ("full", "spatial", "temporal")


@dataclass
class TextConditioning:
    """What a model is conditioned on besides the noisy latents and the timestep.

    states: (B, L, D) text encoder states, padded as the family's pipeline pads them (`TextSpec`).
    mask: (B, L) bool, True on real tokens; None means every token is real.
    pooled: (B, P) pooled text embedding (HunyuanVideo: CLIP's pooled output), or None.
    guidance: embedded guidance scale for guidance-distilled models (HunyuanVideo), in the
        pipeline's `guidance_scale` units (a float, or a (B,) tensor); None: the family default.
    image: (B, L_img, D_img) image encoder states (Wan 2.1 image-to-video), or None.
    video: (B, C_v, T, H, W) latent conditioning read beside the latents (Wan 2.1 image-to-video: the
        mask and the first frame's latents, stacked on the channels; Wan 2.2 TI2V: the first latent
        frame, C_v = C and T = 1, which stands in for the latents' own), or None.
    """

    states: Tensor
    mask: Tensor | None = None
    pooled: Tensor | None = None
    guidance: float | Tensor | None = None
    image: Tensor | None = None
    video: Tensor | None = None

    def __post_init__(self):
        check(isinstance(self.states, Tensor) and self.states.ndim == 3,
              f"text.states must be a (B, L, D) tensor, got {_shape(self.states)}")
        b, length = self.states.shape[:2]
        check(self.mask is None or (isinstance(self.mask, Tensor) and tuple(self.mask.shape) == (b, length)),
              f"text.mask must be None or ({b}, {length}) like text.states, got {_shape(self.mask)}")
        check(self.pooled is None or (isinstance(self.pooled, Tensor) and self.pooled.ndim == 2
                                      and self.pooled.shape[0] == b),
              f"text.pooled must be None or a ({b}, P) tensor, got {_shape(self.pooled)}")

    @property
    def batch(self) -> int:
        return int(self.states.shape[0])

    def bool_mask(self) -> Tensor:
        """(B, L) bool, all True when no mask was given."""
        if self.mask is None:
            return torch.ones(self.states.shape[:2], dtype=torch.bool, device=self.states.device)
        return self.mask.bool()


def _shape(value) -> str:
    return str(tuple(value.shape)) if isinstance(value, Tensor) else type(value).__name__


@dataclass(frozen=True)
class AttentionSite:
    """One self-attention over video tokens: `block` indexes `adapter.blocks(model)` (call order),
    `path` is the qualified module name in the model (e.g. "blocks.3.attn1"), `kind` is the block's
    kind and `joint` says whether text tokens share its softmax."""

    block: int
    path: str
    kind: str
    joint: bool


@dataclass(frozen=True)
class BlockList:
    """One `nn.ModuleList` of transformer blocks on the model.

    attr: its attribute name; kind: "full" | "spatial" | "temporal" for every block of the list, or
    None to read each block's own `.kind` (our STDiT); attention: the self-attention's path inside a
    block; joint: text tokens share that attention's softmax (CogVideoX, HunyuanVideo, Mochi).
    """

    attr: str
    kind: str | None
    attention: str
    joint: bool = False

    def __post_init__(self):
        assert self.kind is None or self.kind in BLOCK_KINDS, self.kind


@dataclass(frozen=True)
class TokenArg:
    """One argument of a block's forward that holds per-video-token tensors (a tuple of them: each):
    `dim` is their token dimension; with `ndim`, only a tensor of that rank is per token (Wan's
    timestep modulation is (B, 6, C), per sample, in 2.1 and (B, N, 6, C), per token, in 2.2 TI2V);
    with `sized`, only a tensor whose size on `dim` is the token count (LTX's (B, 1 or N, 6C))."""

    dim: int = 1
    ndim: int | None = None
    sized: bool = False


@dataclass(frozen=True)
class TokenTiling:
    """How a family's blocks run on a range of frames of their video tokens (`offload.tile`).

    The blocks take the video tokens (B, N, C) first, N = T*H*W in frame-major order (token
    (t*H + h)*W + w), and return them; outside the self-attention (`BlockList.attention`) each op
    is per token (norms, modulation, cross-attention to text, MLP) or per sample. The self-attention
    is dense over the whole clip, so a tile's queries run against every token's keys and values.
    per_token: the block forward's arguments that hold per-token tensors, by name (the first one
    included); processors: the stock processor classes of that self-attention for which this is
    exact (projections, QK-norm and RoPE per token, one softmax attention over video tokens alone).
    """

    per_token: Mapping[str, TokenArg]
    processors: tuple[str, ...]


@dataclass(frozen=True)
class TextSpec:
    """How a family's pipeline encodes prompts (what phase-B caching must reproduce).

    encoders / tokenizers: pipeline component names, in the order the pipeline uses them;
    encoder_classes: the transformers classes the released pipelines ship;
    max_length: tokens the pipeline pads or truncates to (its default `max_sequence_length`);
    padding: "zeros" (states past the prompt are zeroed, Wan), "encoder" (the encoder's own states
    at padding positions, masked where the model takes a mask), "truncate" (cut after the longest
    prompt, Latte's `mask_feature`); pooled: the model also needs a pooled embedding.
    """

    encoders: tuple[str, ...]
    tokenizers: tuple[str, ...]
    encoder_classes: tuple[str, ...]
    max_length: int
    padding: str
    pooled: bool = False


@dataclass(frozen=True)
class Objective:
    """What the model predicts and in which timestep units, as its pipeline and scheduler use it.

    kind "flow": x_s = (1 - s) x0 + s noise for s = sigma in [0, 1] (s = 1 is pure noise) and the
        model predicts a velocity, `velocity` = "noise-x0" (Wan, HunyuanVideo, LTX, ours) or
        "x0-noise" (Mochi, whose scheduler inverts the sigmas).
    kind "v" / "epsilon": DDPM with x_t = sqrt(a_t) x0 + sqrt(1 - a_t) noise (a_t = alphas_cumprod
        of the folder's scheduler); the model predicts v = sqrt(a_t) noise - sqrt(1 - a_t) x0
        (CogVideoX) or the noise (Latte).
    timestep: what the model is fed: "sigma" (sigma * scale), "1-sigma" ((1 - sigma) * scale,
        Mochi) or "index" (the DDPM step index 0..scale-1).
    learned_sigma: the model may output 2C channels, the second half its variance (Latte);
        `predict` drops them, `raw_output` keeps them.
    scheduler: the scheduler class the family's released pipelines ship.
    """

    kind: str
    timestep: str
    scale: float
    scheduler: str
    velocity: str = ""
    learned_sigma: bool = False

    def __post_init__(self):
        assert self.kind in ("flow", "v", "epsilon") and self.timestep in ("sigma", "1-sigma", "index")
        assert (self.kind == "flow") == (self.velocity in ("noise-x0", "x0-noise"))

    def model_timesteps(self, t: Tensor) -> Tensor:
        """Flow sigmas (B,) in [0, 1], or DDPM indices (B,), -> the timesteps the model is given."""
        if self.timestep == "index":
            return t
        return (1 - t if self.timestep == "1-sigma" else t) * self.scale

    def noisy(self, x0: Tensor, noise: Tensor, t: Tensor, alphas_cumprod: Tensor | None = None) -> Tensor:
        """The noisy latents at t (B,) for data x0 and noise (B, ...)."""
        a, b = self._mix(t, x0, alphas_cumprod)
        return a * x0 + b * noise

    def target(self, x0: Tensor, noise: Tensor, t: Tensor, alphas_cumprod: Tensor | None = None) -> Tensor:
        """What the model should predict at t for data x0 and noise (B, ...)."""
        if self.kind == "epsilon":
            return noise
        if self.kind == "flow":
            return noise - x0 if self.velocity == "noise-x0" else x0 - noise
        a, b = self._mix(t, x0, alphas_cumprod)
        return a * noise - b * x0  # v-prediction

    def _mix(self, t: Tensor, like: Tensor, alphas_cumprod: Tensor | None) -> tuple[Tensor, Tensor]:
        view = (-1,) + (1,) * (like.dim() - 1)
        if self.kind == "flow":
            s = t.to(like.dtype).view(view)
            return 1 - s, s
        if alphas_cumprod is None:
            raise UserError(f"a {self.kind}-prediction objective needs the scheduler's alphas_cumprod")
        a = alphas_cumprod.to(like.device)[t.long()].to(like.dtype).view(view)
        return a.sqrt(), (1 - a).sqrt()
