"""The cost model behind `--parallel auto` and `--slices auto` on full-3D models: from measured
numbers to a ranking of (U, R, slices) candidates, a shortlist to time, and the pick.

Measured (`calibrate.py`, on the first step of the run, max over ranks): one block's per-token work
(projection, output projection, the rest) on this rank's tokens, softmax attention per
head x query x key, the link's latency and bandwidth, and the fixed cost of one more attention or
projection call (from the same forward run unsliced and sliced, so launches, smaller matrices and
the merges are all in it). Each candidate's step is the simulator's (`simulate_ring.py`) on those
numbers; U x R = P with U <= heads, ring is U = 1, plain Ulysses R = 1.

The model ranks; the clock decides. Plain Ulysses (where the heads allow it) and the best few
predicted candidates are timed on the model itself, and the fastest timed one wins, but plain
Ulysses keeps its place unless another beats it by more than `MARGIN`: a choice can then be no
slower than plain Ulysses by more than the timing noise, whatever the model got wrong.
"""

import math
from dataclasses import dataclass

from slidefusion.parallel.simulate import Link
from slidefusion.parallel.simulate_ring import P2P, UspCosts, step_estimate

SLICES = (1, 2, 4, 8)  # candidates; the probe measures 1 and 4, and every choice is timed before it is taken
SHORTLIST = 3  # predicted-best candidates timed besides plain Ulysses
MARGIN = 0.01  # a candidate must beat plain Ulysses by this share of its time to replace it


@dataclass(frozen=True)
class Candidate:
    ulysses: int
    ring: int
    slices: int

    @property
    def schedule(self) -> str:
        return "ulysses" if self.ring == 1 else "ring" if self.ulysses == 1 else "usp"

    def __str__(self) -> str:
        degrees = {"ulysses": "", "ring": "", "usp": f" {self.ulysses}x{self.ring}"}[self.schedule]
        return f"{self.schedule}{degrees} --slices {self.slices}"


@dataclass(frozen=True)
class Measured:
    """One sequence group's numbers (synthetic in tests). ranks P, heads H, tokens N per sample,
    batch B of attention groups, width C, out_values per token of the output module, blocks,
    element_size in bytes; qkv_s / out_s / rest_s: one block's work on the busiest rank's ceil(N/P)
    tokens; attn_unit_s: softmax attention per head x query x key; latency_s / Bps: one transfer;
    call_s: the fixed cost of one more compute call."""

    ranks: int
    heads: int
    tokens: int
    batch: int
    width: int
    out_values: int
    blocks: int
    qkv_s: float
    out_s: float
    rest_s: float
    attn_unit_s: float
    latency_s: float
    Bps: float
    call_s: float = 0.0
    element_size: int = 4


def usp_costs(m: Measured, ulysses: int, ring: int) -> UspCosts:
    """The simulator's costs of U x R on these numbers; every transfer shares the one measured link."""
    local = math.ceil(m.tokens / m.ranks)  # the busiest rank's tokens
    mine, es = math.ceil(m.heads / ulysses), m.element_size
    shard = m.batch * local * m.width * es  # this rank's hidden tokens, bytes
    link = Link(ulysses, ulysses, m.Bps, m.Bps, m.latency_s)
    return UspCosts(
        blocks=m.blocks, ulysses=ulysses, ring=ring, qkv_s=m.qkv_s, out_s=m.out_s, rest_s=m.rest_s,
        attn_s=m.attn_unit_s * m.batch * mine * (ulysses * local) * m.tokens,
        qkv_peer_bytes=3 * shard / ulysses, out_peer_bytes=shard / ulysses,
        block_bytes=2 * shard * ulysses * mine / m.heads,  # the group's tokens, keys and values of this rank's heads
        gather_peer_bytes=m.batch * local * m.out_values * es,
        ulysses_link=link, ring_link=P2P(m.latency_s, m.Bps), gather_link=Link(m.ranks, m.ranks, m.Bps, m.Bps, m.latency_s),
        slice_overhead_s=m.call_s)


def predict(m: Measured, c: Candidate) -> float:
    return step_estimate(usp_costs(m, c.ulysses, c.ring), c.slices)


def candidates(ranks: int, heads: int, dense: bool, degrees=None, slices=SLICES) -> list[Candidate]:
    """Every candidate a model allows: U x R = ranks, U <= heads; sliced or ring only for dense
    softmax attention (key chunks merge by log-sum-exp). `degrees` / `slices` restrict them."""
    out = []
    for u in range(ranks, 0, -1):
        r = ranks // u
        if ranks % u or u > heads or (degrees is not None and (u, r) not in degrees):
            continue
        for n in slices:
            if dense or (r == 1 and n == 1):
                out.append(Candidate(u, r, n))
    return out


def rank(m: Measured, options: list[Candidate]) -> list[tuple[float, Candidate]]:
    """(predicted step seconds, candidate), fastest first; ties go to fewer slices, then more Ulysses."""
    return sorted(((predict(m, c), c) for c in options), key=lambda pc: (round(pc[0], 12), pc[1].slices,
                                                                           -pc[1].ulysses))


def shortlist(ranked: list[tuple[float, Candidate]], baseline: Candidate | None, size: int = SHORTLIST) -> list[Candidate]:
    """What to time: the baseline (plain Ulysses, or the unsliced fixed schedule) and the `size` best predicted."""
    out = [] if baseline is None else [baseline]
    for _, c in ranked:
        if len(out) >= size + (baseline is not None):
            break
        if c not in out:
            out.append(c)
    return out


def pick(times: dict[Candidate, float], baseline: Candidate | None, margin: float = MARGIN) -> Candidate:
    """The fastest timed candidate; the baseline unless another is faster by more than `margin`."""
    best = min(times, key=lambda c: (times[c], c.slices, -c.ulysses))
    if baseline in times and times[best] > times[baseline] * (1 - margin):
        return baseline
    return best
