"""Self-attention on a 3D token grid, as plain functions.

Tensors use NATTEN's layout: q, k, v are (B, T, H, W, heads, D) and the output has the shape and
dtype of q. The math runs in `torch.nn.functional.scaled_dot_product_attention`, so each call picks
up whatever fused kernel the device has. `reference.py` holds the slow specification that the tests
compare against.

Window semantics (`window_attention`). Along an axis of length L, a window w >= L is clamped to L
and the shift on that axis becomes 0 (as Video Swin does). Otherwise, with shift s, the boundaries
between windows lie at s + k*w (k integer) in the original coordinates, and tokens i and j attend
to each other iff they lie between the same pair of boundaries on all three axes. So [0, s) is a
window of its own, and so is the final partial segment. This is Swin's roll + partition + region
mask, extended to grids the window does not divide by padding at the end and masking the padding.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from slidefusion.attention import backends, joint
from slidefusion.attention.backends import ops
from slidefusion.attention.reference import slide_attention_reference
from slidefusion.core.errors import UserError, check

Triple = tuple[int, int, int]


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check(q.dim() == 6, f"q must be 6-D (B, T, H, W, heads, D); got shape {tuple(q.shape)}")
    check(k.shape == q.shape, f"k must have the shape of q {tuple(q.shape)}; got {tuple(k.shape)}")
    check(v.shape == q.shape, f"v must have the shape of q {tuple(q.shape)}; got {tuple(v.shape)}")


def _check_triple(name: str, value: Sequence[int]) -> Triple:
    ok = isinstance(value, Sequence) and len(value) == 3
    ok = ok and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
    check(ok, f"{name} must be 3 ints (t, h, w); got {value!r}")
    return tuple(value)


def check_window_args(window_size: Sequence[int], shift: Sequence[int]) -> tuple[Triple, Triple]:
    """Validate `window_size` (3 ints >= 1) and `shift` (3 ints, 0 <= shift < window); return tuples."""
    window_size = _check_triple("window_size", window_size)
    shift = _check_triple("shift", shift)
    check(all(w >= 1 for w in window_size), f"window_size must be >= 1 on every axis; got {window_size}")
    for axis, (w, s) in enumerate(zip(window_size, shift)):
        if not 0 <= s < w:
            raise UserError(f"shift[{axis}]={s} must satisfy 0 <= shift < window_size[{axis}]={w}")
    return window_size, shift


def effective_window(grid: Triple, window_size: Triple, shift: Triple) -> tuple[Triple, Triple]:
    """Clamp the window to the grid; an axis the window covers whole gets no shift (as Video Swin)."""
    window = tuple(min(w, n) for w, n in zip(window_size, grid))
    shift = tuple(0 if w >= n else s for w, s, n in zip(window_size, shift, grid))
    return window, shift


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Every token attends to every token. q, k, v: (B, T, H, W, heads, D) -> (B, T, H, W, heads, D).

    `scale` multiplies q k^T and defaults to D ** -0.5.
    """
    _check_qkv(q, k, v)
    B, T, H, W, heads, D = q.shape
    scale = D**-0.5 if scale is None else scale

    def to_heads(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(B, T * H * W, heads, D).transpose(1, 2)  # (B, heads, N, D)

    out = F.scaled_dot_product_attention(to_heads(q), to_heads(k), to_heads(v), scale=scale)
    return out.transpose(1, 2).reshape(B, T, H, W, heads, D)  # (B, T, H, W, heads, D)


def _padded(grid: Triple, window: Triple) -> Triple:
    return tuple(-(-n // w) * w for n, w in zip(grid, window))


def _to_windows(x: torch.Tensor, window: Triple, shift: Triple) -> torch.Tensor:
    """(B, Tp, Hp, Wp, heads, D), padded to whole windows -> (nWin, B*heads, Nw, D).

    Rolling by -shift moves the boundary at `shift` to 0, so windows start at multiples of the
    window there. Batch and heads share SDPA's head axis so that one (nWin, 1, Nw, Nw) mask
    broadcasts over both without being copied per sample.
    """
    B, Tp, Hp, Wp, heads, D = x.shape
    (wt, wh, ww), Nw = window, window[0] * window[1] * window[2]
    x = torch.roll(x, shifts=tuple(-s for s in shift), dims=(1, 2, 3))
    x = x.reshape(B, Tp // wt, wt, Hp // wh, wh, Wp // ww, ww, heads, D)  # (B, nT, wt, nH, wh, nW, ww, h, D)
    x = x.permute(1, 3, 5, 0, 7, 2, 4, 6, 8)  # (nT, nH, nW, B, heads, wt, wh, ww, D)
    return x.reshape(-1, B * heads, Nw, D)  # (nWin, B*heads, Nw, D)


def _from_windows(x: torch.Tensor, padded: Triple, window: Triple, shift: Triple, B: int) -> torch.Tensor:
    """Inverse of `_to_windows`: (nWin, B*heads, Nw, D) -> (B, Tp, Hp, Wp, heads, D)."""
    (Tp, Hp, Wp), (wt, wh, ww) = padded, window
    D = x.shape[-1]
    x = x.reshape(Tp // wt, Hp // wh, Wp // ww, B, -1, wt, wh, ww, D)  # (nT, nH, nW, B, heads, wt, wh, ww, D)
    x = x.permute(3, 0, 5, 1, 6, 2, 7, 4, 8)  # (B, nT, wt, nH, wh, nW, ww, heads, D)
    x = x.reshape(B, Tp, Hp, Wp, -1, D)  # (B, Tp, Hp, Wp, heads, D)
    return torch.roll(x, shifts=shift, dims=(1, 2, 3))


def _window_mask(grid: Triple, window: Triple, shift: Triple, device: torch.device) -> torch.Tensor:
    """Boolean mask (nWin, 1, Nw, Nw): query may see key (same segment on every axis, key not padding).

    Each padded position is labelled with its segment id per axis (the boundary rule) and a
    "real" flag; the labels then go through the same roll + partition as the tokens, so mask and
    tokens cannot disagree about which token sits where.
    """
    axes = []
    for n, w, s, p in zip(grid, window, shift, _padded(grid, window)):
        i = torch.arange(p, device=device)  # (Lp,) original coordinate
        axes.append((torch.div(i - s, w, rounding_mode="floor"), i < n))  # segment id, real
    seg = torch.stack(torch.meshgrid(*(a[0] for a in axes), indexing="ij"), dim=-1)  # (Tp, Hp, Wp, 3)
    real = torch.meshgrid(*(a[1] for a in axes), indexing="ij")
    real = (real[0] & real[1] & real[2]).unsqueeze(-1).long()  # (Tp, Hp, Wp, 1)
    labels = torch.cat([seg, real], dim=-1)[None, :, :, :, None]  # (1, Tp, Hp, Wp, 1, 4)
    labels = _to_windows(labels, window, shift)  # (nWin, 1, Nw, 4)
    seg, real = labels[..., :3], labels[..., 3].bool()
    mask = (seg[..., :, None, :] == seg[..., None, :, :]).all(-1) & real[..., None, :]  # (nWin, 1, Nw, Nw)
    # A padding query may have no visible key (a window slice of pure padding); an all-False row
    # makes SDPA return NaN, whose gradient would leak into k and v. Letting every token see
    # itself changes nothing for real queries and keeps padding rows finite; they are cropped.
    return mask | torch.eye(mask.shape[-1], dtype=torch.bool, device=device)


def window_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window_size: Sequence[int] = (2, 4, 4),
    shift: Sequence[int] = (0, 0, 0),
    scale: float | None = None,
) -> torch.Tensor:
    """Swin-style 3D (shifted) window attention. q, k, v: (B, T, H, W, heads, D) -> same shape.

    `window_size` = (wt, wh, ww) tokens, `shift` = (st, sh, sw) with 0 <= shift < window; see the
    module docstring for exactly which tokens see each other. `scale` defaults to D ** -0.5.
    """
    _check_qkv(q, k, v)
    window_size, shift = check_window_args(window_size, shift)
    B, T, H, W, heads, D = q.shape
    grid = (T, H, W)
    window, shift = effective_window(grid, window_size, shift)
    padded = _padded(grid, window)
    scale = D**-0.5 if scale is None else scale

    pad = (0, 0, 0, 0, 0, padded[2] - W, 0, padded[1] - H, 0, padded[0] - T)  # F.pad goes last dim first

    def windows(x: torch.Tensor) -> torch.Tensor:
        return _to_windows(F.pad(x, pad), window, shift)  # (nWin, B*heads, Nw, D)

    # Without shift or padding every window holds one segment: skip the mask so SDPA can use its
    # fastest kernels.
    needs_mask = any(shift) or padded != grid
    mask = _window_mask(grid, window, shift, q.device) if needs_mask else None
    out = F.scaled_dot_product_attention(windows(q), windows(k), windows(v), attn_mask=mask, scale=scale)
    out = _from_windows(out, padded, window, shift, B)  # (B, Tp, Hp, Wp, heads, D)
    return out[:, :T, :H, :W]  # (B, T, H, W, heads, D)


# ---------------------------------------------------------------------------------------------
# Neighbourhood and slide attention: argument checks here, the math in `backends` (the window)
# and `joint` (extra keys).

_AXES = ("T", "H", "W")


def check_kernel_size(kernel_size: Sequence[int]) -> Triple:
    """Validate `kernel_size`: 3 odd ints >= 1 (kt, kh, kw); return it as a tuple."""
    kernel = _check_triple("kernel_size", kernel_size)
    check(
        all(x >= 1 and x % 2 == 1 for x in kernel),
        f"kernel_size must be odd and >= 1 on every axis (1, 3, 5, ...); got {kernel}",
    )
    return kernel


def effective_kernel(kernel: Triple, grid: Triple) -> Triple:
    """The window slide attention uses on `grid`: kernel_size clamped to the grid per axis.

    A window larger than the grid along an axis covers that axis whole (as `window_attention`
    clamps its windows), so a window that covers the grid is dense attention on any grid; the
    clamped size may be even. NATTEN raises instead.
    """
    return tuple(min(kern, n) for kern, n in zip(kernel, grid))


def _check_slide_args(q, k, v, kernel_size, offsets, scale) -> Triple:
    """Check q, k, v, kernel_size, offsets and scale; return the effective (clamped) kernel."""
    _check_qkv(q, k, v)
    check(
        q.is_floating_point() and k.dtype == q.dtype and v.dtype == q.dtype,
        f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}",
    )
    check(k.device == q.device and v.device == q.device, "q, k, v must be on one device")
    kernel = effective_kernel(check_kernel_size(kernel_size), tuple(q.shape[1:4]))
    if offsets is not None:
        K = kernel[0] * kernel[1] * kernel[2]
        expected = (*q.shape[:5], K, 3)
        ok = isinstance(offsets, torch.Tensor) and offsets.dim() == 7
        ok = ok and offsets.shape[:5] == q.shape[:5] and offsets.shape[5] in (1, K) and offsets.shape[6] == 3
        check(ok, f"offsets must be None or {expected} (or K=1; K counts the window {kernel} clamped to the grid); "
                  f"got {_shape_of(offsets)}")
        check(offsets.is_floating_point(), f"offsets must be a floating tensor; got {offsets.dtype}")
        check(offsets.device == q.device, f"offsets must be on q's device {q.device}; got {offsets.device}")
    check(
        scale is None or (isinstance(scale, (int, float)) and not isinstance(scale, bool)),
        f"scale must be None or a number; got {scale!r}",
    )
    return kernel


def _check_extra(q, extra_k, extra_v, extra_mask) -> None:
    if extra_k is None and extra_v is None:
        check(extra_mask is None, "extra_mask needs extra_k and extra_v")
        return
    B, heads, D = q.shape[0], q.shape[4], q.shape[5]
    for name, x in (("extra_k", extra_k), ("extra_v", extra_v)):
        ok = isinstance(x, torch.Tensor) and x.dim() == 4 and x.shape[0] == B and x.shape[2:] == (heads, D)
        check(ok and x.shape[1] >= 1, f"{name} must be (B={B}, L>=1, heads={heads}, D={D}); got {_shape_of(x)}")
        check(x.dtype == q.dtype and x.device == q.device, f"{name} must have q's dtype {q.dtype} and device {q.device}")
    check(extra_v.shape == extra_k.shape, f"extra_v must have the shape of extra_k {tuple(extra_k.shape)}")
    if extra_mask is not None:
        L = extra_k.shape[1]
        ok = isinstance(extra_mask, torch.Tensor) and extra_mask.dtype == torch.bool
        check(ok and extra_mask.shape == (B, L), f"extra_mask must be a bool (B={B}, L={L}) tensor; got {_shape_of(extra_mask)}")
        check(extra_mask.device == q.device, f"extra_mask must be on q's device {q.device}")


def _shape_of(x) -> str:
    return str(tuple(x.shape)) if isinstance(x, torch.Tensor) else type(x).__name__


def slide_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: Sequence[int] = (3, 7, 7),
    offsets: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    extra_k: torch.Tensor | None = None,
    extra_v: torch.Tensor | None = None,
    extra_mask: torch.Tensor | None = None,
    return_lse: bool = False,
    backend: str = "auto",
):
    """3D deformable slide attention, optionally joint with global keys, under one softmax.

    q, k, v: (B, T, H, W, heads, D) video tokens on a T x H x W grid.
    Each query attends to its kt x kh x kw window (NATTEN's border rule: along an axis of length L
    the window of query i starts at clamp(i - k//2, 0, L - k)); a window larger than the grid along
    an axis is clamped to it (`effective_kernel`). `offsets` (B, T, H, W, heads, K, 3), K = kt*kh*kw
    of the clamped window in row-major (t, h, w) window order (or K=1: one shift for the whole
    window), moves every sample point by (dt, dh, dw) tokens; the point is clamped into the grid and
    keys and values there are read by trilinear interpolation. No offsets: neighbourhood attention.

    Extra keys: extra_k, extra_v (B, L, heads, D), e.g. the text tokens of a joint text+video block
    or a few registers. Every video query also sees all L of them (only those where extra_mask
    (B, L) bool is True), in the same softmax as its window: the result equals a dense softmax
    over [window keys ; extra keys]. (The text queries of a joint block attend densely to
    everything: `joint_attention` does both halves.)

    `scale` multiplies q . k and defaults to D ** -0.5. `backend`: "auto" | "reference" | "tiled" |
    "cpp" | "triton" (see `backends`). Differentiable in q, k, v, offsets, extra_k and extra_v,
    and through both outputs.

    Returns out (B, T, H, W, heads, D) in q's dtype; with return_lse=True, (out, lse) where lse
    (B, T, H, W, heads) = log of the softmax denominator, log sum exp of the scaled scores over
    every key the query sees, in float32 (float64 for float64 inputs).
    """
    kernel = _check_slide_args(q, k, v, kernel_size, offsets, scale)
    _check_extra(q, extra_k, extra_v, extra_mask)
    check(isinstance(return_lse, bool), f"return_lse must be True or False; got {return_lse!r}")
    name = backends.choose(backend, q.device)
    if name == "reference":
        out, lse = slide_attention_reference(q, k, v, kernel, offsets, scale, extra_k, extra_v, extra_mask, True)
    else:
        n = backends.normalise(q, k, v, offsets, scale, name)
        out, lse = ops.slide_with_lse(n, kernel, name)
        if extra_k is not None:
            B, T, H, W, heads, D = q.shape
            ek, ev = extra_k.contiguous(), extra_v.contiguous()
            out_x, lse_x = joint.extra_forward(n.q.view(B, T * H * W, heads, D), ek, ev, extra_mask, n.scale)
            out, lse = joint.merge_attention(out, lse, out_x.view(out.shape), lse_x.view(lse.shape))
    out = out.to(q.dtype)
    return (out, lse) if return_lse else out


def neighborhood_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kernel_size: Sequence[int] = (3, 7, 7),
    scale: float | None = None,
    **options,
):
    """3D neighbourhood attention (NATTEN's `na3d`): `slide_attention` without offsets.

    `options` are slide_attention's keyword arguments (extra_k, extra_v, extra_mask, return_lse, backend).
    """
    return slide_attention(q, k, v, kernel_size, None, scale, **options)


def joint_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    text_q: torch.Tensor,
    text_k: torch.Tensor,
    text_v: torch.Tensor,
    kernel_size: Sequence[int] = (3, 7, 7),
    offsets: torch.Tensor | None = None,
    scale: float | None = None,
    *,
    text_mask: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Joint text+video attention (CogVideoX, HunyuanVideo, Mochi) with a slide window for the video.

    q, k, v: (B, T, H, W, heads, D) video tokens; text_q, text_k, text_v: (B, L, heads, D);
    text_mask: None or (B, L) bool, True = a real text token (padding is never attended to).
    Video queries see their slide window plus every real text token under one softmax
    (`slide_attention` with extra keys); text queries attend densely to all real text tokens and
    all video tokens. Returns (video_out (B, T, H, W, heads, D), text_out (B, L, heads, D)).
    """
    video = slide_attention(
        q, k, v, kernel_size, offsets, scale, extra_k=text_k, extra_v=text_v, extra_mask=text_mask, backend=backend
    )
    check(text_q.shape == text_k.shape, f"text_q must have the shape of text_k {tuple(text_k.shape)}")
    B, T, H, W, heads, D = q.shape
    keys = torch.cat([text_k, k.reshape(B, T * H * W, heads, D)], dim=1).transpose(1, 2)  # (B, heads, L+N, D)
    values = torch.cat([text_v, v.reshape(B, T * H * W, heads, D)], dim=1).transpose(1, 2)
    mask = None
    if text_mask is not None:
        seen = torch.cat([text_mask, text_mask.new_ones(B, T * H * W)], dim=1)  # (B, L+N)
        mask = seen[:, None, None, :]
    text = F.scaled_dot_product_attention(text_q.transpose(1, 2), keys, values, attn_mask=mask, scale=scale)
    return video, text.transpose(1, 2)  # (B, L, heads, D)
