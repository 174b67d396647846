"""`--slices auto`: measure this run's compute and transfer costs once, in `parallelize`, and let the
simulator pick the slice count.

The probe is the parallel model itself: a few traced forwards of random latents of the run's shape
(costs do not depend on the values) through `adapter.predict`, unsliced and in 4 slices; the
tracer's spans give each block's pieces (the layer schedules' `kind[i] slice k`, Ulysses' `attn[i]
qkv k`, `attend`, `out k`). Two all-to-all sizes timed on the group give the link. Every rank takes
the maximum of every measurement, so all choose the same count.
"""

import time

import torch
import torch.distributed as dist

from slidefusion.families import TextConditioning
from slidefusion.parallel.layout import Split
from slidefusion.parallel.simulate import FullCosts, Link, StepCosts, best_slices
from slidefusion.parallel.trace import Tracer

PROBE_SLICES = 4


def _time(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` timed calls after a warm-up: on a shared machine the minimum is the
    estimate least disturbed by other processes."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _max(comm, values: list[float]) -> list[float]:
    measured = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=comm.group)
    return measured.tolist()


def _link(comm, numel: int) -> Link:
    """Latency and bandwidth of this group's all-to-all from two transfer sizes."""
    size = comm.size
    small, large = max(1, numel // (8 * size)), max(2, numel // size)

    def seconds(n):
        buffer = torch.zeros(n * size)
        return _time(lambda: comm.all_to_all(buffer, [n] * size, [n] * size, "auto probe").wait())

    t_small, t_large = _max(comm, [seconds(small), seconds(large)])
    per_byte = max(t_large - t_small, 1e-12) / ((large - small) * 4 * (size - 1))
    latency = max(t_small - small * 4 * (size - 1) * per_byte, 0.0)
    return Link(size, size, 1 / per_byte, 1 / per_byte, latency)


class _Probe:
    """Traced forwards of the parallel model; `spans(slices)`: span name -> fastest seconds."""

    def __init__(self, engine, model, latent_shape):
        self.engine, self.model = engine, model
        adapter = engine.plan.adapter
        g = torch.Generator().manual_seed(0)
        b = latent_shape[0]
        self.inputs = (torch.randn(latent_shape, generator=g), torch.full((b,), 0.5 * adapter.objective.scale),
                       TextConditioning(torch.randn(b, 8, adapter.text_width(model), generator=g)))
        self.width = self.values = None
        self.steps: list[dict] = []

    def _capture(self):
        """Token width (first block's input) and values per token (the output module's output)."""
        plan = self.engine.plan

        def first(module, args, kwargs):
            self.width = (args[0] if args else next(iter(kwargs.values()))).shape[-1]

        def out(module, args, result):
            self.values = result.shape[-1]

        return [plan.blocks[0].register_forward_pre_hook(first, with_kwargs=True),
                self.model.get_submodule(plan.access.output).register_forward_hook(out)]

    def spans(self, slices: int, repeats: int = 3) -> dict[str, float]:
        best: dict[str, float] = {}
        for run in range(repeats + 1):  # the first is a warm-up
            tracer = self.engine.probe(lambda: self.engine.plan.adapter.predict(self.model, *self.inputs), slices,
                                       hooks_fn=self._capture if run == 0 else None)
            if run == 0:
                continue
            self.steps.append(tracer.steps[-1])
            for name, category, start, end in tracer.spans:
                if category == "compute":
                    best[name] = min(best.get(name, float("inf")), end - start)
        return best


def _mean(values: list[float]) -> float:
    return sum(values) / max(1, len(values))


def _layer_costs(probe: _Probe, plan, comm) -> StepCosts:
    whole, sliced = probe.spans(1), probe.spans(PROBE_SLICES)

    def per_kind(kind, spans, slices):
        return _mean([sum(spans.get(f"{kind}[{i}] slice {c}", 0.0) for c in range(slices))
                      for i, k in enumerate(plan.kinds) if k == kind])

    spatial, temporal = per_kind("spatial", whole, 1), per_kind("temporal", whole, 1)
    overhead = max(0.0, (per_kind("spatial", sliced, PROBE_SLICES) - spatial) / (PROBE_SLICES - 1))
    spatial, temporal, overhead = _max(comm, [spatial, temporal, overhead])
    tokens = probe.inputs[0].shape[0] * plan.adapter.tokens(probe.model, probe.inputs[0].shape)
    shard_numel = tokens * probe.width // comm.size
    return StepCosts(len(plan.blocks) // 2, spatial, temporal, overhead, shard_numel * 4, _link(comm, shard_numel),
                     gather_bytes=tokens * probe.values // comm.size * 4)


def _full_costs(probe: _Probe, plan, comm) -> FullCosts:
    """Costs of one full-3D block on this rank's shard: the pieces `simulate.FullCosts` names."""
    whole, sliced = probe.spans(1), probe.spans(PROBE_SLICES)
    sites = [site.block for site in plan.head_sites]
    qkv = _mean([whole.get(f"attn[{i}] qkv 0", 0.0) for i in sites])
    attn = _mean([whole.get(f"attn[{i}] attend", 0.0) for i in sites])
    out = _mean([whole.get(f"attn[{i}] out 0", 0.0) for i in sites])
    qkv_sliced = _mean([sum(sliced.get(f"attn[{i}] qkv {k}", 0.0) for k in range(PROBE_SLICES)) for i in sites])
    step = min(s["wall_s"] - s["exposed_comm_s"] for s in probe.steps)  # compute of one forward
    rest = max(0.0, step / len(plan.blocks) - qkv - attn - out)
    qkv, attn, out, rest, overhead = _max(comm, [qkv, attn, out, rest,
                                                 max(0.0, (qkv_sliced - qkv) / (PROBE_SLICES - 1))])
    batch, n_tokens = probe.inputs[0].shape[0], plan.adapter.tokens(probe.model, probe.inputs[0].shape)
    n_local, size, es, width = Split(n_tokens, comm.size).sizes[0], comm.size, 4, probe.width
    return FullCosts(len(plan.blocks), qkv, attn, out, rest, batch * n_local * 3 * width / size * es,
                     batch * n_local * width / size * es, batch * n_local * probe.values * es,
                     _link(comm, batch * n_local * width), slice_overhead_s=overhead)


def measure_costs(engine, model, latent_shape) -> StepCosts | FullCosts:
    """This group's simulator costs for the engine's schedule: measured block pieces (max over
    ranks) and link. `latent_shape` (B, C, T, H, W) is what each sequence group's model call sees."""
    with torch.no_grad():
        probe = _Probe(engine, model, latent_shape)
        return (_full_costs if engine.plan.full else _layer_costs)(probe, engine.plan, engine.comm)


def choose_slices(engine, model, latent_shape, candidates=(1, 2, 4, 8, 16)) -> int:
    """Slice count for the engine's schedule on its group from measured block pieces and all-to-all costs."""
    schedule, plan = engine.schedule, engine.plan
    if engine.comm.size == 1 or not schedule.sliced or (schedule.heads and not plan.full):
        return 1  # Ulysses slices full-3D attention only
    return best_slices(schedule.name, measure_costs(engine, model, latent_shape), candidates)


__all__ = ["Tracer", "choose_slices", "measure_costs"]
