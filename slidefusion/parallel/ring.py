"""Ring attention and Ulysses x Ring (USP) for full-3D softmax attention, as in-place hooks.

The sequence group's P = U x R ranks form a grid (`grid.py`): rank p sits at ring index r = p // U
and Ulysses index u = p % U, so a Ulysses group is U consecutive ranks holding consecutive tokens
(inside one node when U <= GPUs per node) and a ring joins the R ranks that hold the same heads.
Ring is U = 1 (no head exchange, so it is not limited by the head count), plain Ulysses R = 1.

At one attention site, this rank's tokens cut into n chunks (--slices n):
 1. chunk k is projected (the access record's `project`: projection, QK norm, rotary) and traded
    inside the Ulysses group at once, tokens for heads (nothing moves when U = 1): the group's
    tokens of chunk k for this rank's heads travel while chunk k + 1 is projected;
 2. as chunk k arrives, its keys and values leave for ring index r + 1 (hop 1) and every query
    chunk received so far attends to it (the local block);
 3. hop h of chunk k (the block of ring index r - h) is waited for, passed on at once (hop h + 1),
    then every query chunk attends to it; partial results merge by log-sum-exp (chunked.py), so
    hop h + 1 travels under that attention;
 4. at the last block, query chunk a is complete and goes back through the Ulysses group at once,
    under the attention of the later query chunks; its output projection waits on exactly it.
Every query meets every key exactly once, so the result is exact up to float summation order.
Remote blocks are not kept: a rank holds its own block and the one in flight, as ring attention should.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from slidefusion.parallel.chunked import attention_lse, merge
from slidefusion.parallel.comm import Comm
from slidefusion.parallel.exchange import start_trade
from slidefusion.parallel.hooks import current_call
from slidefusion.parallel.layout import Split
from slidefusion.parallel.ulysses import UlyssesCall, UlyssesHook


@dataclass(frozen=True)
class Grid:
    """This rank's two groups of a U x R grid: `ulysses` (U consecutive ranks; None when U = 1) and
    `ring` (the R ranks with this rank's Ulysses index; None when R = 1)."""

    ulysses: Comm | None
    ring: Comm | None
    degrees: tuple[int, int]  # (U, R)

    @property
    def u(self) -> int:
        return 0 if self.ulysses is None else self.ulysses.rank

    @property
    def r(self) -> int:
        return 0 if self.ring is None else self.ring.rank


@dataclass(frozen=True)
class RingCall(UlyssesCall):
    """A model evaluation under ring / usp: a `UlyssesCall` (sequence group, tokens, slices) plus the grid."""

    grid: Grid


@dataclass(frozen=True)
class RingLayout:
    """Token counts of one site: `tokens` split over the P = U x R ranks, each rank's share cut into
    `slices` chunks (uneven, maybe empty)."""

    tokens: Split
    ulysses: int
    slices: int

    def chunk(self, p: int, k: int) -> int:
        """Tokens of chunk k of sequence rank p."""
        return self.tokens.sub(p, self.slices)[k][1]

    def members(self, r: int, k: int) -> list[int]:
        """Chunk k's tokens on each rank of Ulysses group r (ring index r), in rank order."""
        return [self.chunk(r * self.ulysses + u, k) for u in range(self.ulysses)]

    def block(self, r: int, k: int) -> int:
        """Chunk k of ring index r's block: the tokens of its whole Ulysses group."""
        return sum(self.members(r, k))


class RingHook(UlyssesHook):
    """At one attention site: ring / usp under a `RingCall`, plain or sliced Ulysses under a
    `UlyssesCall` (so `auto` can try either on the same hooks)."""

    def __call__(self, module: nn.Module, call_next, x: Tensor, *args, **kwargs):
        call = current_call()
        if not isinstance(call, RingCall):
            return super().__call__(module, call_next, x, *args, **kwargs)
        n, _ = call.site_tokens(self.site.kind)
        local = x.reshape(x.shape[0], -1, x.shape[-1])  # (G, n_r, C)
        layout = RingLayout(Split(n, call.comm.size), call.grid.degrees[0], call.slices)
        out = ring_attention(module, self.access, local, call, layout, f"attn[{self.site.block}]", args, kwargs)
        return out.view(x.shape)


class _Ready:
    """A transfer that moves nothing (U = 1): `wait()` returns the tensor."""

    def __init__(self, value: Tensor):
        self.value = value

    def wait(self) -> Tensor:
        return self.value


def _trade(comm: Comm | None, x: Tensor, scatter_dim: int, scatter: list[int], gather_dim: int, gather: list[int],
           name: str):
    return _Ready(x) if comm is None else start_trade(comm, x, scatter_dim, scatter, gather_dim, gather, name)


def ring_attention(module, access, x: Tensor, call: RingCall, layout: RingLayout, name: str, args=(),
                   kwargs=None) -> Tensor:
    """This rank's tokens x (G, n_r, C) -> the attention output for them (G, n_r, C), steps 1-4 of the
    module docstring."""
    grid, rank = call.grid, call.comm.rank
    heads = Split(access.heads(module), grid.degrees[0]).sizes
    mine = [layout.chunk(rank, k) for k in range(layout.slices)]
    inbound, start = [], 0
    for k, part in enumerate(torch.split(x, mine, dim=1)):
        with call.tracer.span(f"{name} qkv {k}"):
            qkv = access.project(module, part, args, kwargs or {}, (start, part.shape[1]))  # (G, m, 3, heads, D)
        start += part.shape[1]
        inbound.append(_trade(grid.ulysses, qkv, 3, heads, 1, layout.members(grid.r, k), f"{name} qkv {k}"))
    outbound = _RingPass(call, layout, heads, name).run(inbound)
    outs = []
    for a, trade in enumerate(outbound):
        o = trade.wait()  # (G, m_a, heads, D): this rank's tokens of chunk a, every head
        with call.tracer.span(f"{name} out {a}"):
            outs.append(access.output(module, o))
    return torch.cat(outs, dim=1)


class _RingPass:
    """Steps 2-4 for one site: the local block chunk by chunk, then every hop of every chunk."""

    def __init__(self, call: RingCall, layout: RingLayout, heads: list[int], name: str):
        self.call, self.layout, self.heads, self.name = call, layout, heads, name
        self.ring = call.grid.degrees[1]
        self.queries: list[Tensor] = []
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []
        self.partial: list = [None] * layout.slices
        self.outbound: list = [None] * layout.slices

    def run(self, inbound: list) -> list:
        n, hops = self.layout.slices, {}
        for j, trade in enumerate(inbound):
            qkv = trade.wait()  # (G, M_j, 3, h_u, D): the group's tokens of chunk j, this rank's heads
            if self.ring > 1:
                hops[1, j] = self._hop(qkv[:, :, 1:], 1, j)
            with self.call.tracer.span(f"{self.name} attend {j}"):
                self._local(*qkv.unbind(dim=2), last=self.ring == 1 and j == n - 1)
        for h in range(1, self.ring):
            for k in range(n):
                kv = hops.pop((h, k)).wait()  # (G, M, 2, h_u, D): chunk k of ring index r - h
                if h + 1 < self.ring:
                    hops[h + 1, k] = self._hop(kv, h + 1, k)
                with self.call.tracer.span(f"{self.name} ring {h} {k}"):
                    self._remote(*kv.unbind(dim=2), last=h == self.ring - 1 and k == n - 1)
        return self.outbound

    def _hop(self, kv: Tensor, h: int, k: int):
        """Send `kv` (the block of ring index r - h + 1) to r + 1, receive r - h's from r - 1."""
        ring, r = self.call.grid.ring, self.call.grid.r
        g, _, _, mine, d = kv.shape
        recv = kv.new_empty(g, self.layout.block((r - h) % self.ring, k), 2, mine, d)
        return ring.send_recv(kv, (r + 1) % self.ring, recv, (r - 1) % self.ring, h * self.layout.slices + k,
                              f"{self.name} ring {h} {k}")

    def _local(self, q: Tensor, k: Tensor, v: Tensor, last: bool) -> None:
        """Local chunk j: the earlier query chunks see its keys, its queries see every local key so far."""
        j = len(self.queries)
        for a in range(j):
            self.partial[a] = merge(self.partial[a], attention_lse(self.queries[a], k, v))
            if last:
                self._send(a)
        self.queries.append(q)
        self.keys.append(k)
        self.values.append(v)
        self.partial[j] = merge(self.partial[j], attention_lse(q, torch.cat(self.keys, dim=1),
                                                               torch.cat(self.values, dim=1)))
        if last:
            self._send(j)

    def _remote(self, k: Tensor, v: Tensor, last: bool) -> None:
        for a, q in enumerate(self.queries):
            self.partial[a] = merge(self.partial[a], attention_lse(q, k, v))
            if last:
                self._send(a)

    def _send(self, a: int) -> None:
        """Query chunk a is complete: back to its tokens' ranks (every head) at once."""
        q = self.queries[a]
        out = q.new_zeros(q.shape) if self.partial[a] is None else self.partial[a][0]  # a chunk with no queries
        self.outbound[a] = _trade(self.call.grid.ulysses, out, 1, self.layout.members(self.call.grid.r, a), 2,
                                  self.heads, f"{self.name} out {a}")
        self.partial[a] = None  # its memory goes with the transfer
