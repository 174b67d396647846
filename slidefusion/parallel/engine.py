"""`parallelize`: the one generic function that reads a plan and a schedule and runs an unchanged
model sequence-parallel (and optionally CFG-parallel) on a process group. It reads as a recipe:
build the groups, plan the model, attach the hooks, resolve the slice count.

Everything is an in-place hook (`hooks.py`), so the model's own forward - and whatever calls it:
our sampler, a diffusers scheduler loop, `adapter.predict` - runs unchanged on every rank:
  - on the model itself, `Engine`: per call, the token grid (`adapter.grid_from_call`), CFG-parallel
    halves, per-token call arguments cut to this rank; it hands the per-call record to the others;
  - ulysses: the first block shards the tokens, each attention site trades tokens for heads
    (`ulysses.py`), temporal blocks cut their per-row arguments;
  - dsp / scalefusion / scalefusion-inter: every block switches to the layout it needs (`layers.py`);
  - per-token side outputs (Wan's rotary table) are cut to this rank's tokens;
  - the token-wise output module runs on the shard and only its output is gathered (16-64 values
    per token instead of the width), so the model returns the whole prediction on every rank.
"""

import datetime

import torch
import torch.distributed as dist
from torch import Tensor, nn

from slidefusion.core import hooks as registry
from slidefusion.core.errors import UserError, check
from slidefusion.parallel import hooks
from slidefusion.parallel.comm import Comm
from slidefusion.parallel.layers import LayerCall, LayerHook
from slidefusion.parallel.layout import FRAMES, POSITIONS
from slidefusion.parallel.plan import SCHEDULES, ParallelConfig, Plan, Schedule, check_slices, plan_for
from slidefusion.parallel.records import access_for
from slidefusion.parallel.ring import RingCall, RingHook
from slidefusion.parallel.tokens import Tokens
from slidefusion.parallel.trace import Tracer
from slidefusion.parallel.ulysses import UlyssesCall, UlyssesHook


class Engine:
    """The hook on the model itself: one parallel call per model call. `slices` is resolved
    ("auto" measured in `parallelize`); `pair` is the CFG-parallel pair's Comm, or None."""

    def __init__(self, plan: Plan, schedule: Schedule, comm: Comm, pair: Comm | None, tracer: Tracer):
        self.plan, self.schedule, self.comm, self.pair, self.tracer = plan, schedule, comm, pair, tracer
        self.slices = 1
        self.grid = None  # ring / usp: this rank's U x R groups (`ring.Grid`); None: Ulysses or a layer schedule
        self.tuning: dict | None = None  # what `calibrate.tune` measured and chose, when it ran

    @property
    def cfg_batch(self) -> bool:
        """The model must be called with conditional and unconditional halves in one batch (what
        CFG-parallel splits); samplers read this off the hook (`slidefusion.core.hooks`)."""
        return self.pair is not None

    def __call__(self, model: nn.Module, call_next, *args, **kwargs):
        if hooks.current_call() is not None:  # a call made from inside a parallel call: already set up
            return call_next(*args, **kwargs)
        bound = hooks.bind(model, args, kwargs)
        with self.tracer.step():
            if self.pair is None:
                return self.run(model, bound, call_next)
            return self._cfg(model, bound, call_next)

    def run(self, model: nn.Module, bound, call_next):
        """One model call across the sequence group."""
        hidden = bound.arguments[hooks.first_argument(bound)]
        grid = self.plan.adapter.grid_from_call(model, bound.args[1:], bound.kwargs)
        tokens = Tokens(tuple(grid), int(hidden.shape[0]), not self.plan.full, self.plan.access.layout,
                        self.comm.size, self.comm.rank)
        for name, dim in self.plan.access.token_args.items():
            value = bound.arguments.get(name)
            if isinstance(value, Tensor) and value.ndim > dim:
                bound.arguments[name] = tokens.cut(value, dim)
        with hooks.calling(self._call(tokens)):
            return hooks.call_bound(call_next, bound)

    def probe(self, fn, slices: int, hooks_fn=None) -> Tracer:
        """Run `fn()` (a call of the model) with `slices`, no CFG pair and a fresh enabled tracer,
        which it returns (`auto.py` reads its spans). `hooks_fn()` may register torch hooks for the
        run and return their handles."""
        saved = self.slices, self.tracer, self.pair, self.comm.tracer
        tracer = Tracer(rank=self.comm.global_rank, enabled=True)
        self.slices, self.tracer, self.pair, self.comm.tracer = slices, tracer, None, tracer
        handles = hooks_fn() if hooks_fn is not None else []
        try:
            fn()
        finally:
            self.slices, self.tracer, self.pair, self.comm.tracer = saved
            for handle in handles:
                handle.remove()
        return tracer

    def _call(self, tokens: Tokens):
        if self.schedule.heads and self.grid is not None:
            return RingCall(self.comm, tokens, self.slices, self.tracer, self.grid)
        if self.schedule.heads:
            return UlyssesCall(self.comm, tokens, self.slices, self.tracer)
        counts = (self.schedule.slices(FRAMES, self.slices), self.schedule.slices(POSITIONS, self.slices))
        return LayerCall(self.comm, tokens, tuple(self.plan.kinds), counts, self.schedule.overlap,
                         dict(self.plan.access.rows), self.plan.access.chained, self.tracer)

    def _cfg(self, model: nn.Module, bound, call_next):
        """Conditional and unconditional halves of the batch on the two rank groups, then swapped."""
        batch = bound.arguments[hooks.first_argument(bound)].shape[0]
        if batch % 2:
            raise UserError(f"cfg_parallel needs a cond+uncond batch (guidance != 1); got batch {batch}")
        half, side = batch // 2, self.pair.rank
        for name in self.plan.access.batched:
            value = bound.arguments.get(name)
            if isinstance(value, Tensor) and value.ndim > 0 and value.shape[0] == batch:
                bound.arguments[name] = value.narrow(0, side * half, half)
        return _join_halves(self.pair, self.run(model, bound, call_next))


