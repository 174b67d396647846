"""`TiledBlock`, the block runner that tiles (the algorithm is in `tiled`), and the same on a
resident model: `tile_blocks(model, frames)` makes each block run tiled in forward and recompute
tile by tile in backward (a checkpoint per block), with no engine.

Tile size: `frames` frames of the token grid per tile (rows for attention along time: the same
number of tokens). A tile size of at least the clip's frames is clamped to the clip: the blocks then
run whole, with one note (a config's tile size is fixed while clips vary in length, so this is not
an error). A tile size below 1 is refused where it is configured (`OffloadPolicy`).
Tiling needs to know the halo of each block's self-attention: a model whose adapter declares neither
grid blocks (ours) nor packed-token blocks (`TokenTiling`: Wan, see `token_tiles`), a block without
an attention module that declares `tile_rule`, or a Wan whose self-attention was swapped (slide
attention on packed tokens declares no halo), is refused with one line before any step.
"""

import warnings

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from slidefusion.core import hooks

from slidefusion.families import ADAPTERS, adapter_for
from slidefusion.errors import UserError, check
from slidefusion.offload.engine.hooks import WholeBlock
from slidefusion.offload.tiling.tiled import Site, Sums, forward_tiles, grad_tiles, tiles_for
from slidefusion.offload.tiling.token_tiles import TokenBlocks, token_tiling_refusal


def tiled_attention(block: nn.Module) -> nn.Module | None:
    """The block's self-attention that declares a tiling rule: the outermost module with
    `tile_rule` (STDiT: the frame/time view, not the operator inside it); None if there is none."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in block.named_modules():
        if name and callable(getattr(module, "tile_rule", None)) and not any(name.startswith(f"{n}.") for n, _ in found):
            found.append((name, module))
    check(len(found) <= 1, f"{type(block).__name__} has {len(found)} attention modules with a tiling rule "
                           f"({', '.join(n for n, _ in found)}); tiling needs exactly one")
    return found[0][1] if found else None


def tiling_refusal(model: nn.Module) -> str | None:
    """Why `model`'s blocks cannot be tiled, or None: its adapter declares grid blocks (ours) or
    packed-token blocks with their stock self-attention (Wan)."""
    adapter = adapter_for(model)
    if adapter.token_tiling is not None:
        return token_tiling_refusal(model, adapter)
    if not adapter.grid_blocks:
        tileable = ", ".join(a.class_name for a in ADAPTERS.values() if a.grid_blocks or a.token_tiling)
        return (f"{type(model).__name__}'s blocks are not declared tileable (tileable: {tileable}; "
                "the halo of its attention is unknown)")
    return None


def check_tileable(model: nn.Module, blocks, frames: int, key: str = "offload.tile") -> None:
    """A one-line UserError unless every block of `model` can be tiled."""
    check(isinstance(frames, int) and not isinstance(frames, bool) and frames >= 1,
          f"{key}={frames!r} must be a number of frames >= 1 (or auto, off)")
    refusal = tiling_refusal(model)
    if refusal is not None:
        raise UserError(f"{key}={frames}: {refusal}; use {key}=off")
    if adapter_for(model).token_tiling is not None:
        return
    for index, block in enumerate(blocks):
        if tiled_attention(block) is None:
            raise UserError(f"{key}={frames}: block {index} ({type(block).__name__}) has no self-attention that "
                            f"declares its halo (a tile_rule); use {key}=off")


class TiledBlock(WholeBlock):
    """The engine's block runner, tile by tile (see `tiled`); a block the tiles would not cut
    (one tile covers it) runs whole. `tokens`: for packed-token blocks (Wan), what the model's
    record says of them (`token_tiles.TokenBlocks`); None: grid blocks (ours)."""

    def __init__(self, frames: int, tokens: TokenBlocks | None = None) -> None:
        self.frames, self.noted, self.tokens = frames, False, tokens
        self.attention: dict[int, nn.Module] = {}

    def site(self, block: nn.Module, args, kwargs):
        """(Site, tiles) for this call, or (None, None) to run the block whole."""
        flat, spec = tree_flatten((args, kwargs))
        if self.tokens is not None:
            ops, dims, grid = self.tokens.cut(block, args, kwargs, flat)
            attn, unit = ops.attn, grid[1] * grid[2]
            rule = ops.tile_rule(grid)
        else:
            attn = self.attention.get(id(block)) or self.attention.setdefault(id(block), tiled_attention(block))
            x = args[0] if args else None
            check(torch.is_tensor(x) and x.dim() == 5, f"tiling needs blocks called with the token grid (B, T, H, W, C) "
                                                       f"first, not {type(x).__name__}")
            ops, grid, unit = attn, tuple(x.shape[1:4]), 1
            rule = attn.tile_rule(grid)
            dims = [rule.axis] + [None] * (len(flat) - 1)
        tiles = tiles_for(rule, grid, self.frames)
        if self.frames > grid[0] and not self.noted:
            self.noted = True
            warnings.warn(f"offload.tile={self.frames} frames is more than the clip's {grid[0]}: clamped, the blocks run untiled")
        if len(tiles) == 1:
            return None, None
        return Site(block.forward, attn, ops, rule, flat, spec, dims, unit, grid[rule.axis - 1]), tiles

    def forward(self, block, params, args, kwargs):
        site, tiles = self.site(block, args, kwargs)
        if site is None:
            return super().forward(block, params, args, kwargs)
        return _within(block, params, lambda: forward_tiles(site, tiles))

    def grads(self, block, params, args, kwargs, grad_outputs, weights: list) -> tuple[list, list]:
        site, tiles = self.site(block, args, kwargs)
        if site is None:
            return super().grads(block, params, args, kwargs, grad_outputs, weights)
        sums = Sums(site, list(weights))
        _within(block, params, lambda: grad_tiles(site, tiles, grad_outputs[0], sums))
        return sums.result()

    def close(self) -> None:
        if self.tokens is not None:
            self.tokens.close()


def _within(block: nn.Module, params, work):
    """`work()` with `params` standing in for the block's parameters (functional_call calls the
    block's forward, so the work stands in for it); with no params, on the block's own."""
    if params is None:
        return work()
    with hooks.stand_in(block, "tiling.params", lambda *args, **kwargs: work()):
        return torch.func.functional_call(block, params, ())


def make_runner(policy, model: nn.Module, blocks) -> WholeBlock:
    """The engine's block runner for `policy.tile` (None: whole blocks)."""
    if policy.tile is None:
        return WholeBlock()
    check_tileable(model, blocks, policy.tile)
    return TiledBlock(policy.tile, _tokens(model, "offload.grid"))


