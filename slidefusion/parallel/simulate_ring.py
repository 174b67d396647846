"""The simulator's op graph for Ulysses x Ring (USP) on full-3D attention, in the order
`ring.ring_attention` issues it; ring is U = 1, plain and sliced Ulysses R = 1.

Per block and rank: the block's other work, then n chunks each projected and traded inside the
Ulysses group (a link op; none when U = 1); as local chunk j arrives its keys and values leave on
the ring (hop 1) and the query chunks so far attend to it; each later hop is passed on as it
arrives and every query chunk attends to it; at the last block each query chunk goes back through
the Ulysses group as soon as it is complete, and its output projection waits on exactly it.

Costs are per attention *call* (`slice_overhead_s`, the fixed cost of one more, smaller call:
launches, less efficient matrices, the merge), so the overhead of n slices on R ring steps is
`calls(n, R) - calls(1, R)` calls per block; `calibrate.py` measures it the same way.
"""

from dataclasses import dataclass, replace

from slidefusion.parallel.simulate import Link, Op, Result, run


@dataclass(frozen=True)
class P2P:
    """One ring hop: latency + bytes / bandwidth, on `resource` ("link" when the hop shares the link
    of the Ulysses exchange, e.g. one node or an emulated link; "nic" when it crosses nodes while the
    exchange stays on NVLink)."""

    latency_s: float
    Bps: float
    resource: str = "link"

    def seconds(self, nbytes: float) -> float:
        return self.latency_s + nbytes / self.Bps


@dataclass
class UspCosts:
    """One rank's costs for one model evaluation under U x R, per block. qkv_s / out_s / rest_s: the
    projection, the output projection and the block's other work on this rank's tokens; attn_s:
    this rank's whole attention (its Ulysses group's queries over every key, its heads);
    qkv_peer_bytes / out_peer_bytes: what it sends each Ulysses peer in one whole exchange;
    block_bytes: one ring block's keys and values; gather_peer_bytes: the output gathered at the end
    over the whole sequence group (`gather_link`)."""

    blocks: int
    ulysses: int
    ring: int
    qkv_s: float
    attn_s: float
    out_s: float
    rest_s: float
    qkv_peer_bytes: float
    out_peer_bytes: float
    block_bytes: float
    gather_peer_bytes: float
    ulysses_link: Link
    ring_link: P2P
    gather_link: Link
    slice_overhead_s: float = 0.0
    slowdown: float = 0.0


def calls(n: int, ring: int) -> int:
    """Compute calls per block: n projections, n(n+1)/2 local attention tiles, (R - 1) n^2 remote ones,
    n output projections."""
    return n + n * (n + 1) // 2 + (ring - 1) * n * n + n


class _Block:
    """Appends one block's ops; `add` returns the op's index."""

    def __init__(self, ops: list[Op], costs: UspCosts, n: int, b: int):
        self.ops, self.c, self.n, self.b = ops, costs, n, b
        self.over = costs.slice_overhead_s if n > 1 else 0.0
        self.tile = costs.attn_s / (costs.ring * n * n)  # one (query chunk, key chunk) pair
        self.returns: list[int] = []

    def add(self, name: str, resource: str, seconds: float, deps: list[int]) -> int:
        self.ops.append(Op(f"{name} {self.b}", resource, seconds, deps))
        return len(self.ops) - 1

    def trade(self, name: str, peer_bytes: float, deps: list[int]) -> int | None:
        if self.c.ulysses == 1:
            return None
        return self.add(name, "link", self.c.ulysses_link.seconds(peer_bytes / self.n), deps)

    def finish(self, arrival: int | None, last: int, local: bool) -> int:
        """The last block: query chunk a completes and goes back at once."""
        n = self.n
        for a in range(n):  # one call each; the last local query chunk meets every local key chunk
            tiles = n if local and a == n - 1 else 1
            last = self.add(f"attend last {a}", "compute", tiles * self.tile + self.over,
                            [last] + ([arrival] if arrival is not None else []))
            back = self.trade(f"a2a out {a}", self.c.out_peer_bytes, [last])
            self.returns.append(last if back is None else back)
        return last


def _usp_block(ops: list[Op], c: UspCosts, n: int, b: int) -> None:
    blk = _Block(ops, c, n, b)
    last = blk.add("rest", "compute", c.rest_s, [len(ops) - 1] if ops else [])
    arrivals: list[int | None] = []
    for k in range(n):
        last = blk.add(f"qkv {k}", "compute", c.qkv_s / n + blk.over, [last])
        arrivals.append(blk.trade(f"a2a qkv {k}", c.qkv_peer_bytes, [last]))
    hops: dict[tuple[int, int], int] = {}
    for j in range(n):
        deps = [last] + ([arrivals[j]] if arrivals[j] is not None else [])
        if c.ring > 1:
            hops[1, j] = blk.add(f"ring 1 {j}", c.ring_link.resource, c.ring_link.seconds(c.block_bytes / n), deps)
        if c.ring == 1 and j == n - 1:
            last = blk.finish(arrivals[j], last, True)
        else:
            last = blk.add(f"attend {j}", "compute", (2 * j + 1) * blk.tile + (j + 1) * blk.over, deps)
    for h in range(1, c.ring):
        for k in range(n):
            if h + 1 < c.ring:
                hops[h + 1, k] = blk.add(f"ring {h + 1} {k}", c.ring_link.resource,
                                         c.ring_link.seconds(c.block_bytes / n), [last, hops[h, k]])
            if h == c.ring - 1 and k == n - 1:
                last = blk.finish(hops[h, k], last, False)
            else:
                last = blk.add(f"attend hop {h} {k}", "compute", n * blk.tile + n * blk.over, [last, hops[h, k]])
    for a in range(n):
        last = blk.add(f"out {a}", "compute", c.out_s / n + blk.over, [last, blk.returns[a]])


def usp_program(costs: UspCosts, n: int) -> list[Op]:
    ops: list[Op] = []
    for b in range(costs.blocks):
        _usp_block(ops, costs, n, b)
    ops.append(Op("gather tokens", "link", costs.gather_link.seconds(costs.gather_peer_bytes), [len(ops) - 1]))
    ops.append(Op("head", "compute", 0.0, [len(ops) - 1]))
    return ops


def simulate_usp(costs: UspCosts, slices: int = 1) -> Result:
    return run(usp_program(costs, slices), costs.slowdown)


def step_estimate(costs: UspCosts, slices: int = 1) -> float:
    """`simulate_usp(...).step_s` for ranking many candidates: blocks are identical and issued in
    order, so after the first the schedule repeats; three blocks are simulated and the third's
    increment extended to the rest (exact for up to 4 blocks, and whenever the pattern has settled)."""
    if costs.blocks <= 4:
        return simulate_usp(costs, slices).step_s
    two, three = (simulate_usp(replace(costs, blocks=b), slices).step_s for b in (2, 3))
    return three + (costs.blocks - 3) * (three - two)
