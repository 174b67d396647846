"""Tiled slide attention in plain PyTorch ("tiled"): runs on any device; the CPU fallback of "cpp".

Queries are cut into tiles of (tt, th, tw) tokens. A tile's queries read keys only from the tile's
*halo*: the union of their windows, widened by `extend` tokens per side when offsets move the
sample points. One matmul per tile scores every query against the whole halo, so neighbouring
queries share their keys, and tiles go a few at a time so that no temporary holds more than about
`CHUNK_ELEMENTS` scores. Nothing of size N*K*D is ever built.

* Without offsets, halo scores outside a query's window are masked to -inf and the softmax runs
  over the halo: a few wasted dot products are cheaper than gathering each window.
* With offsets, q . k is linear in k, so the score at a sample point is the trilinear
  interpolation of the halo scores (`grid_sample` on each query's score volume) instead of a dot
  product with an interpolated key; and sum_s p_s v(point_s) = A @ V_halo, where A is the adjoint of
  that interpolation applied to the probabilities (grid_sample's input gradient).
* The backward recomputes scores tile by tile from q, k, v and offsets, and the probabilities
  from the saved log-sum-exp.

Layouts: "tiles" are (B, heads, nt, nh, nw, Qt, ...) with Qt = tt*th*tw queries in row-major
(t, h, w) order; a halo is flattened in (w, h, t) order so that, seen as a grid_sample volume
(Hw, Hh, Ht), the grid's (x, y, z) coordinates are (t, h, w).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


Triple = tuple[int, int, int]

# Upper bound on the elements of one chunk's score tensor (B*heads*tiles*Qt*halo); 4 MiB in fp32,
# so the handful of score-sized temporaries of a chunk stay well under the 100 MiB budget.
CHUNK_ELEMENTS = 2**20
# Tile shapes, chosen by timing 16x32x32 tokens with a 3x7x7 window on 2 cores (benchmarks/attention.py).
NEIGHBORHOOD_TILE: Triple = (1, 4, 8)
SLIDE_TILE: Triple = (1, 4, 8)

_BILINEAR, _BORDER = 0, 1  # grid_sampler_3d_backward's enum values


@dataclass(frozen=True)
class Axis:
    """Tiling of one grid axis."""

    length: int
    kernel: int
    tile: int
    n: int  # tiles along the axis (the last may overhang the grid)
    halo: int  # halo length, the same for every tile
    start: torch.Tensor  # (n, tile) window start of each (padded) query position
    halo_start: torch.Tensor  # (n,)

    def mask(self) -> torch.Tensor:
        """(n, tile, halo) bool: halo position lies in the query's window."""
        pos = self.halo_start[:, None, None] + torch.arange(self.halo, device=self.start.device)
        return (pos >= self.start[..., None]) & (pos < self.start[..., None] + self.kernel)

    def local_windows(self) -> torch.Tensor:
        """(n, tile, kernel) window positions relative to the tile's halo start."""
        slots = torch.arange(self.kernel, device=self.start.device)
        return self.start[..., None] + slots - self.halo_start[:, None, None]


