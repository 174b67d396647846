"""Triton kernels for slide / neighbourhood attention ("triton", CUDA), forward and backward.

One program handles BLOCK_Q consecutive query tokens of one (sample, head). It walks the K window
slots with an online softmax (FlashAttention's running max and sum), so nothing of size N*K is
stored: per slot it builds the trilinearly interpolated key and value rows from their 8 corners
(`_gather`, shared by both passes), which stay in L1/L2 because neighbouring queries read
overlapping windows. The forward stores the log-sum-exp; the backward replays the walk from it.
dK and dV go to their corners with atomic adds (a corner is shared by many queries), and the
offset gradient of a slot is d score / d point plus p * dO . d value / d point, zeroed where the
grid clamp holds the point. The backward reads delta = rowsum(dO * out) - dlse, which makes the
same formula the gradient of the log-sum-exp output as well (d lse / d score = p).

Extra (global) keys are not fused here: they are a dense block that a tensor-core matmul handles
better than a per-query walk, and their dK / dV would be atomics on the same few rows from every
query. `attention/joint.py` attends to them and merges the two results by their log-sum-exps.

Layouts: q, k, v, out (B, N, heads, D) contiguous (N = T*H*W); lse and delta (B, N, heads) float32.
The same code runs on the CPU under TRITON_INTERPRET=1, which is how the test suite checks it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _axis(pos, length):
    """Clamp a sample coordinate into [0, length - 1]: low/high corner, fraction, not-clamped flag.

    A NaN coordinate reads position 0 (an index stays in the grid); `_slot_points` makes its score NaN.
    """
    inside = (pos > 0.0) & (pos < length - 1.0)
    p = tl.minimum(tl.maximum(tl.where(pos == pos, pos, 0.0), 0.0), length - 1.0)
    f = tl.floor(p)
    lo = f.to(tl.int32)
    hi = tl.minimum(lo + 1, length - 1)
    return lo, hi, p - f, inside


@triton.jit
def _corner(c: tl.constexpr, t0, t1, h0, h1, w0, w1, ft, fh, fw, H, W):
    """Corner c = 4*bit_t + 2*bit_h + bit_w of the 8 around each point.

    Returns its grid token, its trilinear weight, and the weight's derivative along t, h and w
    (the forward drops the derivatives; the compiler removes them).
    """
    it = t1 if (c >> 2) & 1 else t0
    ih = h1 if (c >> 1) & 1 else h0
    iw = w1 if c & 1 else w0
    wt = ft if (c >> 2) & 1 else 1.0 - ft
    wh = fh if (c >> 1) & 1 else 1.0 - fh
    ww = fw if c & 1 else 1.0 - fw
    st = 1.0 if (c >> 2) & 1 else -1.0
    sh = 1.0 if (c >> 1) & 1 else -1.0
    sw = 1.0 if c & 1 else -1.0
    return (it * H + ih) * W + iw, wt * wh * ww, st * wh * ww, sh * wt * ww, sw * wt * wh


@triton.jit
def _slot_points(s, st, sh, sw, OFF, off_row, qmask, KH: tl.constexpr, KW: tl.constexpr, KO: tl.constexpr,
                 HAS_OFF: tl.constexpr):
    """Unclamped sample point (t, h, w) of window slot s for each query: 3 x (BLOCK_Q,) float32."""
    pt = (st + s // (KH * KW)).to(tl.float32)
    ph = (sh + (s // KW) % KH).to(tl.float32)
    pw = (sw + s % KW).to(tl.float32)
    if HAS_OFF:
        ptr = OFF + (off_row * KO + (s if KO > 1 else 0)) * 3
        pt += tl.load(ptr + 0, mask=qmask, other=0.0).to(tl.float32)
        ph += tl.load(ptr + 1, mask=qmask, other=0.0).to(tl.float32)
        pw += tl.load(ptr + 2, mask=qmask, other=0.0).to(tl.float32)
    return pt, ph, pw


@triton.jit
def _starts(n, T, H, W, KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr):
    """Window start of each query token on each axis (NATTEN's border rule)."""
    t = n // (H * W)
    h = (n // W) % H
    w = n % W
    st = tl.minimum(tl.maximum(t - KT // 2, 0), T - KT)
    sh = tl.minimum(tl.maximum(h - KH // 2, 0), H - KH)
    sw = tl.minimum(tl.maximum(w - KW // 2, 0), W - KW)
    return st, sh, sw


@triton.jit
def _gather(K, V, base, stride, d, m2, t0, t1, h0, h1, w0, w1, ft, fh, fw, H, W,
            BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, GRADS: tl.constexpr):
    """One slot's interpolated key and value rows (BLOCK_Q, BLOCK_D) from their 8 corners; with GRADS
    also each row's derivative along t, h and w (for the offset gradient; zeros without)."""
    kv = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    vv = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    dk_t = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    dk_h = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    dk_w = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    dv_t = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    dv_h = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    dv_w = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    for c in tl.static_range(8):
        token, wgt, gt, gh, gw = _corner(c, t0, t1, h0, h1, w0, w1, ft, fh, fw, H, W)
        ptr = base + token[:, None] * stride + d[None, :]
        kc = tl.load(K + ptr, mask=m2, other=0.0).to(tl.float32)
        vc = tl.load(V + ptr, mask=m2, other=0.0).to(tl.float32)
        kv += wgt[:, None] * kc
        vv += wgt[:, None] * vc
        if GRADS:
            dk_t += gt[:, None] * kc
            dk_h += gh[:, None] * kc
            dk_w += gw[:, None] * kc
            dv_t += gt[:, None] * vc
            dv_h += gh[:, None] * vc
            dv_w += gw[:, None] * vc
    return kv, vv, dk_t, dk_h, dk_w, dv_t, dv_h, dv_w


@triton.jit
def _scatter(DK, DV, base, stride, d, m2, t0, t1, h0, h1, w0, w1, ft, fh, fw, H, W, q, do, ds, scale, p):
    """Add one slot's dK (weight * ds * scale * q) and dV (weight * p * dO) into its 8 corners;
    atomics, as neighbouring queries share corners."""
    for c in tl.static_range(8):
        token, wgt, _gt, _gh, _gw = _corner(c, t0, t1, h0, h1, w0, w1, ft, fh, fw, H, W)
        ptr = base + token[:, None] * stride + d[None, :]
        tl.atomic_add(DK + ptr, (wgt * ds * scale)[:, None] * q, mask=m2)
        tl.atomic_add(DV + ptr, (wgt * p)[:, None] * do, mask=m2)


@triton.jit
def _axis_grad(inside, a, p, q, do, dk, dv):
    """d loss / d point along one axis: through the score and through the value, zero where clamped."""
    return tl.where(inside, a * tl.sum(q * dk, axis=1) + p * tl.sum(do * dv, axis=1), 0.0)


@triton.jit
def _slide_fwd(Q, K, V, OFF, OUT, LSE, T, H, W, N, HEADS, scale,
               KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, KO: tl.constexpr, HAS_OFF: tl.constexpr,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr):
    pid_q, bh = tl.program_id(0), tl.program_id(1)
    b, head = bh // HEADS, bh % HEADS
    n = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # (BLOCK_Q,) query tokens
    qmask = n < N
    d = tl.arange(0, BLOCK_D)
    m2 = qmask[:, None] & (d < D)[None, :]
    stride = HEADS * D  # between tokens
    base = b * N * stride + head * D
    q = tl.load(Q + base + n[:, None] * stride + d[None, :], mask=m2, other=0.0).to(tl.float32)
    st, sh, sw = _starts(n, T, H, W, KT, KH, KW)
    off_row = (b * N + n) * HEADS + head  # also the (B, N, heads) index of lse
    m_i = tl.full((BLOCK_Q,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_Q,), tl.float32)
    acc = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    for s in range(KT * KH * KW):
        pt, ph, pw = _slot_points(s, st, sh, sw, OFF, off_row, qmask, KH, KW, KO, HAS_OFF)
        t0, t1, ft, _it = _axis(pt, T)
        h0, h1, fh, _ih = _axis(ph, H)
        w0, w1, fw, _iw = _axis(pw, W)
        kv, vv, _, _, _, _, _, _ = _gather(K, V, base, stride, d, m2, t0, t1, h0, h1, w0, w1, ft, fh, fw, H, W,
                                           BLOCK_Q, BLOCK_D, False)
        score = tl.sum(q * kv, axis=1) * scale
        score = tl.where((pt == pt) & (ph == ph) & (pw == pw), score, float("nan"))  # NaN offsets: NaN out
        m_new = tl.maximum(m_i, score)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(score - m_new)
        acc = acc * alpha[:, None] + p[:, None] * vv
        l_i = l_i * alpha + p
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(OUT + base + n[:, None] * stride + d[None, :], out.to(OUT.dtype.element_ty), mask=m2)
    tl.store(LSE + off_row, m_i + tl.log(l_i), mask=qmask)


@triton.jit
def _slide_bwd(Q, K, V, OFF, DO, LSE, DELTA, DQ, DK, DV, DOFF, T, H, W, N, HEADS, scale,
               KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, KO: tl.constexpr, HAS_OFF: tl.constexpr,
               D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr):
    pid_q, bh = tl.program_id(0), tl.program_id(1)
    b, head = bh // HEADS, bh % HEADS
    n = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    qmask = n < N
    d = tl.arange(0, BLOCK_D)
    m2 = qmask[:, None] & (d < D)[None, :]
    stride = HEADS * D
    base = b * N * stride + head * D
    rows = n[:, None] * stride + d[None, :]
    q = tl.load(Q + base + rows, mask=m2, other=0.0).to(tl.float32)
    do = tl.load(DO + base + rows, mask=m2, other=0.0).to(tl.float32)
    off_row = (b * N + n) * HEADS + head
    lse = tl.load(LSE + off_row, mask=qmask, other=0.0)
    delta = tl.load(DELTA + off_row, mask=qmask, other=0.0)
    st, sh, sw = _starts(n, T, H, W, KT, KH, KW)
    dq = tl.zeros((BLOCK_Q, BLOCK_D), tl.float32)
    g_t = tl.zeros((BLOCK_Q,), tl.float32)  # offset gradient summed over slots (KO == 1)
    g_h = tl.zeros((BLOCK_Q,), tl.float32)
    g_w = tl.zeros((BLOCK_Q,), tl.float32)
    for s in range(KT * KH * KW):
        pt, ph, pw = _slot_points(s, st, sh, sw, OFF, off_row, qmask, KH, KW, KO, HAS_OFF)
        t0, t1, ft, in_t = _axis(pt, T)
        h0, h1, fh, in_h = _axis(ph, H)
        w0, w1, fw, in_w = _axis(pw, W)
        kv, vv, dk_t, dk_h, dk_w, dv_t, dv_h, dv_w = _gather(K, V, base, stride, d, m2, t0, t1, h0, h1, w0, w1,
                                                             ft, fh, fw, H, W, BLOCK_Q, BLOCK_D, HAS_OFF)
        p = tl.exp(tl.sum(q * kv, axis=1) * scale - lse)
        ds = p * (tl.sum(do * vv, axis=1) - delta)  # d loss / d score
        dq += ds[:, None] * kv
        _scatter(DK, DV, base, stride, d, m2, t0, t1, h0, h1, w0, w1, ft, fh, fw, H, W, q, do, ds, scale, p)
        if HAS_OFF:
            a = ds * scale
            gt = _axis_grad(in_t, a, p, q, do, dk_t, dv_t)
            gh = _axis_grad(in_h, a, p, q, do, dk_h, dv_h)
            gw = _axis_grad(in_w, a, p, q, do, dk_w, dv_w)
            if KO > 1:
                ptr = DOFF + (off_row * KO + s) * 3
                tl.store(ptr + 0, gt, mask=qmask)
                tl.store(ptr + 1, gh, mask=qmask)
                tl.store(ptr + 2, gw, mask=qmask)
            else:
                g_t += gt
                g_h += gh
                g_w += gw
    tl.store(DQ + base + rows, dq * scale, mask=m2)
    if HAS_OFF:
        if KO == 1:
            tl.store(DOFF + off_row * 3 + 0, g_t, mask=qmask)
            tl.store(DOFF + off_row * 3 + 1, g_h, mask=qmask)
            tl.store(DOFF + off_row * 3 + 2, g_w, mask=qmask)


BLOCK_Q = 32


def _launch_args(q, kernel, offsets):
    B, T, H, W, heads, D = q.shape
    N = T * H * W
    ko = 1 if offsets is None else offsets.shape[5]
    grid = (triton.cdiv(N, BLOCK_Q), B * heads)
    consts = dict(KT=kernel[0], KH=kernel[1], KW=kernel[2], KO=ko, HAS_OFF=offsets is not None, D=D,
                  BLOCK_D=triton.next_power_of_2(D), BLOCK_Q=BLOCK_Q)
    return grid, (T, H, W, N, heads), consts


def forward(q, k, v, offsets, kernel, scale: float):
    """out (B, T, H, W, heads, D) in q's dtype and lse (B, T, H, W, heads) float32."""
    grid, dims, consts = _launch_args(q, kernel, offsets)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:5], device=q.device, dtype=torch.float32)
    off_arg = offsets if offsets is not None else q  # never read without offsets
    _slide_fwd[grid](q, k, v, off_arg, out, lse, *dims, scale, **consts)
    return out, lse


def backward(q, k, v, offsets, lse, delta, grad_out, kernel, scale: float):
    """(dq, dk, dv, doffsets) in the inputs' dtypes; delta = rowsum(dout * out) - dlse, float32."""
    grid, dims, consts = _launch_args(q, kernel, offsets)
    dq = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    dk = torch.zeros(q.shape, device=q.device, dtype=torch.float32)  # atomics accumulate in fp32
    dv = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
    doff = q.new_empty(0) if offsets is None else torch.zeros(offsets.shape, device=q.device, dtype=torch.float32)
    off_arg = offsets if offsets is not None else q
    doff_arg = doff if offsets is not None else dq
    _slide_bwd[grid](q, k, v, off_arg, grad_out.contiguous(), lse.contiguous(), delta.float().contiguous(),
                     dq, dk, dv, doff_arg, *dims, scale, **consts)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), doff.to(q.dtype)
