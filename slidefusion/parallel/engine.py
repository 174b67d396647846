"""`parallelize`: the one generic function that reads a plan and a schedule and runs an unchanged
model sequence-parallel (and optionally CFG-parallel) on a process group.

Every rank embeds the full latents (a cheap patch convolution), keeps its shard, runs the blocks
layer by layer in slices, gathers the tokens and applies the model's own head, so the sampler sees
the full velocity on every rank and stays identical everywhere. Only layer outputs move between
ranks; the blocks' math is the model's.
"""

import torch
import torch.distributed as dist
from torch import Tensor, nn

from slidefusion.adapters import adapter_for
from slidefusion.errors import UserError, check
from slidefusion.parallel.comm import Comm
from slidefusion.parallel.layout import FRAMES, POSITIONS, Split, block_view, local_slices, shard, to_canonical
from slidefusion.parallel.plan import SCHEDULES, BlockRule, ParallelConfig, plan_for
from slidefusion.parallel.switch import Handoff, Switch
from slidefusion.parallel.trace import Tracer
from slidefusion.parallel.ulysses import GridShape, ulysses_view


class ParallelDiT(nn.Module):
    """A VideoDiT run across a process group; call it like the model (x, t, context, mask)."""

    def __init__(self, model: nn.Module, config: ParallelConfig, comm: Comm, pair: Comm | None, tracer: Tracer):
        super().__init__()
        self.model, self.config, self.comm, self.pair, self.tracer = model, config, comm, pair, tracer
        self.schedule = SCHEDULES[config.schedule]
        self.plan = plan_for(model, self.schedule)
        self.grid = GridShape()
        self.slices = config.slices if isinstance(config.slices, int) else None  # "auto": chosen on first call
        adapter = adapter_for(model)
        self.blocks, self.kinds = adapter.blocks(model), adapter.block_kinds(model)
        self.runners = [self._runner(i, block, kind) for i, (block, kind) in enumerate(zip(self.blocks, self.kinds))]

    def _runner(self, index: int, block: nn.Module, kind: str) -> nn.Module:
        rule = self.plan[kind]
        if self.schedule.heads and rule.grid != "time":  # time attention is local when sharded by positions
            return ulysses_view(block, rule.attention, rule.grid, self.comm, self.grid, f"{kind}[{index}]")
        return block

    def layout(self, kind: str) -> int:
        """Ulysses keeps every block on positions; the sequence-parallel schedules follow the plan."""
        return POSITIONS if self.schedule.heads else self.plan[kind].layout

    def token_grid(self, shape):
        return self.model.token_grid(shape)

    def forward(self, x: Tensor, t: Tensor, context: Tensor, context_mask: Tensor | None = None) -> Tensor:
        with self.tracer.step():
            if self.pair is None:
                return self._forward(x, t, context, context_mask)
            return self._cfg_forward(x, t, context, context_mask)

    def _cfg_forward(self, x, t, context, mask):
        """Conditional and unconditional halves of the batch on the two rank groups, then swapped."""
        if x.shape[0] % 2:
            raise UserError(f"cfg_parallel needs a cond+uncond batch (guidance != 1); got batch {x.shape[0]}")
        half, side = x.shape[0] // 2, self.pair.rank
        pick = slice(side * half, (side + 1) * half)
        v = self._forward(x[pick], t[pick], context[pick], None if mask is None else mask[pick])
        return torch.cat(self.pair.all_gather(v, "cfg halves"))

    def _forward(self, x, t, context, mask):
        model = self.model
        with self.tracer.span("embed"):
            tokens, c, context = model.embed(x, t, context)  # (B, T, H, W, C) on every rank
        b, frames, h, w, width = tokens.shape
        self.grid.hw = (h, w)
        canonical = to_canonical(tokens)  # (B, T, S, C)
        if self.slices is None:
            from slidefusion.parallel.auto import choose_slices

            self.slices = choose_slices(self, canonical, c, context, mask)
        out = self._run_blocks(canonical, c, context, mask)
        with self.tracer.span("head"):
            return model.head(out.view(b, frames, h, w, width), c)

    def _slices(self, layout: int) -> int:
        return self.schedule.slices(layout, self.slices)

    def _run_blocks(self, canonical: Tensor, c: Tensor, context: Tensor, mask) -> Tensor:
        blocks, full = self.blocks, tuple(canonical.shape)
        layouts = [self.layout(kind) for kind in self.kinds]
        first = shard(canonical, layouts[0], Split(full[layouts[0]], self.comm.size), self.comm.rank)
        incoming = Handoff(layouts[0], self._slices(layouts[0]))
        incoming.send(0, first)
        for i, (block, runner, axis) in enumerate(zip(blocks, self.runners, layouts)):
            if i + 1 < len(blocks):
                outgoing = self._outgoing(axis, layouts[i + 1], full, f"{self.kinds[i]}[{i}]")
            else:
                outgoing = Handoff(axis, 1)  # the last layer's slices are joined for the gather
            for k in range(self._slices(axis)):
                piece = incoming.receive(k)  # waits on exactly the chunks this slice needs
                with self.tracer.span(f"{self.kinds[i]}[{i}] slice {k}"):
                    out = self._run_block(runner, piece, axis, c, context, mask)
                outgoing.send(k, out)  # starts this slice's switch while the next slice computes
            incoming = outgoing
        return self._gather(incoming.receive(0), layouts[-1], full)

    def _outgoing(self, axis: int, after: int, full: tuple[int, ...], name: str):
        if after == axis:
            return Handoff(axis, self._slices(after))
        return Switch(self.comm, full, axis, after, self._slices(axis), self._slices(after), self.schedule.overlap, name)

    def _run_block(self, runner: nn.Module, piece: Tensor, axis: int, c, context, mask) -> Tensor:
        # A rank holding no frames (T < P) or no positions has nothing to compute, unless the block
        # itself communicates (Ulysses), in which case it must still take part.
        if piece.numel() == 0 and not self.schedule.heads:
            return piece
        out = runner(block_view(piece, axis, self.grid.hw), c, context, mask)
        return out.reshape(piece.shape)

    def _gather(self, local: Tensor, axis: int, full: tuple[int, ...]) -> Tensor:
        """Every rank's shard -> the full canonical tokens; shards are padded to one size for gloo."""
        split = Split(full[axis], self.comm.size)
        size = max(split.sizes)
        pad = list(local.shape)
        pad[axis] = size - local.shape[axis]
        padded = torch.cat([local, local.new_zeros(pad)], dim=axis)
        with self.tracer.span("gather tokens", "compute"):
            pieces = self.comm.all_gather(padded, "gather tokens")
        return torch.cat([p.narrow(axis, 0, n) for p, n in zip(pieces, split.sizes)], dim=axis)


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


def parallelize(model: nn.Module, config: ParallelConfig, group=None, tracer: Tracer | None = None) -> ParallelDiT:
    """Wrap `model` (unchanged, shared parameters) to run across `group` (default: the world)
    under `config`. Needs an initialised process group; see `launch.init_distributed`."""
    if not dist.is_initialized():
        raise UserError("parallelize needs torch.distributed initialised; run under torchrun or launch.spawn")
    import datetime

    tracer = tracer or Tracer(rank=dist.get_rank(), enabled=False)
    seq, pair = _groups(config, group, datetime.timedelta(seconds=config.timeout_s))
    comm = Comm(seq, tracer, config.link_delay)
    pair_comm = None if pair is None else Comm(pair, tracer, config.link_delay)
    return ParallelDiT(model, config, comm, pair_comm, tracer)
