"""dsp / scalefusion / scalefusion-inter as in-place hooks on each block of a spatial-temporal model.

Between blocks a rank holds every frame of its positions (`tokens.py`). A temporal block computes
there, in its position slices. A spatial block needs whole frames: its hook switches positions ->
frames (chunked by its frame slices: slice c waits on exactly the chunks it needs, the others travel
under its compute), runs the block slice by slice on the rows of those frames (per-row arguments,
such as Latte's per-frame text states, cut to match), and switches frames -> positions as each slice
is done (the last waited on before the hook returns). The model's own forward runs unchanged around
the hooks, whatever it does between blocks.

A model whose forward hands each block's output straight to the next (`ModelAccess.chained`: our
STDiT) lets a switch span two hooks: the producing block starts chunk (p, c) as its slice p is done
and returns a placeholder; the next block's hook waits on chunks (., c) per slice c (the ScaleFusion
schedule across layers, N x N chunks for scalefusion-inter).
"""

from dataclasses import dataclass, field

from torch import Tensor

from slidefusion.parallel import hooks
from slidefusion.parallel.comm import Comm
from slidefusion.parallel.layout import FRAMES, POSITIONS, Split, shard
from slidefusion.parallel.plan import KIND_LAYOUT
from slidefusion.parallel.switch import Handoff, Switch
from slidefusion.parallel.tokens import Tokens
from slidefusion.parallel.trace import Tracer

@dataclass(frozen=True)
class LayerCall:
    """One model evaluation under a layer schedule. `slices(axis)` is this call's slice count for
    layers of that layout; `kinds` the blocks' kinds in call order; `rows` per kind the block
    arguments with one row per (sample, frame) or (sample, position); `pending` holds the switch a
    chained block left for the next one (the one mutable part, private to this call)."""

    comm: Comm
    tokens: Tokens
    kinds: tuple[str, ...]
    slice_counts: tuple[int, int]  # (frame slices, position slices)
    overlap: bool
    rows: dict
    chained: bool
    tracer: Tracer
    pending: list = field(default_factory=list)

    def slices(self, axis: int) -> int:
        return self.slice_counts[0] if axis == FRAMES else self.slice_counts[1]

    @property
    def full(self) -> tuple[int, ...]:
        """The whole canonical shape (B, T, S) without C."""
        return self.tokens.full

    def gather(self, y: Tensor) -> Tensor:
        with self.tracer.span("gather tokens"):
            return self.tokens.gather(self.comm, y)

    def run_block(self, i: int, bound, call_next) -> Tensor:
        """Block i's hook body: its tokens in its layout slice by slice (each through `call_next`, the
        block's forward below the hook), then on to the next layout."""
        kind, name = self.kinds[i], hooks.first_argument(bound)
        axis = KIND_LAYOUT[kind]
        x = bound.arguments[name]
        incoming = self._incoming(i, x, kind, axis)
        target, keep = self._target(i, axis)
        outgoing = self._switch(axis, target, keep, x.shape[-1], f"{kind}[{i}]")
        ranges = Split(self._size(axis), self.comm.size).sub(self.comm.rank, self.slices(axis))
        for c, (start, count) in enumerate(ranges):
            piece = incoming.receive(c)  # waits on exactly the chunks this slice needs
            with self.tracer.span(f"{kind}[{i}] slice {c}"):
                out = self._compute(bound, call_next, name, kind, axis, piece, start, count)
            outgoing.send(c, out)  # this slice's switch starts while the next slice computes
        if keep:
            placeholder = x.new_empty(0, x.shape[-1])  # the forward passes it, unread, to block i + 1
            self.pending[:] = [placeholder, outgoing]
            return placeholder
        return self.tokens.block_input(outgoing.receive(0), kind, whole_frames=False)

    def _size(self, axis: int) -> int:
        return self.full[axis]

    def _incoming(self, i: int, x: Tensor, kind: str, axis: int):
        """What delivers block i's slices in its layout: the chained predecessor's switch, a local cut
        of the whole input (block 0), or a switch from the positions every block hands on."""
        if self.pending:
            placeholder, handoff = self.pending
            self.pending.clear()
            if x is not placeholder:
                raise RuntimeError(f"block {i} did not get block {i - 1}'s output unchanged, but the model's "
                                   "parallel record says its blocks are chained")
            return handoff
        canonical = self.tokens.canonical(x, kind)
        n = self.slices(axis)
        if i == 0:  # every rank holds the whole embedded input: cut, no transfer
            handoff = Handoff(axis, n)
            handoff.send(0, shard(canonical, axis, Split(self._size(axis), self.comm.size), self.comm.rank))
            return handoff
        if axis == POSITIONS:
            handoff = Handoff(axis, n)
            handoff.send(0, canonical)
            return handoff
        switch = Switch(self.comm, (*self.full, canonical.shape[-1]), POSITIONS, axis, 1, n, self.overlap,
                        f"{kind}[{i}] in")
        switch.send(0, canonical)
        return switch

    def _target(self, i: int, axis: int) -> tuple[int, bool]:
        """(the layout block i hands on, whether the next block takes it from the pending switch)."""
        if self.chained and i + 1 < len(self.kinds):
            return KIND_LAYOUT[self.kinds[i + 1]], True
        return POSITIONS, False

    def _switch(self, axis: int, target: int, keep: bool, width: int, name: str):
        consumer = self.slices(target) if keep else 1
        if target == axis:
            return Handoff(axis, consumer)
        return Switch(self.comm, (*self.full, width), axis, target, self.slices(axis), consumer, self.overlap,
                      f"{name} out")

    def _compute(self, bound, call_next, name, kind, axis, piece, start, count) -> Tensor:
        if piece.numel() == 0:  # a rank holding no frames (T < P) or no positions computes nothing
            return piece
        changes = {name: self.tokens.block_input(piece, kind, whole_frames=axis == FRAMES)}
        for arg in self.rows.get(kind, ()):
            if isinstance(bound.arguments.get(arg), Tensor):
                changes[arg] = self.tokens.cut_rows(bound.arguments[arg], start, count)
        out = hooks.call_bound(call_next, hooks.rebound(bound, **changes))
        return self.tokens.canonical(out, kind)


class LayerHook:
    """On block `index` (call order) under dsp / scalefusion / scalefusion-inter."""

    def __init__(self, index: int):
        self.index = index

    def __call__(self, module, call_next, *args, **kwargs):
        call = hooks.current_call()
        if not isinstance(call, LayerCall):
            return call_next(*args, **kwargs)
        return call.run_block(self.index, hooks.bind(module, args, kwargs), call_next)
