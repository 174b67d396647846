"""The data a family record is made of: text conditioning, block lists, text and objective facts,
and what the slide swap, the parallel plans and the parallel VAE decode need of a family.

Everything here is plain data plus the few lines of arithmetic that define it (the objective's
timestep units and targets), so that the training loss, the samplers and the parallel and attention
plans all read one definition per fact.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch
from torch import Tensor, nn

from slidefusion.core.errors import UserError, check

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


@dataclass(frozen=True)
class SwapRecord:
    """What swapping a family's self-attention for slide attention needs beyond its blocks.

    processors: class names of the stock processors whose softmax attention can be redirected (each
        computes its own projections, QK-norm and RoPE and then calls softmax attention once per
        call, or once per sample: Mochi); empty for our own models, whose grid operators are
        replaced as modules. text: where a joint block's text tokens sit in that attention's
        sequence, "first" (CogVideoX), "last" (HunyuanVideo, Mochi) or None (video tokens only).
    grid_bound: a config key bounding every token-grid axis the model can take (Wan: its RoPE
        table's length), or None; a window wider than it is built no wider (`SlideOptions.clamped`)."""

    processors: tuple[str, ...] = ()
    text: str | None = None
    grid_bound: str | None = None

    def __post_init__(self):
        assert self.text in (None, "first", "last"), self.text


@dataclass(frozen=True)
class ImageToVideo:
    """How a family's transformer takes a first frame besides the prompt.

    pipeline: the diffusers image-to-video pipeline class whose own `encode_image` and
    `prepare_latents` build the condition (so a seed samples what that pipeline samples).
    mode(transformer config, adapter options) -> "channels" (image encoder states for the
    cross-attention, and a mask + first-frame latents stacked beside the latents), "first-frame"
    (the image's latents stand in for the first latent frame, its tokens at timestep 0), or None:
    this configuration takes no image."""

    pipeline: str
    mode: Callable[[Mapping, Mapping], str | None]


@dataclass(frozen=True)
class AttentionAccess:
    """How head-parallel attention (Ulysses) reaches one attention class.

    heads(m) -> int. project(m, x, args, kwargs, span): this rank's tokens x (G, n, C) -> qkv
    (G, n, 3, heads, D), every per-token step included (projection, QK norm, rotary); args/kwargs are
    the rest of the module's call (e.g. Wan's rotary_emb, already cut to this rank's tokens) and
    span = (start, n) says which of this rank's tokens x holds, so a token-shaped argument can be cut
    to match. attend(m, q, k, v): the class's own operator on grid-shaped (G, T, H, W, h, D) tensors,
    any subset of heads. output(m, o): (G, n, heads, D) -> (G, n, C). dense: the operator is softmax
    over every key at scale D^-0.5, so it may be computed in key chunks merged by log-sum-exp (sliced
    Ulysses). check(m): a UserError for a configuration of the class that the above does not cover."""

    heads: Callable[[nn.Module], int]
    project: Callable[..., Tensor]
    attend: Callable[..., Tensor]
    output: Callable[[nn.Module, Tensor], Tensor]
    dense: bool
    check: Callable[[nn.Module], None] = lambda m: None


GRID, ROWS = "grid", "rows"


@dataclass(frozen=True)
class ModelAccess:
    """What the parallel engine needs of one family beyond its blocks and attention sites.

    output: path of the token-wise module after the blocks; it runs on the shard and its output is
        gathered (our `final`, diffusers' `proj_out`: a few values per token instead of the width).
    layout: how a block's token tensor is laid out - GRID: (B, T, H, W, C) (ours; a shard of
        positions is (B, T, S_r, 1, C)); ROWS: (B*T, S, C) into spatial and full blocks (a full
        block's is (B, N, C)), (B*S, T, C) into temporal ones (Latte, Wan).
    batched: the model call's per-sample arguments (CFG-parallel gives each half to one group).
    token_args: per-token call arguments -> their token dim (sharded with the tokens when present).
    token_outputs: module path -> token dim of its outputs (sharded as the module returns them).
    rows: per block kind, the block arguments with one row per row of its token tensor (cut with
        the rows a block computes).
    chained: the forward passes each block's output unchanged to the next block, so a switch
        between two layouts may start in one block's hook and end in the next one's.
    """

    output: str
    layout: str
    batched: tuple[str, ...]
    token_args: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    token_outputs: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    rows: Mapping[str, tuple[str, ...]] = field(default_factory=lambda: MappingProxyType({}))
    chained: bool = False

    def __post_init__(self):
        assert self.layout in (GRID, ROWS), self.layout


@dataclass(frozen=True)
class TileSplit:
    """Where a VAE's decoder may be cut into column (or row) tiles for a split decode: `prefix_end`
    is the module after which everything is local; `tail` the modules that follow it, in call order
    (their receptive field is the halo)."""

    prefix_end: str
    tail: tuple[str, ...]


@dataclass(frozen=True)
class VaeFacts:
    """What slidefusion knows of the VAE classes a family's pipelines ship.

    image: classes of 2-D image VAEs the pipeline runs frame by frame (Latte's);
    splits: class name -> where its decoder may be split over ranks (`TileSplit`)."""

    image: tuple[str, ...] = ()
    splits: Mapping[str, TileSplit] = field(default_factory=lambda: MappingProxyType({}))
