"""The U x R grids of the ring schedules: process groups built once, every rank alike.

Ranks of a sequence group are numbered p = r * U + u: Ulysses group r holds the U consecutive ranks
r * U .. r * U + U - 1 (consecutive tokens; one node when U divides the GPUs per node, so the head
all-to-all stays on NVLink), ring u the R ranks u, U + u, 2U + u, ... (the same heads). Every rank
of the job creates every subgroup of every sequence group in the same order, as `new_group` needs.
"""

import datetime

import torch.distributed as dist

from slidefusion.parallel.comm import Comm
from slidefusion.parallel.plan import ParallelConfig
from slidefusion.parallel.ring import Grid


def sequence_groups(config: ParallelConfig, group=None) -> list[list[int]]:
    """The global ranks of every sequence group, as `engine._groups` cut them (CFG-parallel halves)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    if not config.cfg_parallel:
        return [ranks]
    half = len(ranks) // 2
    return [ranks[:half], ranks[half:]]


def factorizations(ranks: int, heads: int) -> list[tuple[int, int]]:
    """Every (U, R) with U x R = ranks and U <= heads, Ulysses-heaviest first."""
    return [(u, ranks // u) for u in range(ranks, 0, -1) if ranks % u == 0 and u <= heads]


def _subgroup(comm: Comm, members_of: list[list[int]], timeout) -> Comm | None:
    me, mine = dist.get_rank(), None
    for members in members_of:
        group = dist.new_group(members, timeout=timeout)
        mine = group if me in members else mine
    return None if mine is None else comm.sub(mine)


def build_grids(comm: Comm, sequences: list[list[int]], degrees: list[tuple[int, int]],
                timeout_s: float) -> dict[tuple[int, int], Grid]:
    """This rank's `Grid` for each (U, R) in `degrees`; `comm` is its sequence group. A degree of 1
    needs no group; a degree equal to the group's size is the sequence group itself."""
    timeout = datetime.timedelta(seconds=timeout_s)
    grids = {}
    for u, r in degrees:
        ulysses = ring = None
        if u > 1:
            ulysses = comm if r == 1 else _subgroup(comm, [seq[i * u:(i + 1) * u] for seq in sequences
                                                           for i in range(r)], timeout)
        if r > 1:
            ring = comm if u == 1 else _subgroup(comm, [seq[j::u] for seq in sequences for j in range(u)], timeout)
        grids[u, r] = Grid(ulysses, ring, (u, r))
    return grids
