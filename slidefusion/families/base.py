"""`ModelAdapter`: one declarative record per model class, read by generic methods.

A record says where the blocks are (lists in call order, interleaved or one after another), what
kind each block is and where its self-attention lives, which config keys hold the latent channels
and patch sizes, how the family's pipeline encodes text and sets its timesteps, what the model
predicts, what the slide swap, the parallel plans and tiling need of it, and one small `call`
function that turns (latents (B, C, T, H, W), timesteps, text) into the model's own call and its
output back into (B, C_out, T, H, W). Everything else is generic over those facts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor, nn

from slidefusion.core.errors import check
from slidefusion.core.grids import token_grid
from slidefusion.families.records import (
    AttentionAccess,
    AttentionSite,
    BlockList,
    ImageToVideo,
    ModelAccess,
    Objective,
    SwapRecord,
    TextConditioning,
    TextSpec,
    TokenTiling,
    VaeFacts,
)

# (adapter, model, latents (B, C, T, H, W), timesteps, text) -> raw output (B, C_out, T, H, W)
CallFn = Callable[["ModelAdapter", nn.Module, Tensor, Tensor, TextConditioning], Tensor]
# (adapter, model, latent shape) -> None, raising a UserError for shapes the model cannot take
CheckFn = Callable[["ModelAdapter", nn.Module, tuple[int, ...]], None]
# (the family's pipeline around its text encoders, prompts, parts) -> TextConditioning
EncodeFn = Callable[[Any, list[str], Any], TextConditioning]
# (scheduler, steps, latent shape (B, C, T, H, W)) -> None: the scheduler's timesteps, set
TimestepsFn = Callable[[Any, int, tuple[int, ...]], None]
# (parts, noise (B, C, T, H, W), cond, uncond or None, steps, guidance, progress) -> latents
SampleFn = Callable[..., Tensor]


def default_timesteps(scheduler, steps: int, shape: tuple[int, ...]) -> None:
    """What most pipelines do: `scheduler.set_timesteps(steps)`."""
    scheduler.set_timesteps(steps)


def _empty() -> Mapping:
    return MappingProxyType({})


def config_value(model: nn.Module, key: str | int, default: Any = None) -> Any:
    """`model.config.<key>`; "patch_size.0" indexes a tuple entry; an int key is the value itself."""
    if isinstance(key, int):
        return key
    name, _, index = key.partition(".")
    value = getattr(model.config, name, default)
    if index and value is not None:
        value = value[int(index)]
    return default if value is None else value


@dataclass(frozen=True)
class ModelAdapter:
    """How slidefusion drives one model class. See the module docstring; fields are data.

    block_lists: the block lists in call order (`interleave`: one of each in turn, as Latte runs them);
    call: the family's call function (see CallFn); patch: config keys (or ints) of (pt, ph, pw);
    objective / text: what the model predicts and how its pipeline encodes prompts (None: ours);
    pipelines: the diffusers pipeline classes that run this transformer (export writes the first);
    channels / text_dim / pooled_dim: config keys of the latent channels (the noise's; a model's input
        may add conditioning channels, Wan 2.1 I2V) and the text widths;
    input_layout: how the model's own forward receives latents, for `grid_from_call`: "BCTHW",
        "BTCHW" (CogVideoX, frames first) or "packed" (LTX: (B, N, C) tokens with num_frames/height/
        width keywords); check_latents: extra shape rules (Latte's video_length);
    options: per-instance settings, with defaults, that the pipeline config may set (Wan 2.2's
        `expand_timesteps`, LTX's `rope_interpolation_scale`, HunyuanVideo's default guidance);
    folder_options: (the folder's VAE config) -> options its pipeline derives from the folder
        (LTX's rope interpolation scale from the VAE's compression);
    timesteps: how the family's pipeline sets its scheduler's timesteps (`TimestepsFn`);
    encode: how the family's pipeline encodes prompts (`EncodeFn`, through its own `encode_prompt`);
    sample: the family's denoising loop, through its own diffusers pipeline (`SampleFn`; None: the
        generic loop of `slidefusion.pretrained.sampling`);
    guidance: "cfg" (a conditional and an unconditional prediction) or "embedded" (the scale is an
        input of a guidance-distilled model, HunyuanVideo);
    lora_targets: the modules LoRA adapts by default (peft `target_modules`: name suffixes);
    fps: the frame rate the family's examples write videos at (`export_to_video(..., fps=)`);
    grid_blocks: each block takes the token grid (B, T, H, W, C) as its first argument, returns
        one like it, and outside its self-attention works per token or per sample, so a block can
        run on a slab of the grid (what `offload.tiled` relies on; foreign blocks: False);
    token_tiling: for blocks on packed video tokens, how they run on a range of frames (`TokenTiling`;
        None: not tileable);
    swap: what `use_slide_attention` needs (`SwapRecord`; None: not swappable);
    parallel: what the parallel plans need of the model (`ModelAccess`; None: no parallel plan);
    attention: how head-parallel attention reaches the family's attention classes, by class or by
        "module.ClassName" (`AttentionAccess`);
    presets: published model configs by name (what the offload planner sizes without a folder);
    widths: (model) -> (hidden width, heads, MLP width / hidden), for the offload planner (None: the
        planner does not size this family);
    vae: the family's VAE classes (`VaeFacts`);
    image_to_video: how the transformer takes a first frame (`ImageToVideo`; None: text only);
    layout: the module that maps the family's original single-file layout (its own releases',
        ComfyUI's) to diffusers' names and back (e.g. `slidefusion.io.wan_layout`: `original_name`,
        `diffusers_name`, `layout_of`, `to_original`, `alpha_is_read`, `LORA_PREFIX`); None: none.
    """

    family: str
    class_name: str
    block_lists: tuple[BlockList, ...]
    call: CallFn
    patch: tuple[str | int, str | int, str | int]
    objective: Objective
    text: TextSpec | None
    pipelines: tuple[str, ...] = ()
    interleave: bool = False
    channels: str = "in_channels"
    text_dim: str = "text_dim"
    pooled_dim: str | None = None
    input_layout: str = "BCTHW"
    check_latents: CheckFn | None = None
    options: Mapping[str, Any] = field(default_factory=_empty)
    folder_options: Callable[[Mapping], dict] | None = None
    timesteps: TimestepsFn = default_timesteps
    encode: EncodeFn | None = None
    sample: SampleFn | None = None
    guidance: str = "cfg"
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out.0")
    fps: int = 16
    grid_blocks: bool = False
    token_tiling: TokenTiling | None = None
    swap: SwapRecord | None = None
    parallel: ModelAccess | None = None
    attention: Mapping[type | str, AttentionAccess] = field(default_factory=_empty)
    presets: Mapping[str, Mapping] = field(default_factory=_empty)
    widths: Callable[[nn.Module], tuple[int, int, float]] | None = None
    vae: VaeFacts = VaeFacts()
    image_to_video: ImageToVideo | None = None
    layout: Any = None

    def with_options(self, **options) -> ModelAdapter:
        """This adapter with some `options` changed; UserError for an option the family lacks."""
        unknown = sorted(set(options) - set(self.options))
        check(not unknown, f"adapter option(s) {unknown} unknown for {self.class_name}; "
                           f"valid: {sorted(self.options) or 'none'}")
        return dataclasses.replace(self, options=MappingProxyType({**self.options, **options}))

    # ------------------------------------------------------------------ structure
    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """Every transformer block, in the order the forward calls them."""
        return [block for block, _, _ in self._walk(model)]

    def block_kinds(self, model: nn.Module) -> list[str]:
        """Per block (call order): "full" | "spatial" | "temporal"."""
        return [spec.kind or block.kind for block, spec, _ in self._walk(model)]

    def attention_sites(self, model: nn.Module) -> list[AttentionSite]:
        """The self-attention over video tokens of every block, in call order."""
        return [AttentionSite(i, f"{spec.attr}.{local}.{spec.attention}", spec.kind or block.kind, spec.joint)
                for i, (block, spec, local) in enumerate(self._walk(model))]

    def _walk(self, model: nn.Module) -> list[tuple[nn.Module, BlockList, int]]:
        lists = [(spec, list(getattr(model, spec.attr))) for spec in self.block_lists]
        if self.interleave:
            check(len({len(blocks) for _, blocks in lists}) == 1,
                  f"{self.class_name}: interleaved block lists differ in length")
            return [(blocks[i], spec, i) for i in range(len(lists[0][1])) for spec, blocks in lists]
        return [(block, spec, i) for spec, blocks in lists for i, block in enumerate(blocks)]

    # ------------------------------------------------------------------ shapes
    def latent_channels(self, model: nn.Module) -> int:
        return int(config_value(model, self.channels))

    def text_width(self, model: nn.Module) -> int:
        """D of the text states (B, L, D) the model takes."""
        return int(config_value(model, self.text_dim))

    def patch_size(self, model: nn.Module) -> tuple[int, int, int]:
        """(pt, ph, pw) from the model's config (a None entry, e.g. CogVideoX 1.0's patch_size_t, is 1)."""
        return tuple(int(config_value(model, key, 1)) for key in self.patch)

    def token_grid(self, model: nn.Module, latent_shape) -> tuple[int, int, int]:
        """The (T', H', W') video token grid for latents (B, C, T, H, W), or a UserError."""
        shape = tuple(int(s) for s in latent_shape)
        channels = self.latent_channels(model)
        check(len(shape) == 5 and shape[1] == channels,
              f"latents must be (B, {channels}, T, H, W) for {self.class_name}, got {shape}")
        grid = token_grid(shape[2:], self.patch_size(model), self.class_name)
        if self.check_latents is not None:
            self.check_latents(self, model, shape)
        return grid

    def grid_from_call(self, model: nn.Module, args: tuple, kwargs: Mapping) -> tuple[int, int, int]:
        """The token grid of a call to the model's own forward, as a forward pre-hook sees it."""
        hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        if self.input_layout == "packed":
            return tuple(int(kwargs[k]) for k in ("num_frames", "height", "width"))
        shape = tuple(hidden.shape)
        if self.input_layout == "BTCHW":
            shape = (shape[0], shape[2], shape[1], shape[3], shape[4])
        # the model's own input may carry conditioning channels beside the latents (Wan 2.1 I2V)
        return self.token_grid(model, (shape[0], self.latent_channels(model), *shape[2:]))

    # ------------------------------------------------------------------ calling
    def raw_output(self, model: nn.Module, latents: Tensor, timesteps, text: TextConditioning) -> Tensor:
        """The model's whole output (B, C_out, T, H, W), learned-variance channels included."""
        check(isinstance(text, TextConditioning),
              f"text must be a slidefusion.families.TextConditioning, got {type(text).__name__}")
        self.token_grid(model, latents.shape)
        b = latents.shape[0]
        timesteps = torch.as_tensor(timesteps, device=latents.device)
        if timesteps.ndim == 0:
            timesteps = timesteps.expand(b)
        check(timesteps.shape[0] == b, f"timesteps must be a scalar or ({b},), got {tuple(timesteps.shape)}")
        check(text.batch == b, f"text.states batch {text.batch} must equal the latents' batch {b}")
        return self.call(self, model, latents, timesteps, text)

    def predict(self, model: nn.Module, latents: Tensor, timesteps, text: TextConditioning) -> Tensor:
        """latents (B, C, T, H, W) at `timesteps` (B,) in the model's own units (see `objective`)
        -> the model's prediction (B, C, T, H, W); learned-variance channels are dropped."""
        out = self.raw_output(model, latents, timesteps, text)
        channels = latents.shape[1]
        if self.objective.learned_sigma and out.shape[1] == 2 * channels:
            return out[:, :channels]
        return out

    def tokens(self, model: nn.Module, latent_shape) -> int:
        """Video tokens per sample: the product of `token_grid`."""
        return math.prod(self.token_grid(model, latent_shape))