def _tokens(model: nn.Module, hook: str) -> TokenBlocks | None:
    return TokenBlocks(model, hook) if adapter_for(model).token_tiling is not None else None


# -- a resident model ------------------------------------------------------------------------------


TILE = "tiling"
# Streaming and the parallel plans run each block through their own hook: a tiled checkpoint
# around or inside them would run the block twice or on another rank's tokens.
REFUSED = {"offload": "the offload engine tiles its blocks itself (OffloadPolicy(tile=...)); close it first",
           "parallel": "the parallel plans split inference over ranks; detach them before tiling"}


class TileHook:
    """The `TILE` hook of a resident block: tiled, checkpointed per block."""

    def __init__(self, runner: TiledBlock, block: nn.Module):
        self.runner, self.block = runner, block

    def __call__(self, block, call_next, *args, **kwargs):
        if not torch.is_grad_enabled():
            return self.run(self.runner.forward, None, args, kwargs)
        weights = [p for p in self.block.parameters() if p.requires_grad]
        tensors, spec = tree_flatten((args, kwargs))
        return TiledCheckpoint.apply(self, spec, len(weights), *weights, *tensors)

    def run(self, method, *arguments):
        """`method(block, ...)` of the runner; its calls of the block reach the block's own forward."""
        with hooks.within(self.block, TILE):
            return method(self.block, *arguments)


class TiledCheckpoint(torch.autograd.Function):
    """One resident block as a checkpoint: forward tiled without a graph, backward recomputes
    tile by tile; the block's weights are inputs, so their gradients accumulate as usual."""

    @staticmethod
    def forward(ctx, hook: TileHook, spec, count: int, *flat):
        weights, tensors = flat[:count], flat[count:]
        args, kwargs = tree_unflatten(list(tensors), spec)
        with torch.no_grad():
            out = hook.run(hook.runner.forward, None, args, kwargs)
        check(torch.is_tensor(out), f"tile_blocks needs blocks that return one tensor, not {type(out).__name__}")
        ctx.hook, ctx.spec, ctx.weights = hook, spec, weights
        ctx.autocast = (torch.is_autocast_enabled(out.device.type), torch.get_autocast_dtype(out.device.type), out.device.type)
        ctx.save_for_backward(*[t if torch.is_tensor(t) else None for t in tensors])
        ctx.others = [None if torch.is_tensor(t) else t for t in tensors]
        return out

    @staticmethod
    def backward(ctx, grad_out):
        tensors = [s if o is None else o for s, o in zip(ctx.saved_tensors, ctx.others)]
        inputs = [t.detach().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t for t in tensors]
        args, kwargs = tree_unflatten(inputs, ctx.spec)
        enabled, dtype, device = ctx.autocast
        with torch.autocast(device, dtype=dtype, enabled=enabled):
            input_grads, weight_grads = ctx.hook.run(ctx.hook.runner.grads, None, args, kwargs, [grad_out], list(ctx.weights))
        return (None, None, None, *weight_grads, *input_grads)


def tile_blocks(model: nn.Module, frames: int) -> None:
    """Run every block of a resident `model` tile by tile (`frames` per tile), each a checkpoint."""
    blocks = adapter_for(model).blocks(model)
    check_tileable(model, blocks, frames, key="tile")
    hooks.refuse_hooks(model, REFUSED)
    check(not any(hooks.get_hook(block, TILE) for block in blocks), "tile_blocks: the model is already tiled")
    runner = TiledBlock(frames, _tokens(model, "tiling.grid"))
    for block in blocks:
        hooks.add_hook(block, TILE, TileHook(runner, block))


def untile_blocks(model: nn.Module) -> None:
    """Undo `tile_blocks`."""
    runners = set()
    for block in model.modules():
        hook = hooks.get_hook(block, TILE)
        if isinstance(hook, TileHook):
            if id(hook.runner) not in runners:
                runners.add(id(hook.runner))
                hook.runner.close()
            hooks.remove_hook(block, TILE)
