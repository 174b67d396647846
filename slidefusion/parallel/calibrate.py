"""Calibrate the cost model on this run and set the ring schedules up (`engine.parallelize` calls
`setup_ring`; `tune` also serves `ulysses --slices auto` on full-3D models).

The probe is the parallel model itself: forwards of random latents of the run's shape (costs do not
depend on the values) through `adapter.predict`, on a base schedule (plain Ulysses where the heads
allow it, else ring), unsliced and in `PROBE_SLICES` slices. Its spans give one block's pieces; the
two step times give the fixed cost of one more compute call; two all-to-all sizes give the link.
`cost.py` ranks every candidate on those numbers, the shortlist is timed (each a warm-up and two
forwards), and the pick is made on the clock. Every measurement is the maximum over the ranks of
`group` (both CFG halves too), so every rank makes the same choice.
"""

import math
from contextlib import contextmanager
from dataclasses import asdict

import torch
import torch.distributed as dist

from slidefusion.core.errors import UserError
from slidefusion.parallel import cost
from slidefusion.parallel.auto import _link, _Probe
from slidefusion.parallel.grid import build_grids, factorizations, sequence_groups
from slidefusion.parallel.plan import ParallelConfig, ring_degrees
from slidefusion.parallel.simulate_ring import calls
from slidefusion.parallel.trace import Tracer

PROBE_SLICES = 4
TIMED_RUNS = 2


def setup_ring(model, engine, config: ParallelConfig, group, latent_shape) -> None:
    """Build the grids a ring schedule needs and choose (U, R) and slices where `config` leaves them
    open (`--parallel auto`, `--slices auto`); sets `engine.grid`, `engine.slices`, `engine.tuning`."""
    plan, comm = engine.plan, engine.comm
    sequences = sequence_groups(config, group)
    if comm.size == 1:  # nothing to split (CFG-parallel on 2 ranks): the model runs whole on each
        engine.grid, engine.slices = None, 1
        return
    if config.schedule == "auto":  # plan_for refused a window operator on more ranks than heads
        degrees = factorizations(comm.size, plan.heads) if plan.dense else [(comm.size, 1)]
    else:
        degrees = [ring_degrees(config, comm.size, plan.heads)]
    grids = build_grids(comm, sequences, [d for d in degrees if d != (comm.size, 1)], config.timeout_s)
    grids[comm.size, 1] = None  # plain Ulysses runs as itself (`UlyssesCall`), not as a ring of one
    slices = config.requested_slices
    if len(degrees) == 1 and slices != "auto":
        engine.grid, engine.slices = grids[degrees[0]], slices
        return
    fixed = None if slices == "auto" else (slices,)
    choice = tune(model, engine, group, latent_shape, grids, fixed)
    engine.grid, engine.slices = grids[choice.ulysses, choice.ring], choice.slices


def tune(model, engine, group, latent_shape, grids: dict, slices=None) -> cost.Candidate:
    """Measure, rank, time the shortlist, pick; `grids` maps each allowed (U, R) to its `Grid` (None:
    plain Ulysses). `slices`: the allowed slice counts (None: `cost.SLICES`). Sets `engine.tuning`."""
    if latent_shape is None:
        raise UserError("slices='auto' and --parallel auto measure this run's costs first: pass "
                        "latent_shape=(B, C, T, H, W)")
    plan, size = engine.plan, engine.comm.size
    options = cost.candidates(size, plan.heads, plan.dense, list(grids), slices or cost.SLICES)
    plain = cost.Candidate(size, 1, 1)
    baseline = plain if plain in options else min(options, key=lambda c: (c.slices, -c.ulysses))
    if len(options) == 1:
        engine.tuning = {"choice": str(baseline), "timed_s": {}, "predicted_s": {}}
        return baseline
    with torch.no_grad():
        runner = _Runner(engine, model, latent_shape, grids, group)
        measured, times = runner.measure(baseline, plan.dense and (slices is None or PROBE_SLICES in slices))
        ranked = cost.rank(measured, options)
        for c in cost.shortlist(ranked, baseline):
            if c not in times:
                times[c] = runner.time(c)
    choice = cost.pick(times, baseline)
    engine.tuning = {"choice": str(choice), "measured": asdict(measured), "timed_s": {str(c): t for c, t in times.items()},
                     "predicted_s": {str(c): t for t, c in ranked}}
    return choice


