"""Inputs shared by the attention tests: random q/k/v, offsets away from kinks, gradients."""

import torch

from slidefusion.attention import slide_attention
from slidefusion.attention.backends import tiled
from slidefusion.attention.reference import slide_attention_reference


def qkv(grid, batch=2, heads=3, head_dim=5, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(batch, *grid, heads, head_dim, generator=g, dtype=dtype) for _ in range(3)]


def random_offsets(q, slots, reach=1.4, seed=1):
    """Offsets in (-reach, reach), kept 0.05 away from integers, where interpolation has kinks."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(*q.shape[:5], slots, 3, generator=g, dtype=q.dtype) * 2 - 1) * reach
    frac = x - x.floor()
    return torch.where(frac < 0.05, x + 0.05, torch.where(frac > 0.95, x - 0.05, x))


def grads(fn, q, k, v, off, seed=2):
    """Output and gradients of sum(fn(...) * g) for a fixed random g: (out, dq, dk, dv[, doff])."""
    inputs = [x.detach().requires_grad_() for x in (q, k, v)]
    if off is not None:
        inputs.append(off.detach().requires_grad_())
    out = fn(*inputs[:3], inputs[3] if off is not None else None)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return (out, *torch.autograd.grad((out * g).sum(), inputs))


def assert_low_precision_matches_reference(fn, dtype, tol, slots):
    """`fn(q, k, v, (3, 3, 3), offsets)` in `dtype` keeps the dtype and matches the float64 reference."""
    q, k, v = qkv((3, 5, 7), dtype=dtype)
    off = random_offsets(q, slots)
    out = fn(q, k, v, (3, 3, 3), off)
    assert out.dtype == dtype
    ref = slide_attention_reference(*(x.double() for x in (q, k, v)), (3, 3, 3), off.double())
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def extra_kv(q, L, masked=(), seed=3):
    """Extra keys and values (B, L, heads, D) like q, and a key mask (B, L) False at `masked` (b, l) pairs."""
    g = torch.Generator().manual_seed(seed)
    B, heads, D = q.shape[0], q.shape[4], q.shape[5]
    k, v = (torch.randn(B, L, heads, D, generator=g, dtype=q.dtype) for _ in range(2))
    mask = torch.ones(B, L, dtype=torch.bool)
    for b, l in masked:
        mask[b, l] = False
    return k, v, mask


def tiled_op(monkeypatch, tile):
    """slide_attention on the tiled backend with query tiles `tile` (None: the defaults)."""
    if tile is not None:
        monkeypatch.setattr(tiled, "SLIDE_TILE", tile)
        monkeypatch.setattr(tiled, "NEIGHBORHOOD_TILE", tile)

    def op(q, k, v, kernel, offsets=None, scale=None, **options):
        return slide_attention(q, k, v, kernel, offsets, scale, backend="tiled", **options)

    return op
