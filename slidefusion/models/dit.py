"""DiT3D and STDiT: latent video (B, C, T, H, W) + flow time + text -> velocity (B, C, T, H, W).

Both share everything but their blocks: DiT3D attends over the whole 3D token grid (with whatever
operator the registry names), STDiT alternates attention inside each frame with attention through
time at each position (Open-Sora's STDiT3). The heavy part is the plain `nn.ModuleList` `blocks`,
which the offload engine and the parallel plans work on from outside.
"""

import torch
from torch import Tensor, nn

from slidefusion.attention import DenseAttention3d, build_attention
from slidefusion.attention.tiling import TileRule
from slidefusion.core.errors import UserError
from slidefusion.core.grids import token_grid
from slidefusion.models.config import ARCHITECTURES as ARCH_NAMES, ModelConfig
from slidefusion.models.layers import (
    DiTBlock,
    FinalLayer,
    PooledTextEmbedder,
    TextProjection,
    TimestepEmbedder,
    sincos_3d,
    unpatchify,
)


class VideoDiT(nn.Module):
    """The common body; subclasses say how `blocks` are built."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        c = config.hidden
        self.patch_embed = nn.Conv3d(config.in_channels, c, kernel_size=config.patch_size, stride=config.patch_size)
        self.t_embedder = TimestepEmbedder(c)
        self.text_proj = TextProjection(config.text_dim, c)
        if config.pooled_text:  # only then: a model without it keeps exactly its old parameter names
            self.text_pool = PooledTextEmbedder(config.text_dim, c)
        self.blocks = nn.ModuleList(self.build_blocks(config))
        self.final = FinalLayer(c, config.in_channels * config.patch_size[0] * config.patch_size[1] * config.patch_size[2])

    def build_blocks(self, config: ModelConfig) -> list[nn.Module]:
        raise NotImplementedError

    def token_grid(self, shape: tuple[int, ...]) -> tuple[int, int, int]:
        """The (T', H', W') token grid for latents of `shape` (B, C, T, H, W), or a UserError."""
        if len(shape) != 5 or shape[1] != self.config.in_channels:
            raise UserError(f"latents must be (B, {self.config.in_channels}, T, H, W), got {tuple(shape)}")
        return token_grid(shape[2:], self.config.patch_size, type(self).__name__)

    def embed(self, x: Tensor, t: Tensor, context: Tensor,
              context_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Tokens (B, T', H', W', C), conditioning (B, C) and projected text (B, L, C)."""
        grid = self.token_grid(x.shape)
        tokens = self.patch_embed(x).permute(0, 2, 3, 4, 1)  # (B, T', H', W', C)
        tokens = tokens + sincos_3d(grid, self.config.hidden).to(tokens)
        c = self.t_embedder(t)  # (B, C)
        if self.config.pooled_text:
            c = c + self.text_pool(context, context_mask)
        return tokens, c, self.text_proj(context)

    def head(self, tokens: Tensor, c: Tensor) -> Tensor:
        """Tokens (B, T', H', W', C) -> velocity (B, C_in, T, H, W)."""
        return unpatchify(self.final(tokens, c), self.config.patch_size, self.config.in_channels)

    def forward(self, x: Tensor, t: Tensor, context: Tensor, context_mask: Tensor | None = None) -> Tensor:
        """x (B, C, T, H, W) latents at flow time t (B,) in [0, 1]; context (B, L, text_dim) text
        states with mask (B, L), True on real tokens. Returns the velocity (B, C, T, H, W)."""
        tokens, c, context = self.embed(x, t, context, context_mask)
        for block in self.blocks:
            tokens = block(tokens, c, context, context_mask)  # (B, T', H', W', C)
        return self.head(tokens, c)


class DiT3D(VideoDiT):
    """Every block attends over the full (T', H', W') grid with the registry's operator."""

    def build_blocks(self, config):
        return [
            DiTBlock(config.hidden, config.heads, config.mlp_ratio, self.grid_attention(config, i))
            for i in range(config.depth)
        ]

    @staticmethod
    def grid_attention(config: ModelConfig, index: int) -> nn.Module:
        return build_attention(config.attention, config.hidden, config.heads, block_index=index, **config.attention_options)


class FrameAttention(nn.Module):
    """Run a grid operator inside each frame: (B, T, H, W, C) -> (B*T, 1, H, W, C) -> back."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def tile_rule(self, grid: tuple[int, int, int]) -> TileRule:
        """Frames are independent: a tile of frames needs no context (`attention.tiling`)."""
        return TileRule(axis=1, halo=0)

    def forward(self, x: Tensor) -> Tensor:
        b, t, h, w, c = x.shape
        return self.inner(x.reshape(b * t, 1, h, w, c)).view(b, t, h, w, c)


class TimeAttention(nn.Module):
    """Run a grid operator along time at each position: (B, T, H, W, C) -> (B*H*W, T, 1, 1, C)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def tile_rule(self, grid: tuple[int, int, int]) -> TileRule:
        """Positions are independent: tiles cut rows, each with all its frames, and need no context
        (cutting frames instead would need every frame's keys at every position)."""
        return TileRule(axis=2, halo=0)

    def forward(self, x: Tensor) -> Tensor:
        b, t, h, w, c = x.shape
        seq = x.permute(0, 2, 3, 1, 4).reshape(b * h * w, t, 1, 1, c)  # (B*H*W, T, 1, 1, C)
        out = self.inner(seq).view(b, h, w, t, c)
        return out.permute(0, 3, 1, 2, 4)  # (B, T, H, W, C)


class STDiT(VideoDiT):
    """Blocks alternate: spatial (kind="spatial", inside each frame), temporal (kind="temporal")."""

    def build_blocks(self, config):
        blocks = []
        for i in range(config.depth):
            spatial = FrameAttention(DiT3D.grid_attention(config, i))
            temporal = TimeAttention(DenseAttention3d(config.hidden, config.heads))
            blocks.append(DiTBlock(config.hidden, config.heads, config.mlp_ratio, spatial, kind="spatial"))
            blocks.append(DiTBlock(config.hidden, config.heads, config.mlp_ratio, temporal, kind="temporal"))
        return blocks


ARCHITECTURES: dict[str, type[VideoDiT]] = dict(zip(ARCH_NAMES, (DiT3D, STDiT), strict=True))


def build_model(config: ModelConfig, device: str | torch.device | None = None) -> VideoDiT:
    """Build the model `config` describes; `device="meta"` allocates nothing (for planning)."""
    with torch.device(device or "cpu"):
        return ARCHITECTURES[config.arch](config)