class _Runner:
    """Forwards of the parallel model under one candidate at a time, traced."""

    def __init__(self, engine, model, latent_shape, grids: dict, group):
        self.engine, self.grids, self.group = engine, grids, group
        self.probe = _Probe(engine, model, latent_shape)
        self.latent_shape = latent_shape

    def _agree(self, values: list[float]) -> list[float]:
        """The maximum over every rank of the parallelized group (both CFG halves decide alike)."""
        measured = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=self.group)
        return measured.tolist()

    @contextmanager
    def _trying(self, c: cost.Candidate):
        engine = self.engine
        grid = self.grids[c.ulysses, c.ring]
        comms = [engine.comm] + ([] if grid is None else [x for x in (grid.ulysses, grid.ring) if x is not None])
        saved = engine.grid, engine.slices, engine.tracer, engine.pair, [x.tracer for x in comms]
        tracer = Tracer(rank=engine.comm.global_rank, enabled=True)
        engine.grid, engine.slices, engine.tracer, engine.pair = grid, c.slices, tracer, None
        for x in comms:
            x.tracer = tracer
        try:
            yield tracer
        finally:
            engine.grid, engine.slices, engine.tracer, engine.pair, tracers = saved
            for x, t in zip(comms, tracers):
                x.tracer = t

    def run(self, c: cost.Candidate, capture: bool = False) -> list[Tracer]:
        """A warm-up and `TIMED_RUNS` forwards under `c`; their tracers."""
        out = []
        for i in range(TIMED_RUNS + 1):
            with self._trying(c) as tracer:
                handles = self.probe._capture() if capture and i == 0 else []
                try:
                    self.engine.plan.adapter.predict(self.probe.model, *self.probe.inputs)
                finally:
                    for handle in handles:
                        handle.remove()
            if i:
                out.append(tracer)
        return out

    def time(self, c: cost.Candidate) -> float:
        """The fastest step of `c` on the slowest rank."""
        return self._agree([min(t.steps[-1]["wall_s"] for t in self.run(c))])[0]

    def measure(self, base: cost.Candidate, sliced: bool) -> tuple[cost.Measured, dict]:
        """The cost model's numbers from `base` unsliced (and in PROBE_SLICES slices when `sliced`),
        plus the step times those forwards took."""
        whole = self.run(base, capture=True)
        pieces = _pieces(whole, self.engine.plan)
        compute = [min(t.steps[-1]["wall_s"] - t.steps[-1]["exposed_comm_s"] for t in whole)]
        times = {base: min(t.steps[-1]["wall_s"] for t in whole)}
        if sliced:
            cut = cost.Candidate(base.ulysses, base.ring, PROBE_SLICES)
            runs = self.run(cut)
            compute.append(min(t.steps[-1]["wall_s"] - t.steps[-1]["exposed_comm_s"] for t in runs))
            times[cut] = min(t.steps[-1]["wall_s"] for t in runs)
        return self._measured(base, pieces, compute), dict(zip(times, self._agree(list(times.values()))))

    def _measured(self, base: cost.Candidate, pieces: list[float], compute: list[float]) -> cost.Measured:
        engine, probe = self.engine, self.probe
        plan, comm = engine.plan, engine.comm
        blocks = len(plan.blocks)
        qkv, attn, out = pieces
        rest = max(0.0, compute[0] / blocks - qkv - attn - out)
        extra = calls(PROBE_SLICES, base.ring) - calls(1, base.ring)
        call_s = max(0.0, (compute[1] - compute[0]) / (blocks * extra)) if len(compute) > 1 else 0.0
        batch, tokens = self.latent_shape[0], plan.adapter.tokens(probe.model, self.latent_shape)
        local = math.ceil(tokens / comm.size)
        link = _link(comm, batch * local * probe.width)
        qkv, attn, out, rest, call_s, latency, per_byte = self._agree(
            [qkv, attn, out, rest, call_s, link.latency_s, 1 / link.intra_Bps])
        mine = math.ceil(plan.heads / base.ulysses)
        unit = attn / (batch * mine * base.ulysses * local * tokens)
        return cost.Measured(comm.size, plan.heads, tokens, batch, probe.width, probe.values, blocks, qkv, out,
                             rest, unit, latency, 1 / per_byte, call_s)


def _pieces(tracers: list[Tracer], plan) -> list[float]:
    """(qkv, attention, output projection) seconds of one block: the fastest run's spans, averaged
    over the attention sites."""
    sites = [site.block for site in plan.head_sites]
    best: dict[str, float] = {}
    for tracer in tracers:
        per: dict[str, float] = {}
        for name, category, start, end in tracer.spans:
            if category == "compute" and name.startswith("attn["):
                site, _, piece = name.partition("] ")
                key = f"{site}] " + ("attend" if piece.startswith(("attend", "ring ")) else piece)
                per[key] = per.get(key, 0.0) + end - start
        for key, value in per.items():
            best[key] = min(best.get(key, math.inf), value)

    def mean(piece: str) -> float:
        return sum(best.get(f"attn[{i}] {piece}", 0.0) for i in sites) / max(1, len(sites))

    return [mean("qkv 0"), mean("attend"), mean("out 0")]
