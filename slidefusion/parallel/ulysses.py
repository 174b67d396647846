"""Head-parallel (Ulysses) attention, plain and sliced, as in-place hooks on an unchanged model.

Tokens are sharded over the ranks of the group. At each attention site that spans ranks, the hook
projects this rank's tokens to q/k/v with the module's own projection (all heads), trades tokens
for heads (an uneven all-to-all: each rank then holds every token of its heads), attends, trades
back and applies the module's own output projection. Heads P does not divide are split unevenly.

Sliced (`slices` n > 1; full-3D dense attention), this rank's tokens cut into n chunks:
 1. chunk k is projected and its exchange starts at once: it travels while chunk k+1 is projected;
 2. waiting on key chunk j, every query chunk received so far attends to it and the partial
    results merge by log-sum-exp (chunked.py): chunk j+1 travels under that attention;
 3. after the last key chunk, query chunk a is complete and goes back at once, under the attention
    of the query chunks after it and the output projections of those before it;
 4. the output projection of chunk a waits on exactly chunk a's return.
Per-token work (projection, QK norm, rotary) is all the access record's `project`, so a model whose
QK norm spans every head (Wan's RMSNorm over heads x D) slices the same way.
"""

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from slidefusion.parallel.chunked import attention_lse, merge
from slidefusion.parallel.comm import Comm
from slidefusion.parallel.exchange import start_trade
from slidefusion.parallel.hooks import current_call
from slidefusion.parallel.layout import Split
from slidefusion.parallel.records import AttentionAccess, AttentionSite
from slidefusion.parallel.tokens import Tokens
from slidefusion.parallel.trace import Tracer


@dataclass(frozen=True)
class UlyssesCall:
    """One model evaluation as the hooks see it: the group, this call's tokens (`Tokens`: grid,
    batch, layout; positions sharded within each frame for a model with temporal blocks, else the
    flattened T*H*W sequence), and the slice count."""

    comm: Comm
    tokens: Tokens
    slices: int
    tracer: Tracer

    def gather(self, y: Tensor) -> Tensor:
        """The output module's output on this rank's tokens -> the whole of it on every rank."""
        with self.tracer.span("gather tokens"):
            return self.tokens.gather(self.comm, y)

    def site_tokens(self, kind: str) -> tuple[int, tuple[int, int, int]]:
        """(tokens one attention group spans, the grid its operator sees) for a site of `kind`."""
        t, h, w = self.tokens.grid
        return (h * w, (1, h, w)) if kind == "spatial" else (t * h * w, (t, h, w))


class UlyssesHook:
    """At one attention site: x (G, ..., C) holding this rank's n_r tokens of each of G attention
    groups ((G, 1, n_r, 1, C) for our grid operators, (G, n_r, C) for diffusers' attention)."""

    def __init__(self, site: AttentionSite, access: AttentionAccess):
        self.site, self.access = site, access

    def __call__(self, module: nn.Module, call_next, x: Tensor, *args, **kwargs):
        call = current_call()
        if not isinstance(call, UlyssesCall):  # outside a Ulysses call the module runs as it is
            return call_next(x, *args, **kwargs)
        n, grid = call.site_tokens(self.site.kind)
        local = x.reshape(x.shape[0], -1, x.shape[-1])  # (G, n_r, C)
        out = ulysses_attention(module, self.access, local, call, Split(n, call.comm.size), grid,
                                f"attn[{self.site.block}]", args, kwargs)
        return out.view(x.shape)


def ulysses_attention(module, access: AttentionAccess, x: Tensor, call: UlyssesCall, tokens: Split,
                      grid: tuple[int, int, int], name: str, args=(), kwargs=None) -> Tensor:
    """This rank's tokens x (G, n_r, C) -> the attention output for them (G, n_r, C); args/kwargs:
    the rest of the module's call, handed to the access record's `project` with each chunk's span."""
    comm, n = call.comm, call.slices
    heads = Split(access.heads(module), comm.size).sizes
    chunks = [tokens.sub(i, n) for i in range(comm.size)]
    sizes = [[chunks[i][k][1] for i in range(comm.size)] for k in range(n)]  # sizes[k][i]: chunk k of rank i
    inbound, start = [], 0
    for k, part in enumerate(torch.split(x, [s[comm.rank] for s in sizes], dim=1)):
        with call.tracer.span(f"{name} qkv {k}"):
            qkv = access.project(module, part, args, kwargs or {}, (start, part.shape[1]))  # (G, m, 3, heads, D)
        start += part.shape[1]
        inbound.append(start_trade(comm, qkv, 3, heads, 1, sizes[k], f"{name} qkv {k}"))
    if n == 1:
        outbound = [_attend_whole(module, access, inbound[0], call, heads, sizes[0], grid, name)]
    else:
        outbound = _attend_chunked(inbound, call, heads, sizes, name)
    outs = []
    for a, trade in enumerate(outbound):
        o = trade.wait()  # (G, m_a, heads, D): this rank's tokens of chunk a, every head
        with call.tracer.span(f"{name} out {a}"):
            outs.append(access.output(module, o))
    return torch.cat(outs, dim=1)


def _attend_whole(module, access, inbound, call, heads, sizes, grid, name):
    """Plain Ulysses: the module's own operator on the whole grid of this rank's heads."""
    qkv = inbound.wait()  # (G, N, 3, h_r, D), tokens in global order
    g, total, _, mine, d = qkv.shape
    with call.tracer.span(f"{name} attend"):
        q, k, v = qkv.view(g, *grid, 3, mine, d).unbind(dim=-3)  # each (G, T, H, W, h_r, D)
        out = access.attend(module, q, k, v).reshape(g, total, mine, d)
    return start_trade(call.comm, out, 1, sizes, 2, heads, f"{name} out")


def _attend_chunked(inbound, call: UlyssesCall, heads, sizes, name):
    """Sliced Ulysses, steps 2 and 3 of the module docstring; returns the return trades in chunk order."""
    n = len(inbound)
    queries, keys, values = [], [], []
    partial: list = [None] * n
    outbound: list = [None] * n

    def send(a: int):
        q = queries[a]
        out = q.new_zeros(q.shape) if partial[a] is None else partial[a][0]  # a chunk with no queries
        outbound[a] = start_trade(call.comm, out, 1, sizes[a], 2, heads, f"{name} out {a}")

    for j in range(n):
        q, k, v = inbound[j].wait().unbind(dim=2)  # each (G, M_j, h_r, D)
        queries.append(q)
        keys.append(k)
        values.append(v)
        last = j == n - 1
        with call.tracer.span(f"{name} attend {j}"):
            for a in range(j):  # earlier query chunks see the new keys
                partial[a] = merge(partial[a], attention_lse(queries[a], k, v))
                if last:
                    send(a)
            partial[j] = merge(partial[j], attention_lse(q, torch.cat(keys, dim=1), torch.cat(values, dim=1)))
            if last:
                send(j)
    return outbound