def _join_halves(pair: Comm, out):
    """Concatenate both groups' outputs along the batch: a tensor, a tuple of them, or a diffusers
    output dataclass (a mapping)."""
    if isinstance(out, Tensor):
        return torch.cat(pair.all_gather(out.contiguous(), "cfg halves"))
    if isinstance(out, tuple):
        return type(out)(_join_halves(pair, o) if isinstance(o, Tensor) else o for o in out)
    return type(out)(**{k: _join_halves(pair, v) if isinstance(v, Tensor) else v for k, v in out.items()})


class ParallelDiT(nn.Module):
    """The handle `parallelize` returns: calling it calls the (hooked) model, which is itself
    parallel now; attributes not found here are the model's. `detach()` restores the model."""

    def __init__(self, model: nn.Module, engine: Engine, config: ParallelConfig):
        super().__init__()
        self.model, self.config = model, config
        object.__setattr__(self, "engine", engine)  # not a submodule

    @property
    def slices(self) -> int:
        return self.engine.slices

    @property
    def tracer(self) -> Tracer:
        return self.engine.tracer

    def forward(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def detach(self) -> nn.Module:
        """Remove every parallel hook; the model runs as a single process again."""
        hooks.detach_all(self.model)
        return self.model

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["model"], name)


def attach_hooks(model: nn.Module, plan: Plan, schedule: Schedule) -> None:
    """The schedule's hooks where the model's modules already sit (replacing earlier ones)."""
    access = plan.access
    hooks.detach_all(model)
    registry.refuse_hooks(model, hooks.REFUSED)
    hooks.attach(model.get_submodule(access.output), "gather", hooks.GatherHook())
    for path, dim in access.token_outputs.items():
        hooks.attach(model.get_submodule(path), "tokens", hooks.TokenHook(dim))
    if not schedule.heads:
        for i, block in enumerate(plan.blocks):
            hooks.attach(block, "layer", LayerHook(i))
        return
    hooks.attach(plan.blocks[0], "shard", hooks.ShardHook(plan.kinds[0]))
    for block, kind in zip(plan.blocks, plan.kinds):
        if kind == "temporal" and access.rows.get(kind):
            hooks.attach(block, "rows", hooks.RowsHook(access.rows[kind]))
    # RingHook runs Ulysses calls too (auto may choose them); one name either way: the head-site hook.
    hook = RingHook if schedule.ring else UlyssesHook
    for site in plan.head_sites:
        module = model.get_submodule(site.path)
        hooks.attach(module, "ring" if schedule.ring else "ulysses", hook(site, access_for(module)))


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


def _resolve_slices(model, engine: Engine, config: ParallelConfig, latent_shape, group) -> int:
    slices = config.requested_slices
    check_slices(engine.plan, engine.schedule, slices)
    if slices != "auto":
        return slices
    if latent_shape is None:
        raise UserError("slices='auto' measures this run's costs first: pass latent_shape=(B, C, T, H, W)")
    if engine.schedule.heads and engine.plan.full and engine.comm.size > 1:  # the cost model of calibrate.py
        from slidefusion.parallel.calibrate import tune

        return tune(model, engine, group, latent_shape, {(engine.comm.size, 1): None}).slices
    from slidefusion.parallel.auto import choose_slices

    return choose_slices(engine, model, tuple(latent_shape))


def parallelize(model: nn.Module, config: ParallelConfig, group=None, tracer: Tracer | None = None,
                latent_shape: tuple[int, ...] | None = None) -> ParallelDiT:
    """Run `model` (unchanged, shared parameters) across `group` (default: the world) under `config`.

    Attaches in-place hooks, so from now on calling `model` itself runs it in parallel (every rank
    must make the same calls); the returned handle calls it too and can `detach()` the hooks.
    Needs an initialised process group (see `launch.init_distributed`). `latent_shape` (B, C, T, H, W),
    the batch each sequence group sees, is needed only for slices="auto", which is measured here, once."""
    if not dist.is_initialized():
        raise UserError("parallelize needs torch.distributed initialised; run under torchrun or launch.spawn")
    tracer = tracer or Tracer(rank=dist.get_rank(), enabled=False)
    schedule = SCHEDULES[config.schedule]
    seq, pair = _groups(config, group, datetime.timedelta(seconds=config.timeout_s))
    comm = Comm(seq, tracer, config.link_delay)
    plan = plan_for(model, schedule, ranks=comm.size)
    check_slices(plan, schedule, config.requested_slices)
    attach_hooks(model, plan, schedule)
    pair_comm = None if pair is None else Comm(pair, tracer, config.link_delay)
    engine = Engine(plan, schedule, comm, pair_comm, tracer)
    hooks.attach(model, "engine", engine)
    if schedule.ring:  # the U x R groups, and the choices auto leaves open
        from slidefusion.parallel.calibrate import setup_ring

        setup_ring(model, engine, config, group, latent_shape)
    else:
        engine.slices = _resolve_slices(model, engine, config, latent_shape, group)
    return ParallelDiT(model, engine, config)
