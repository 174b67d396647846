"""`parallelize`: the one generic function that reads a plan and a schedule and runs an unchanged
model sequence-parallel (and optionally CFG-parallel) on a process group. It reads as a recipe:
build the groups, plan the model, resolve the slice count, attach the runner.

Two runners. `LayerSlices` (dsp, scalefusion, scalefusion-inter) embeds the full latents on every
rank, keeps its shard, runs the blocks layer by layer in slices with the switches between layouts,
and applies the model's own head to its shard. `HeadParallel` (ulysses) attaches hooks where the
blocks and attention modules already sit (shard at the first block, head all-to-alls at each
attention) and calls the model's own forward. Either way the model's token-wise output module runs
on the shard and only its output is gathered (16 values per token for our models instead of the
width), so the sampler sees the full velocity on every rank, and the blocks' math is the model's.
"""

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from slidefusion.errors import UserError, check
from slidefusion.parallel import hooks
from slidefusion.parallel.comm import Comm
from slidefusion.parallel.exchange import gather_shards
from slidefusion.parallel.layout import FRAMES, Split, block_view, shard, to_canonical
from slidefusion.parallel.plan import KIND_LAYOUT, SCHEDULES, ParallelConfig, Plan, Schedule, check_slices, plan_for
from slidefusion.parallel.records import access_for
from slidefusion.parallel.switch import Handoff, Switch
from slidefusion.parallel.trace import Tracer
from slidefusion.parallel.ulysses import UlyssesCall, UlyssesHook


@dataclass(frozen=True)
class LayerCall:
    """What the output hook needs to gather a LayerSlices call: the last layer's sharded axis."""

    comm: Comm
    full: tuple[int, ...]  # canonical (B, T, S, C)
    grid: tuple[int, int, int]
    axis: int
    tracer: Tracer

    def gather(self, y: Tensor) -> Tensor:
        """This rank's block-shaped (.., K) output -> the full (B, T, H, W, K) on every rank."""
        b, t, s, k = self.full[0], self.full[1], self.full[2], y.shape[-1]
        # block views: (B, T_r, H, W, K) by frames, (B, T, S_r, 1, K) by positions (T_r may be 0)
        local = y.reshape(b, y.shape[1], s, k) if self.axis == FRAMES else y.reshape(b, t, y.shape[2], k)
        with self.tracer.span("gather tokens"):
            out = gather_shards(self.comm, local, self.axis, Split(self.full[self.axis], self.comm.size))
        return out.reshape(b, *self.grid, k)


class LayerSlices:
    """dsp / scalefusion / scalefusion-inter: layers in slices, switches between frames and positions."""

    def __init__(self, model: nn.Module, plan: Plan, schedule: Schedule, comm: Comm, tracer: Tracer, slices: int):
        self.model, self.plan, self.schedule, self.comm, self.tracer = model, plan, schedule, comm, tracer
        self.slices = slices
        self.layouts = [KIND_LAYOUT[kind] for kind in plan.kinds]
        hooks.attach(model.get_submodule(plan.record.output), hooks.GatherHook())

    def __call__(self, x: Tensor, t: Tensor, context: Tensor, mask) -> Tensor:
        with self.tracer.span("embed"):
            tokens, c, context = self.model.embed(x, t, context)  # (B, T, H, W, C) on every rank
        b, frames, h, w, width = tokens.shape
        canonical = to_canonical(tokens)
        local = self.run_blocks(canonical, (h, w), c, context, mask)
        call = LayerCall(self.comm, tuple(canonical.shape), (frames, h, w), self.layouts[-1], self.tracer)
        with self.tracer.span("head"), hooks.calling(call):  # the output module gathers its few values
            return self.model.head(block_view(local, self.layouts[-1], (h, w)), c)

    def _slices(self, layout: int) -> int:
        return self.schedule.slices(layout, self.slices)

    def run_blocks(self, canonical: Tensor, hw: tuple[int, int], c: Tensor, context: Tensor, mask) -> Tensor:
        """Canonical tokens (B, T, S, C) of an (H, W) = `hw` frame grid through every block; returns
        this rank's shard of the last layer's output, canonical, along that layer's axis."""
        blocks, layouts, full = self.plan.blocks, self.layouts, tuple(canonical.shape)
        first = shard(canonical, layouts[0], Split(full[layouts[0]], self.comm.size), self.comm.rank)
        incoming = Handoff(layouts[0], self._slices(layouts[0]))
        incoming.send(0, first)
        for i, (block, kind, axis) in enumerate(zip(blocks, self.plan.kinds, layouts)):
            if i + 1 < len(blocks):
                outgoing = self._outgoing(axis, layouts[i + 1], full, f"{kind}[{i}]")
            else:
                outgoing = Handoff(axis, 1)  # the last layer's slices are joined for the gather
            for k in range(self._slices(axis)):
                piece = incoming.receive(k)  # waits on exactly the chunks this slice needs
                with self.tracer.span(f"{kind}[{i}] slice {k}"):
                    out = self._run_block(block, piece, axis, hw, c, context, mask)
                outgoing.send(k, out)  # starts this slice's switch while the next slice computes
            incoming = outgoing
        return incoming.receive(0)

    def _outgoing(self, axis: int, after: int, full: tuple[int, ...], name: str):
        if after == axis:
            return Handoff(axis, self._slices(after))
        return Switch(self.comm, full, axis, after, self._slices(axis), self._slices(after), self.schedule.overlap, name)

    @staticmethod
    def _run_block(block: nn.Module, piece: Tensor, axis: int, hw, c, context, mask) -> Tensor:
        if piece.numel() == 0:  # a rank holding no frames (T < P) or no positions computes nothing
            return piece
        return block(block_view(piece, axis, hw), c, context, mask).reshape(piece.shape)


