"""`--slices auto`: measure this run's compute and transfer costs once, then let the simulator pick.

All ranks take the maximum of every measurement, so they all choose the same count."""

import time

import torch
import torch.distributed as dist

from slidefusion.parallel.layout import FRAMES, POSITIONS, Split, block_view, shard
from slidefusion.parallel.simulate import Link, StepCosts, best_slices


def _time(fn, repeats: int = 2) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def _block_seconds(engine, canonical, layout, c, context, mask, fraction=1.0) -> float:
    kind = "spatial" if layout == FRAMES else "temporal"
    block = next(b for b, k in zip(engine.blocks, engine.kinds) if k == kind)
    piece = shard(canonical, layout, Split(canonical.shape[layout], engine.comm.size), engine.comm.rank)
    piece = piece.narrow(layout, 0, max(1, int(piece.shape[layout] * fraction))) if piece.shape[layout] else piece
    if piece.numel() == 0:
        return 0.0
    return _time(lambda: block(block_view(piece, layout, engine.grid.hw), c, context, mask))


def _transfer_seconds(engine, numel: int) -> float:
    comm, size = engine.comm, engine.comm.size
    buffer = torch.zeros(numel * size)
    return _time(lambda: comm.all_to_all(buffer, [numel] * size, [numel] * size, "auto probe").wait())


def choose_slices(engine, canonical, c, context, mask, candidates=(1, 2, 4, 8, 16)) -> int:
    """Slice count for `engine`'s schedule from measured block times and all-to-all costs."""
    if not engine.schedule.overlap or engine.comm.size == 1:
        return 1
    with torch.no_grad():
        spatial = _block_seconds(engine, canonical, FRAMES, c, context, mask)
        quarter = _block_seconds(engine, canonical, FRAMES, c, context, mask, 0.25)
        temporal = _block_seconds(engine, canonical, POSITIONS, c, context, mask)
    shard_numel = canonical.numel() // engine.comm.size
    small, large = max(1, shard_numel // (8 * engine.comm.size)), max(1, shard_numel // engine.comm.size)
    t_small, t_large = _transfer_seconds(engine, small), _transfer_seconds(engine, large)
    measured = torch.tensor([spatial, temporal, max(0.0, quarter - spatial / 4), t_small, t_large], dtype=torch.float64)
    dist.all_reduce(measured, op=dist.ReduceOp.MAX, group=engine.comm.group)
    spatial, temporal, overhead, t_small, t_large = measured.tolist()
    per_byte = max(t_large - t_small, 1e-12) / ((large - small) * 4 * (engine.comm.size - 1))
    latency = max(t_small - small * 4 * (engine.comm.size - 1) * per_byte, 0.0)
    link = Link(engine.comm.size, engine.comm.size, 1 / per_byte, 1 / per_byte, latency)
    costs = StepCosts(len(engine.blocks) // 2, spatial, temporal, overhead, shard_numel * 4, link)
    return best_slices(engine.config.schedule, costs, candidates)
