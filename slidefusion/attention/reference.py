"""The plain, slow specification of the attention operators; the tests compare the fast ones to it.

Dense, window and neighbourhood attention are masked dense attention over the flattened grid: each
builds the full N x N "may attend" mask from its definition and computes softmax(q k^T * scale) v
explicitly, in at least float32. Slide attention gathers every query's interpolated keys and
values, then takes the softmax. No tiles, rolls or padding, so each function can be checked by
reading it.
Tensors are (B, T, H, W, heads, D), as in `functional.py`.
"""

import torch


def masked_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """softmax(q k^T * scale) v over the flattened grid; `mask` (N, N) bool, True = may attend."""
    B, T, H, W, heads, D = q.shape
    scale = D**-0.5 if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)

    def flat(x: torch.Tensor) -> torch.Tensor:
        return x.to(dtype).reshape(B, T * H * W, heads, D).transpose(1, 2)  # (B, heads, N, D)

    scores = flat(q) @ flat(k).transpose(-1, -2) * scale  # (B, heads, N, N)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    out = scores.softmax(dim=-1) @ flat(v)  # (B, heads, N, D)
    return out.transpose(1, 2).reshape(q.shape).to(q.dtype)  # (B, T, H, W, heads, D)


def dense_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Every token attends to every token."""
    return masked_attention_reference(q, k, v, None, scale)


def window_segments(length: int, window: int, shift: int) -> torch.Tensor:
    """Window id of each position 0..length-1 along one axis: (length,) int64.

    A window covering the whole axis is clamped to it, unshifted. Otherwise the boundaries lie at
    shift + k*window, so the id is floor((i - shift) / window): [0, shift) gets -1.
    """
    if window >= length:
        return torch.zeros(length, dtype=torch.long)
    return torch.div(torch.arange(length) - shift, window, rounding_mode="floor")


def window_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: tuple[int, int, int],
    shift: tuple[int, int, int],
    scale: float | None = None,
) -> torch.Tensor:
    """Tokens attend iff they lie in the same window segment on all three axes."""
    grid = q.shape[1:4]
    ids = [window_segments(n, w, s) for n, w, s in zip(grid, window_size, shift)]
    seg = torch.stack(torch.meshgrid(*ids, indexing="ij"), dim=-1).reshape(-1, 3)  # (N, 3)
    mask = (seg[:, None, :] == seg[None, :, :]).all(dim=-1).to(q.device)  # (N, N)
    return masked_attention_reference(q, k, v, mask, scale)


# ---------------------------------------------------------------------------------------------
# Neighbourhood and slide attention. Along an axis of length L, the window of query i starts at
# clamp(i - k//2, 0, L - k) (NATTEN's border rule), so every query sees exactly k positions.


def window_starts(length: int, kernel: int) -> torch.Tensor:
    """First window position of each query 0..length-1 along one axis: (length,) int64."""
    return (torch.arange(length) - kernel // 2).clamp(0, length - kernel)


def neighborhood_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel_size: tuple[int, int, int], scale: float | None = None
) -> torch.Tensor:
    """Query i may see key j iff start(i) <= j < start(i) + kernel on all three axes."""
    grid = q.shape[1:4]
    per_axis = []
    for n, kern in zip(grid, kernel_size):
        start = window_starts(n, kern)[:, None]  # (n, 1)
        j = torch.arange(n)[None, :]  # (1, n)
        per_axis.append((j >= start) & (j < start + kern))  # (n, n)
    mt, mh, mw = per_axis
    mask = mt[:, None, None, :, None, None] & mh[None, :, None, None, :, None] & mw[None, None, :, None, None, :]
    N = grid[0] * grid[1] * grid[2]
    return masked_attention_reference(q, k, v, mask.reshape(N, N).to(q.device), scale)


def window_positions(grid: tuple[int, int, int], kernel_size: tuple[int, int, int]) -> torch.Tensor:
    """Integer window position of every (query, window slot): (N, K, 3), (t, h, w) token units.

    Queries are in row-major (t, h, w) grid order, window slots in row-major (t, h, w) window order.
    """
    per_axis = [window_starts(n, kern)[:, None] + torch.arange(kern) for n, kern in zip(grid, kernel_size)]
    (T, H, W), (kt, kh, kw) = grid, kernel_size
    pt, ph, pw = per_axis  # (T, kt), (H, kh), (W, kw)
    shape = (T, H, W, kt, kh, kw)
    pos = torch.stack(
        [
            pt[:, None, None, :, None, None].expand(shape),
            ph[None, :, None, None, :, None].expand(shape),
            pw[None, None, :, None, None, :].expand(shape),
        ],
        dim=-1,
    )  # (T, H, W, kt, kh, kw, 3)
    return pos.reshape(T * H * W, kt * kh * kw, 3)


def trilinear_sample(x: torch.Tensor, points: torch.Tensor) -> torch.Tensor:
    """Read x (B, T, H, W, heads, D) at fractional points (B, N, heads, K, 3) -> (B, N, heads, K, D).

    Points must lie in [0, L - 1] on each axis. Each point mixes its 8 surrounding grid positions
    with weights prod(1 - |point - corner|); a corner index past the end (point exactly on the
    last position) is clamped, and its weight is 0 there.
    """
    B, T, H, W, heads, D = x.shape
    lo = points.floor()
    frac = points - lo  # (B, N, heads, K, 3); carries the gradient to the points
    lo = lo.long()
    hi = torch.minimum(lo + 1, torch.tensor([T - 1, H - 1, W - 1], device=x.device))
    flat = x.reshape(B, T * H * W, heads, D)
    b = torch.arange(B, device=x.device)[:, None, None, None]
    h = torch.arange(heads, device=x.device)[None, None, :, None]
    out = 0
    for corner in range(8):
        take_hi = [(corner >> (2 - axis)) & 1 for axis in range(3)]  # (t, h, w) bits
        idx = [hi[..., a] if bit else lo[..., a] for a, bit in enumerate(take_hi)]
        weight = 1
        for a, bit in enumerate(take_hi):
            weight = weight * (frac[..., a] if bit else 1 - frac[..., a])  # (B, N, heads, K)
        token = (idx[0] * H + idx[1]) * W + idx[2]  # (B, N, heads, K)
        out = out + weight[..., None] * flat[b, token, h]  # (B, N, heads, K, D)
    return out


def slide_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: tuple[int, int, int],
    offsets: torch.Tensor | None = None,
    scale: float | None = None,
    extra_k: torch.Tensor | None = None,
    extra_v: torch.Tensor | None = None,
    extra_mask: torch.Tensor | None = None,
    return_lse: bool = False,
):
    """Gather-then-softmax specification of `slide_attention`.

    The window is clamped to the grid per axis (kernel min(k, L)). Sample point of (query, slot) =
    window position + offset, clamped into [0, L - 1] per axis; keys and values there are read by
    trilinear interpolation. offsets: None or (B, T, H, W, heads, K or 1, 3) in token units, last
    dim (dt, dh, dw); an infinite offset puts its point on the edge, a NaN one makes its query-head's
    output NaN (as a NaN input does in any torch op). With extra keys, every query also scores extra_k (B, L, heads, D) (where
    extra_mask (B, L) is True, or everywhere), and one softmax runs over [window slots ; extra
    keys]. Returns out (B, T, H, W, heads, D), plus lse (B, T, H, W, heads) = log sum exp of the
    scaled scores with `return_lse`.
    """
    B, T, H, W, heads, D = q.shape
    N = T * H * W
    kernel_size = tuple(min(kern, n) for kern, n in zip(kernel_size, (T, H, W)))
    scale = D**-0.5 if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    points = window_positions((T, H, W), kernel_size).to(q.device, dtype)[None, :, None]  # (1, N, 1, K, 3)
    if offsets is not None:
        points = points + offsets.to(dtype).reshape(B, N, heads, -1, 3)  # (B, N, heads, K, 3)
    points = points.expand(B, N, heads, -1, 3)
    limit = torch.tensor([T - 1, H - 1, W - 1], device=q.device, dtype=dtype)
    points = torch.minimum(points.clamp(min=0), limit)  # an infinite offset lands on the edge
    nan = points.isnan().any(dim=-1)  # (B, N, heads, K): read at 0, then the query-head's output is NaN
    points = points.nan_to_num(0.0)
    keys, values = trilinear_sample(k, points), trilinear_sample(v, points)  # (B, N, heads, K, D)
    qf = q.reshape(B, N, heads, D)
    scores = (torch.einsum("bnhd,bnhkd->bnhk", qf, keys) * scale).masked_fill(nan, float("nan"))  # (B, N, heads, K)
    if extra_k is not None:
        extra = torch.einsum("bnhd,blhd->bnhl", qf, extra_k.to(dtype)) * scale  # (B, N, heads, L)
        if extra_mask is not None:
            extra = extra.masked_fill(~extra_mask[:, None, None, :], float("-inf"))
        scores = torch.cat([scores, extra], dim=-1)  # (B, N, heads, K + L)
        values = torch.cat([values, extra_v.to(dtype)[:, None].expand(B, N, -1, heads, D).transpose(2, 3)], dim=3)
    out = torch.einsum("bnhk,bnhkd->bnhd", scores.softmax(dim=-1), values)  # (B, N, heads, D)
    out = out.reshape(B, T, H, W, heads, D)
    if return_lse:
        return out, torch.logsumexp(scores, dim=-1).reshape(B, T, H, W, heads)
    return out