class HeadParallel:
    """ulysses: hooks on the model where its blocks and attention already sit; calls its own forward."""

    def __init__(self, model: nn.Module, plan: Plan, comm: Comm, tracer: Tracer, slices: int):
        self.model, self.plan, self.comm, self.tracer, self.slices = model, plan, comm, tracer, slices
        hooks.attach(plan.blocks[0], hooks.ShardHook())
        hooks.attach(model.get_submodule(plan.record.output), hooks.GatherHook())
        for site in plan.head_sites:
            module = model.get_submodule(site.path)
            hooks.attach(module, UlyssesHook(site, access_for(module)))

    def __call__(self, x: Tensor, t: Tensor, context: Tensor, mask) -> Tensor:
        grid = self.plan.record.token_grid(self.model, tuple(x.shape))
        call = UlyssesCall(self.comm, grid, self.slices, keep_frames=not self.plan.full, tracer=self.tracer)
        with hooks.calling(call):
            return self.model(x, t, context, mask)


class ParallelDiT(nn.Module):
    """A video DiT run across a process group; call it like the model (x, t, context, mask)."""

    def __init__(self, model: nn.Module, config: ParallelConfig, runner, slices: int, pair: Comm | None,
                 tracer: Tracer):
        super().__init__()
        self.model, self.config, self.runner, self.pair, self.tracer = model, config, runner, pair, tracer
        self.slices = slices  # resolved: "auto" was measured in parallelize

    def token_grid(self, shape):
        return self.model.token_grid(shape)

    def forward(self, x: Tensor, t: Tensor, context: Tensor, context_mask: Tensor | None = None) -> Tensor:
        with self.tracer.step():
            if self.pair is None:
                return self.runner(x, t, context, context_mask)
            return self._cfg_forward(x, t, context, context_mask)

    def _cfg_forward(self, x, t, context, mask):
        """Conditional and unconditional halves of the batch on the two rank groups, then swapped."""
        if x.shape[0] % 2:
            raise UserError(f"cfg_parallel needs a cond+uncond batch (guidance != 1); got batch {x.shape[0]}")
        half, side = x.shape[0] // 2, self.pair.rank
        pick = slice(side * half, (side + 1) * half)
        v = self.runner(x[pick], t[pick], context[pick], None if mask is None else mask[pick])
        return torch.cat(self.pair.all_gather(v, "cfg halves"))


def _groups(config: ParallelConfig, group, timeout) -> tuple[object, object | None]:
    """(sequence group, CFG pair group or None). Every rank creates every group in the same order."""
    if not config.cfg_parallel:
        return group, None
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    check(len(ranks) % 2 == 0, f"cfg_parallel needs an even number of ranks; got {len(ranks)}")
    half = len(ranks) // 2
    me = dist.get_rank()
    seq = pair = None
    for side in (ranks[:half], ranks[half:]):
        g = dist.new_group(side, timeout=timeout)
        seq = g if me in side else seq
    for i in range(half):
        g = dist.new_group([ranks[i], ranks[half + i]], timeout=timeout)
        pair = g if me in (ranks[i], ranks[half + i]) else pair
    return seq, pair


def _resolve_slices(model, plan: Plan, schedule: Schedule, config: ParallelConfig, comm: Comm,
                    latent_shape) -> int:
    slices = config.requested_slices
    check_slices(plan, schedule, slices)
    if slices != "auto":
        return slices
    if latent_shape is None:
        raise UserError("slices='auto' measures this run's costs first: pass latent_shape=(B, C, T, H, W)")
    from slidefusion.parallel.auto import choose_slices

    return choose_slices(model, plan, schedule, comm, tuple(latent_shape))


def parallelize(model: nn.Module, config: ParallelConfig, group=None, tracer: Tracer | None = None,
                latent_shape: tuple[int, ...] | None = None) -> ParallelDiT:
    """Run `model` (unchanged, shared parameters) across `group` (default: the world) under `config`.

    Needs an initialised process group (see `launch.init_distributed`). `latent_shape` (B, C, T, H, W),
    the batch each sequence group sees, is needed only for slices="auto", which is measured here, once.
    Ulysses attaches in-place hooks that are inert outside a call of the returned module."""
    if not dist.is_initialized():
        raise UserError("parallelize needs torch.distributed initialised; run under torchrun or launch.spawn")
    tracer = tracer or Tracer(rank=dist.get_rank(), enabled=False)
    schedule = SCHEDULES[config.schedule]
    seq, pair = _groups(config, group, datetime.timedelta(seconds=config.timeout_s))
    comm = Comm(seq, tracer, config.link_delay)
    plan = plan_for(model, schedule, ranks=comm.size)
    slices = _resolve_slices(model, plan, schedule, config, comm, latent_shape)
    if schedule.heads:
        runner = HeadParallel(model, plan, comm, tracer, slices)
    else:
        runner = LayerSlices(model, plan, schedule, comm, tracer, slices)
    pair_comm = None if pair is None else Comm(pair, tracer, config.link_delay)
    return ParallelDiT(model, config, runner, slices, pair_comm, tracer)