def plan_axis(length: int, kernel: int, tile: int, extend: int, device: torch.device) -> Axis:
    """Tiles of `tile` queries; the halo covers every window of the tile, `extend` wider per side.

    The halo start is clamped into the grid rather than padded: the clamped window rule keeps
    every window inside [0, L), so a halo of fixed length shifted inward still covers them all.
    """
    tile = min(tile, length)
    n = -(-length // tile)
    pos = torch.arange(n * tile, device=device).view(n, tile)
    start = (pos - kernel // 2).clamp(0, length - kernel)  # padding queries copy the last window
    halo = min(tile + kernel - 1 + 2 * extend, length)
    halo_start = (start[:, 0] - extend).clamp(0, length - halo)
    return Axis(length, kernel, tile, n, halo, start, halo_start)


@dataclass(frozen=True)
class Plan:
    """How one call is tiled and chunked."""

    axes: tuple[Axis, Axis, Axis]
    chunk: tuple[int, int]  # (t tiles, h tiles) per chunk; a chunk always spans every w tile

    @property
    def queries(self) -> int:
        return self.axes[0].tile * self.axes[1].tile * self.axes[2].tile

    @property
    def halo(self) -> int:
        return self.axes[0].halo * self.axes[1].halo * self.axes[2].halo

    def chunks(self):
        """Yield (t0, t1, h0, h1) tile ranges."""
        (nt, nh), (ct, ch) = (self.axes[0].n, self.axes[1].n), self.chunk
        for t0 in range(0, nt, ct):
            for h0 in range(0, nh, ch):
                yield t0, min(t0 + ct, nt), h0, min(h0 + ch, nh)

    def halo_index(self, t0: int, t1: int, h0: int, h1: int) -> torch.Tensor:
        """Flat grid index of every halo position of the chunk's tiles: (ct, ch, nw, Hw*Hh*Ht)."""
        at, ah, aw = self.axes
        dev = at.start.device
        gt = at.halo_start[t0:t1, None] + torch.arange(at.halo, device=dev)  # (ct, Ht)
        gh = ah.halo_start[h0:h1, None] + torch.arange(ah.halo, device=dev)  # (ch, Hh)
        gw = aw.halo_start[:, None] + torch.arange(aw.halo, device=dev)  # (nw, Hw)
        H, W = ah.length, aw.length
        idx = (
            gt[:, None, None, None, None, :] * (H * W)
            + gh[None, :, None, None, :, None] * W
            + gw[None, None, :, :, None, None]
        )  # (ct, ch, nw, Hw, Hh, Ht)
        return idx.reshape(t1 - t0, h1 - h0, aw.n, -1)


def make_plan(grid: Triple, kernel: Triple, tile: Triple, extend: Triple, rows: int, device) -> Plan:
    """`rows` = B*heads; the chunk holds as many tile rows as CHUNK_ELEMENTS allows (at least one tile row)."""
    axes = tuple(plan_axis(n, k, t, e, device) for n, k, t, e in zip(grid, kernel, tile, extend))
    at, ah, aw = axes
    per_tile = rows * at.tile * ah.tile * aw.tile * max(at.halo * ah.halo * aw.halo, kernel[0] * kernel[1] * kernel[2])
    per_h_row = per_tile * aw.n
    ch = max(1, min(ah.n, CHUNK_ELEMENTS // per_h_row))
    ct = max(1, min(at.n, CHUNK_ELEMENTS // (per_h_row * ah.n))) if ch == ah.n else 1
    return Plan(axes, (ct, ch))


# ---------------------------------------------------------------------------------------------
# Layout changes between the grid (B, T, H, W, heads, D) and tiles (B, heads, nt, nh, nw, Qt, D).


def to_tiles(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    """(B, T, H, W, heads, D) -> (B, heads, nt, nh, nw, Qt, D), zero-padded to whole tiles."""
    B, T, H, W, heads, D = x.shape
    (at, ah, aw) = plan.axes
    x = x.permute(0, 4, 5, 1, 2, 3)  # (B, heads, D, T, H, W)
    x = F.pad(x, (0, aw.n * aw.tile - W, 0, ah.n * ah.tile - H, 0, at.n * at.tile - T))
    x = x.reshape(B, heads, D, at.n, at.tile, ah.n, ah.tile, aw.n, aw.tile)
    x = x.permute(0, 1, 3, 5, 7, 4, 6, 8, 2)  # (B, heads, nt, nh, nw, tt, th, tw, D)
    return x.reshape(B, heads, at.n, ah.n, aw.n, plan.queries, D)


def from_tiles(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    """Inverse of `to_tiles`: (B, heads, nt, nh, nw, Qt, D) -> (B, T, H, W, heads, D), cropped."""
    B, heads, D = x.shape[0], x.shape[1], x.shape[-1]
    (at, ah, aw) = plan.axes
    x = x.reshape(B, heads, at.n, ah.n, aw.n, at.tile, ah.tile, aw.tile, D)
    x = x.permute(0, 2, 5, 3, 6, 4, 7, 1, 8)  # (B, nt, tt, nh, th, nw, tw, heads, D)
    x = x.reshape(B, at.n * at.tile, ah.n * ah.tile, aw.n * aw.tile, heads, D)
    return x[:, : at.length, : ah.length, : aw.length].contiguous()


def to_rows(x: torch.Tensor) -> torch.Tensor:
    """(B, T, H, W, heads, D) -> (B*heads*N, D): one row per (sample, head, token), for row gathers."""
    B, T, H, W, heads, D = x.shape
    return x.permute(0, 4, 1, 2, 3, 5).reshape(B * heads * T * H * W, D)


def row_index(halo_index: torch.Tensor, rows: int, tokens: int) -> torch.Tensor:
    """Halo token indices (...,) -> row indices into `to_rows` for every (sample, head): (rows*...,)."""
    base = torch.arange(rows, device=halo_index.device) * tokens
    return (base.view(-1, *([1] * halo_index.dim())) + halo_index).reshape(-1)


# ---------------------------------------------------------------------------------------------
# Sample points (offsets mode), in grid_sample's normalised coordinates of each tile's halo.


@dataclass
class Points:
    """The chunk's sample points; `inside` marks points the grid clamp left untouched."""

    grid: torch.Tensor  # (B*heads*tiles*Qt, 1, 1, K, 3), (t, h, w) in [-1, 1]
    inside: torch.Tensor | None  # (B, heads, ct, ch, nw, tt, th, tw, kt, kh, kw, 3) bool; backward only
    unit: torch.Tensor  # (3,) normalised units per token


def _axis_grid(axis: Axis, sl: slice, view: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local window positions (n, tile, k) and clamp bounds (n,) of one axis, shaped by `view`."""
    base = axis.local_windows()[sl]
    lo = -axis.halo_start[sl]
    hi = axis.length - 1 - axis.halo_start[sl]
    return base.reshape(view), lo, hi


def sample_points(offsets: torch.Tensor, plan: Plan, t0, t1, h0, h1, dtype, inside: bool = False) -> Points:
    """Offsets (B, T, H, W, heads, Ko, 3) -> the chunk's clamped, normalised sample points."""
    B, heads, Ko = offsets.shape[0], offsets.shape[4], offsets.shape[5]
    at, ah, aw = plan.axes
    ct, ch, nw = t1 - t0, h1 - h0, aw.n
    dev = offsets.device
    halos = torch.tensor([at.halo, ah.halo, aw.halo], device=dev, dtype=dtype)
    unit = torch.where(halos > 1, 2 / (halos - 1).clamp(min=1), torch.zeros_like(halos))  # (3,)

    # Offsets of the chunk's queries, in tile layout and normalised units.
    T0, T1 = t0 * at.tile, min(t1 * at.tile, at.length)
    H0, H1 = h0 * ah.tile, min(h1 * ah.tile, ah.length)
    off = offsets[:, T0:T1, H0:H1].permute(0, 4, 1, 2, 3, 5, 6) * unit  # (B, heads, Tc, Hc, W, Ko, 3)
    padded = (ct * at.tile, ch * ah.tile, nw * aw.tile)
    if off.shape[2:5] != padded:  # the last tiles overhang the grid
        off = F.pad(off, (0, 0, 0, 0, 0, padded[2] - aw.length, 0, padded[1] - (H1 - H0), 0, padded[0] - (T1 - T0)))
    off = off.view(B, heads, ct, at.tile, ch, ah.tile, nw, aw.tile, Ko, 3)
    off = off.permute(0, 1, 2, 4, 6, 3, 5, 7, 8, 9)  # (B, heads, ct, ch, nw, tt, th, tw, Ko, 3)
    kernel = (at.kernel, ah.kernel, aw.kernel) if Ko > 1 else (1, 1, 1)
    off = off.reshape(B, heads, ct, ch, nw, at.tile, ah.tile, aw.tile, *kernel, 3)

    # Window positions and clamp bounds, (ct, ch, nw, tt, th, tw, kt, kh, kw, 3) after broadcasting.
    bt, lot, hit = _axis_grid(at, slice(t0, t1), [ct, 1, 1, at.tile, 1, 1, at.kernel, 1, 1])
    bh, loh, hih = _axis_grid(ah, slice(h0, h1), [1, ch, 1, 1, ah.tile, 1, 1, ah.kernel, 1])
    bw, low, hiw = _axis_grid(aw, slice(None), [1, 1, nw, 1, 1, aw.tile, 1, 1, aw.kernel])
    bound_shape = (ct, ch, nw, 1, 1, 1, 1, 1, 1, 3)
    lo = torch.stack(torch.broadcast_tensors(lot[:, None, None], loh[None, :, None], low[None, None, :]), -1)
    hi = torch.stack(torch.broadcast_tensors(hit[:, None, None], hih[None, :, None], hiw[None, None, :]), -1)
    lo, hi = (x.to(dtype).reshape(bound_shape) * unit - 1 for x in (lo, hi))

    K = at.kernel * ah.kernel * aw.kernel
    raw = torch.empty(*off.shape[:8], at.kernel, ah.kernel, aw.kernel, 3, device=dev, dtype=dtype)
    for a, base in enumerate((bt, bh, bw)):  # per-axis adds broadcast; no window-sized index tensor
        torch.add(off[..., a].expand(raw.shape[:-1]), base.to(dtype) * unit[a] - 1, out=raw[..., a])
    mask = (raw > lo) & (raw < hi) if inside else None
    grid = raw.clamp_(lo, hi)  # (B, heads, ct, ch, nw, tt, th, tw, kt, kh, kw, 3)
    return Points(grid.view(-1, 1, 1, K, 3), mask, unit)


# ---------------------------------------------------------------------------------------------
# Per-chunk math. Shapes: Q (B, heads, ct, ch, nw, Qt, D); Kh, Vh (B, heads, ct, ch, nw, Hh, D).


def _volumes(x: torch.Tensor, plan: Plan) -> torch.Tensor:
    """(..., Qt, halo) -> (rows, 1, Hw, Hh, Ht): one grid_sample volume per query."""
    at, ah, aw = plan.axes
    return x.reshape(-1, 1, aw.halo, ah.halo, at.halo)


def _interpolate(volumes: torch.Tensor, pts: Points) -> torch.Tensor:
    """Read each query's volume at its K points: (rows, K)."""
    out = F.grid_sample(volumes, pts.grid, mode="bilinear", padding_mode="border", align_corners=True)
    return out.reshape(volumes.shape[0], -1)


def _scatter(weights: torch.Tensor, volumes: torch.Tensor, pts: Points) -> torch.Tensor:
    """Adjoint of `_interpolate`: weights (rows, K) spread onto the volume grid (rows, halo)."""
    grad = weights.reshape(weights.shape[0], 1, 1, 1, -1)
    out = torch.ops.aten.grid_sampler_3d_backward(grad, volumes, pts.grid, _BILINEAR, _BORDER, True, [True, False])
    return out[0].reshape(volumes.shape[0], -1)


def _point_grad(weights: torch.Tensor, volumes: torch.Tensor, pts: Points, need_input: bool):
    """Gradient of sum(weights * interpolate(volumes)) wrt the points (and the volumes if asked)."""
    grad = weights.reshape(weights.shape[0], 1, 1, 1, -1)
    mask = [need_input, True]
    d_vol, d_grid = torch.ops.aten.grid_sampler_3d_backward(
        grad, volumes, pts.grid, _BILINEAR, _BORDER, True, mask
    )
    return (d_vol.reshape(volumes.shape[0], -1) if need_input else None), d_grid


# Q arrives pre-multiplied by the scale, so scores are plain Q Kh^T and the backward's dQ lacks
# one factor of the scale (applied once, by the caller). The backward rebuilds the probabilities
# from the saved log-sum-exp; `delta` is rowsum(dO * out) - dlse, so the same formula gives the
# gradient of the log-sum-exp output too (d lse / d logit = p).


def neighborhood_chunk_forward(Q, Kh, Vh, bias):
    """Masked softmax over the halo: out (..., Qt, D) and lse (..., Qt)."""
    s = torch.matmul(Q, Kh.transpose(-1, -2)).add_(bias)  # (..., Qt, halo)
    lse = torch.logsumexp(s, dim=-1)
    return torch.matmul(s.sub_(lse[..., None]).exp_(), Vh), lse


def slide_chunk_forward(Q, Kh, Vh, pts: Points, plan: Plan):
    """Softmax over the interpolated scores at the K points: out (..., Qt, D) and lse (..., Qt)."""
    lead = Q.shape[:-1]  # (B, heads, ct, ch, nw, Qt)
    s = _volumes(torch.matmul(Q, Kh.transpose(-1, -2)), plan)  # (rows, 1, Hw, Hh, Ht)
    z = _interpolate(s, pts)  # (rows, K)
    lse = torch.logsumexp(z, dim=-1)
    a = _scatter(z.sub_(lse[:, None]).exp_(), s, pts).view(*lead, -1)  # (..., Qt, halo)
    return torch.matmul(a, Vh), lse.view(lead)


def neighborhood_chunk_backward(Q, Kh, Vh, bias, dO, lse, delta):
    """Gradients (dQ / scale, dKh, dVh) of one chunk."""
    s = torch.matmul(Q, Kh.transpose(-1, -2)).add_(bias)
    p = s.sub_(lse[..., None]).exp_()  # (..., Qt, halo)
    dVh = torch.matmul(p.transpose(-1, -2), dO)
    dp = torch.matmul(dO, Vh.transpose(-1, -2))
    ds = dp.sub_(delta[..., None]).mul_(p)
    return torch.matmul(ds, Kh), torch.matmul(ds.transpose(-1, -2), Q), dVh


def slide_chunk_backward(Q, Kh, Vh, pts: Points, plan: Plan, dO, lse, delta):
    """Gradients (dQ / scale, dKh, dVh, d_grid) of one chunk; d_grid (rows, 1, 1, K, 3) in normalised units."""
    lead = Q.shape[:-1]
    s = _volumes(torch.matmul(Q, Kh.transpose(-1, -2)), plan)
    p = _interpolate(s, pts).sub_(lse.reshape(-1, 1)).exp_()  # (rows, K)
    a = _scatter(p, s, pts).view(*lead, -1)  # (..., Qt, halo)
    dVh = torch.matmul(a.transpose(-1, -2), dO)
    da = _volumes(torch.matmul(dO, Vh.transpose(-1, -2)), plan)  # (rows, 1, Hw, Hh, Ht)
    dp = _interpolate(da, pts)  # (rows, K)
    _, d_grid = _point_grad(p, da, pts, need_input=False)  # through A's dependence on the points
    dlogits = dp.sub_(delta.reshape(-1, 1)).mul_(p)
    ds, d_grid2 = _point_grad(dlogits, s, pts, need_input=True)  # through the interpolated scores
    ds = ds.view(*lead, -1)
    return torch.matmul(ds, Kh), torch.matmul(ds.transpose(-1, -2), Q), dVh, d_grid.add_(d_grid2)


# ---------------------------------------------------------------------------------------------
# The whole operator.


def _extend(offsets: torch.Tensor | None) -> Triple:
    """Halo widening per axis: a point within r of its window slot touches corners within floor(r) + 1."""
    if offsets is None:
        return (0, 0, 0)
    reach = offsets.detach().abs().amax(dim=(0, 1, 2, 3, 4, 5))  # (3,)
    return tuple(int(r) + 1 for r in reach.floor().tolist())


def _finite(offsets: torch.Tensor | None, grid: Triple) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(offsets the plan can use, the query-heads (B, T, H, W, heads) that hold a NaN offset or None).
    As in the reference: those query-heads get NaN outputs (as a NaN input gives in any torch op),
    and an infinite offset puts its point on the grid's edge (one grid length away is as far: the
    clamp holds it there). One reduction when every offset is finite."""
    if offsets is None or bool(torch.isfinite(offsets.detach().abs().amax())):
        return offsets, None
    nan = torch.isnan(offsets).any(dim=-1).any(dim=-1)
    edge = float(max(grid))
    return offsets.nan_to_num(0.0, edge, -edge), (nan if bool(nan.any()) else None)


class _Context:
    """Everything both passes derive from the shapes: plan, halo rows, masks."""

    def __init__(self, q: torch.Tensor, kernel: Triple, offsets, tile: Triple | None):
        B, T, H, W, heads, D = q.shape
        self.grid, self.kernel, self.rows, self.tokens = (T, H, W), kernel, B * heads, T * H * W
        default = SLIDE_TILE if offsets is not None else NEIGHBORHOOD_TILE
        self.plan = make_plan(self.grid, kernel, tile or default, _extend(offsets), self.rows, q.device)
        self.masks = [a.mask() for a in self.plan.axes] if offsets is None else None

    def halo_rows(self, t0, t1, h0, h1) -> torch.Tensor:
        return row_index(self.plan.halo_index(t0, t1, h0, h1), self.rows, self.tokens)

    def gather(self, rows_x: torch.Tensor, index: torch.Tensor, B: int, heads: int, shape) -> torch.Tensor:
        """Halo keys or values of the chunk: (B, heads, ct, ch, nw, halo, D)."""
        return rows_x.index_select(0, index).view(B, heads, *shape, self.plan.halo, rows_x.shape[-1])

    def bias(self, t0, t1, h0, h1, dtype) -> torch.Tensor:
        """(ct, ch, nw, Qt, halo): 0 inside the query's window, -inf outside."""
        mt, mh, mw = self.masks
        mt, mh = mt[t0:t1], mh[h0:h1]
        ct, tt, Ht = mt.shape
        ch, th, Hh = mh.shape
        nw, tw, Hw = mw.shape
        m = (
            mt.view(ct, 1, 1, tt, 1, 1, 1, 1, Ht)
            & mh.view(1, ch, 1, 1, th, 1, 1, Hh, 1)
            & mw.view(1, 1, nw, 1, 1, tw, Hw, 1, 1)
        )
        m = m.reshape(ct, ch, nw, tt * th * tw, Hw * Hh * Ht)
        return torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))


def forward(q, k, v, offsets, kernel: Triple, scale: float, tile: Triple | None = None):
    """out (B, T, H, W, heads, D) and lse (B, T, H, W, heads); inputs normalised by the dispatch layer.
    A query-head with a NaN offset gets NaN out and lse (`_finite`)."""
    B, T, H, W, heads, D = q.shape
    offsets, nonfinite = _finite(offsets, (T, H, W))
    ctx = _Context(q, kernel, offsets, tile)
    plan = ctx.plan
    Qt_all = to_tiles(q, plan) * scale  # (B, heads, nt, nh, nw, Qt, D)
    k_rows, v_rows = to_rows(k), to_rows(v)
    out = torch.empty_like(Qt_all)
    lse = torch.empty(Qt_all.shape[:-1], dtype=q.dtype, device=q.device)  # (B, heads, nt, nh, nw, Qt)
    for t0, t1, h0, h1 in plan.chunks():
        shape = (t1 - t0, h1 - h0, plan.axes[2].n)
        index = ctx.halo_rows(t0, t1, h0, h1)
        Kh, Vh = ctx.gather(k_rows, index, B, heads, shape), ctx.gather(v_rows, index, B, heads, shape)
        Q = Qt_all[:, :, t0:t1, h0:h1]
        if offsets is None:
            o, m = neighborhood_chunk_forward(Q, Kh, Vh, ctx.bias(t0, t1, h0, h1, q.dtype))
        else:
            o, m = slide_chunk_forward(Q, Kh, Vh, sample_points(offsets, plan, t0, t1, h0, h1, q.dtype), plan)
        out[:, :, t0:t1, h0:h1], lse[:, :, t0:t1, h0:h1] = o, m
    out, lse = from_tiles(out, plan), from_tiles(lse[..., None], plan)[..., 0]
    if nonfinite is not None:
        out, lse = out.masked_fill(nonfinite[..., None], float("nan")), lse.masked_fill(nonfinite, float("nan"))
    return out, lse


def backward(q, k, v, offsets, lse, delta, grad_out, kernel: Triple, scale: float, tile: Triple | None = None):
    """(dq, dk, dv, doffsets) from the saved lse and delta = rowsum(dout * out) - dlse, both (B, T, H, W, heads).

    doffsets is an empty tensor without offsets. A query-head with a NaN offset has a NaN lse from
    the forward, which carries NaN into the gradients.
    """
    B, T, H, W, heads, D = q.shape
    offsets = _finite(offsets, (T, H, W))[0]
    ctx = _Context(q, kernel, offsets, tile)
    plan = ctx.plan
    Qt_all = to_tiles(q, plan) * scale
    dO_all = to_tiles(grad_out, plan)  # padding queries get dO = 0 and delta = 0: they add nothing
    lse_all, delta_all = (to_tiles(x[..., None], plan)[..., 0] for x in (lse, delta))  # (B, heads, nt, nh, nw, Qt)
    k_rows, v_rows = to_rows(k), to_rows(v)
    dQ = torch.empty_like(Qt_all)
    dk_rows, dv_rows = torch.zeros_like(k_rows), torch.zeros_like(v_rows)
    d_off = q.new_empty(0) if offsets is None else torch.zeros_like(offsets)
    for t0, t1, h0, h1 in plan.chunks():
        shape = (t1 - t0, h1 - h0, plan.axes[2].n)
        index = ctx.halo_rows(t0, t1, h0, h1)
        Kh, Vh = ctx.gather(k_rows, index, B, heads, shape), ctx.gather(v_rows, index, B, heads, shape)
        sl = (slice(None), slice(None), slice(t0, t1), slice(h0, h1))
        Q, dO, m, dl = Qt_all[sl], dO_all[sl], lse_all[sl], delta_all[sl]
        if offsets is None:
            dq, dKh, dVh = neighborhood_chunk_backward(Q, Kh, Vh, ctx.bias(t0, t1, h0, h1, q.dtype), dO, m, dl)
        else:
            pts = sample_points(offsets, plan, t0, t1, h0, h1, q.dtype, inside=True)
            dq, dKh, dVh, d_grid = slide_chunk_backward(Q, Kh, Vh, pts, plan, dO, m, dl)
            _add_offset_grad(d_off, d_grid, pts, plan, t0, t1, h0, h1)
        dQ[sl] = dq
        dk_rows.index_add_(0, index, dKh.reshape(-1, D))
        dv_rows.index_add_(0, index, dVh.reshape(-1, D))

    def from_rows(x):
        return x.view(B, heads, T, H, W, D).permute(0, 2, 3, 4, 1, 5)

    return from_tiles(dQ.mul_(scale), plan), from_rows(dk_rows), from_rows(dv_rows), d_off


def _add_offset_grad(d_off, d_grid, pts: Points, plan: Plan, t0, t1, h0, h1) -> None:
    """Accumulate the chunk's point gradients (normalised units) into d_off (B, T, H, W, heads, Ko, 3)."""
    B, T, H, W, heads, Ko, _ = d_off.shape
    at, ah, aw = plan.axes
    # grid_sample's border mode already zeroes the gradient of points clamped onto the grid's edge
    # (clamped points always sit on a halo edge); the explicit mask keeps that independent of it.
    g = d_grid.view(pts.inside.shape) * pts.inside * pts.unit  # per token: d point / d offset = unit
    if Ko == 1:
        g = g.sum(dim=(-4, -3, -2), keepdim=True)
    ct, ch = t1 - t0, h1 - h0
    g = g.reshape(B, heads, ct, ch, aw.n, at.tile, ah.tile, aw.tile, Ko, 3)
    g = g.permute(0, 2, 5, 3, 6, 4, 7, 1, 8, 9)  # (B, ct, tt, ch, th, nw, tw, heads, Ko, 3)
    g = g.reshape(B, ct * at.tile, ch * ah.tile, aw.n * aw.tile, heads, Ko, 3)
    T0, H0 = t0 * at.tile, h0 * ah.tile
    T1, H1 = min(T0 + ct * at.tile, T), min(H0 + ch * ah.tile, H)
    d_off[:, T0:T1, H0:H1] += g[:, : T1 - T0, : H1 - H0, :W]
