"""`--slices auto`: measure this run's compute and transfer costs once, in `parallelize`, and let the
simulator pick the slice count.

The probe runs the model's own blocks on this rank's shard of random latents of the run's shape
(costs do not depend on the values), and times two all-to-all sizes on the group. Every rank takes
the maximum of every measurement, so all choose the same count. The probe inputs come from our
own models' `embed`; a foreign model's adapter will supply them in phase B.
"""

import time

import torch
import torch.distributed as dist

from slidefusion.parallel.chunked import attention_lse
from slidefusion.parallel.layout import FRAMES, POSITIONS, Split, block_view, shard, to_canonical
from slidefusion.parallel.records import access_for
from slidefusion.parallel.simulate import FullCosts, Link, StepCosts, best_slices


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


def _probe_inputs(model, latent_shape):
    g = torch.Generator().manual_seed(0)
    b = latent_shape[0]
    x = torch.randn(latent_shape, generator=g)
    context = torch.randn(b, 8, model.config.text_dim, generator=g)
    return model.embed(x, torch.full((b,), 0.5), context)  # tokens (B, T, H, W, C), c, context


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


def _layer_costs(model, plan, comm, tokens, c, context) -> StepCosts:
    canonical, hw = to_canonical(tokens), tokens.shape[2:4]

    def block_seconds(layout, fraction=1.0):
        kind = "spatial" if layout == FRAMES else "temporal"
        block = plan.blocks[plan.kinds.index(kind)]
        piece = shard(canonical, layout, Split(canonical.shape[layout], comm.size), comm.rank)
        piece = piece.narrow(layout, 0, max(1, int(piece.shape[layout] * fraction))) if piece.shape[layout] else piece
        if piece.numel() == 0:
            return 0.0
        return _time(lambda: block(block_view(piece, layout, hw), c, context, None))

    spatial, quarter, temporal = _max(comm, [block_seconds(FRAMES), block_seconds(FRAMES, 0.25),
                                             block_seconds(POSITIONS)])
    shard_numel = canonical.numel() // comm.size
    return StepCosts(len(plan.blocks) // 2, spatial, temporal, max(0.0, quarter - spatial / 4), shard_numel * 4,
                     _link(comm, shard_numel))


def _full_costs(model, plan, comm, tokens, c, context) -> FullCosts:
    """Costs of one full-3D block on this rank's shard: the pieces `simulate.FullCosts` names."""
    b, width = tokens.shape[0], tokens.shape[-1]
    seq = tokens.reshape(b, -1, width)  # (B, N, C)
    n_local = Split(seq.shape[1], comm.size).sizes[0]
    local = seq[:, :n_local]
    block, module = plan.blocks[0], model.get_submodule(plan.head_sites[0].path)
    access = access_for(module)
    heads = access.heads(module)
    mine, head_dim = Split(heads, comm.size).sizes[0], width // heads
    qkv_probe = torch.randn(b, seq.shape[1], mine, head_dim)
    quarter = local[:, :max(1, n_local // 4)]
    view = local.reshape(b, 1, n_local, 1, width)
    values = [_time(lambda: access.project(module, local, (), {}, (0, n_local))),
              _time(lambda: access.project(module, quarter, (), {}, (0, quarter.shape[1]))),
              _time(lambda: attention_lse(qkv_probe, qkv_probe, qkv_probe)),
              _time(lambda: access.output(module, torch.randn(b, n_local, heads, head_dim))),
              _time(lambda: block(view, c, context, None)) - _time(lambda: module(view))]
    qkv, qkv_quarter, attn, out, rest = _max(comm, values)
    size, es = comm.size, tokens.element_size()
    return FullCosts(len(plan.blocks), qkv, attn, out, max(rest, 0.0), n_local * 3 * width / size * es,
                     n_local * width / size * es, n_local * width * es, _link(comm, n_local * width),
                     slice_overhead_s=max(0.0, qkv_quarter - qkv / 4))


def measure_costs(model, plan, schedule, comm, latent_shape) -> StepCosts | FullCosts:
    """This group's simulator costs for `schedule`: measured block pieces (max over ranks) and link."""
    with torch.no_grad():
        tokens, c, context = _probe_inputs(model, latent_shape)
        return (_full_costs if plan.full else _layer_costs)(model, plan, comm, tokens, c, context)


def choose_slices(model, plan, schedule, comm, latent_shape, candidates=(1, 2, 4, 8, 16)) -> int:
    """Slice count for `schedule` on this group from measured block pieces and all-to-all costs."""
    if comm.size == 1 or not schedule.sliced or (schedule.heads and not plan.full):
        return 1  # Ulysses slices full-3D attention only
    return best_slices(schedule.name, measure_costs(model, plan, schedule, comm, latent_shape), candidates)
