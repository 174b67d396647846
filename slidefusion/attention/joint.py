"""Extra (global) keys under the same softmax as the slide window, and merging by log-sum-exp.

A query that sees its window slots and L extra keys (text tokens, registers) has one softmax over
[window ; extra]. With each part's own output and log-sum-exp (out_a, lse_a) and (out_b, lse_b):
    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b,
which is exactly the joint softmax (FlashAttention-2 / ring attention combine blocks this way).
The window part is `backends.ops`; the extra part is dense attention of the grid queries over the
extra keys, here, as a custom op that works query-chunk by query-chunk and saves only out and lse
(so no (N, L) score tensor outlives a chunk), on any device. A query whose extra keys are all
masked gets lse_b = -inf and out_b = 0, which the merge weighs by exactly 0.
"""

from typing import Optional

import torch

from slidefusion.attention.backends import lse_dtype

Tensor = torch.Tensor

# Scores per chunk (B * heads * queries * L); 4 MiB in float32.
CHUNK_ELEMENTS = 2**20


def _chunks(N: int, per_query: int):
    size = max(1, CHUNK_ELEMENTS // max(1, per_query))
    for start in range(0, N, size):
        yield slice(start, min(start + size, N))


def _heads_first(x: Tensor) -> Tensor:
    """(B, M, heads, D) -> (B, heads, M, D)."""
    return x.transpose(1, 2)


def _key_bias(mask: Optional[Tensor], dtype) -> Optional[Tensor]:  # noqa: UP045
    """(B, L) bool -> (B, 1, 1, L): 0 where the key may be seen, -inf where masked."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))[:, None, None]


@torch.library.custom_op("slidefusion::extra_forward", mutates_args=())
def extra_forward(
    q: Tensor, extra_k: Tensor, extra_v: Tensor, extra_mask: Optional[Tensor], scale: float  # noqa: UP045
) -> tuple[Tensor, Tensor]:
    """q (B, N, heads, D), extra_k / extra_v (B, L, heads, D), extra_mask (B, L) bool or None
    -> out (B, N, heads, D) and lse (B, N, heads), in float32 (float64 for float64 inputs);
    lse = -inf and out = 0 where every extra key is masked."""
    B, N, heads, D = q.shape
    acc = lse_dtype(q.dtype)  # scores stay in float32 even for half inputs, as in FlashAttention
    kt, vt = (_heads_first(x).to(acc) for x in (extra_k, extra_v))  # (B, heads, L, D)
    bias = _key_bias(extra_mask, acc)
    out, lse = q.new_empty(q.shape, dtype=acc), q.new_empty(B, N, heads, dtype=acc)
    for sl in _chunks(N, B * heads * kt.shape[2]):
        s = torch.matmul(_heads_first(q[:, sl]).to(acc), kt.transpose(-1, -2)).mul_(scale)  # (B, heads, n, L)
        if bias is not None:
            s.add_(bias)
        m = torch.logsumexp(s, dim=-1)  # (B, heads, n); -inf where every key is masked
        p = s.sub_(m.nan_to_num(neginf=0.0)[..., None]).exp_()  # all-masked rows: exp(-inf) = 0
        out[:, sl] = torch.matmul(p, vt).transpose(1, 2)
        lse[:, sl] = m.transpose(1, 2)
    return out, lse


@extra_forward.register_fake
def _extra_forward_fake(q, extra_k, extra_v, extra_mask, scale):
    acc = lse_dtype(q.dtype)
    return q.new_empty(q.shape, dtype=acc), q.new_empty(q.shape[:3], dtype=acc)


@torch.library.custom_op("slidefusion::extra_backward", mutates_args=())
def extra_backward(
    q: Tensor,
    extra_k: Tensor,
    extra_v: Tensor,
    extra_mask: Optional[Tensor],  # noqa: UP045
    lse: Tensor,
    delta: Tensor,
    grad_out: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dextra_k, dextra_v) in the inputs' dtypes; delta = rowsum(dout * out) - dlse, (B, N, heads)."""
    B, N, heads, D = q.shape
    acc = lse.dtype
    kt, vt = (_heads_first(x).to(acc) for x in (extra_k, extra_v))
    bias = _key_bias(extra_mask, acc)
    dq = torch.empty_like(q)
    dk, dv = torch.zeros_like(kt), torch.zeros_like(vt)  # (B, heads, L, D)
    for sl in _chunks(N, B * heads * kt.shape[2]):
        qc, do = (_heads_first(x[:, sl]).to(acc) for x in (q, grad_out))  # (B, heads, n, D)
        s = torch.matmul(qc, kt.transpose(-1, -2)).mul_(scale)
        if bias is not None:
            s.add_(bias)
        m = lse[:, sl].transpose(1, 2)[..., None]  # (B, heads, n, 1)
        p = torch.where(torch.isfinite(m), s.sub_(m).exp_(), 0.0)  # all-masked rows: no gradient
        dv += torch.matmul(p.transpose(-1, -2), do)
        ds = torch.matmul(do, vt.transpose(-1, -2)).sub_(delta[:, sl].transpose(1, 2)[..., None]).mul_(p)
        dq[:, sl] = torch.matmul(ds, kt).mul_(scale).transpose(1, 2)
        dk += torch.matmul(ds.transpose(-1, -2), qc).mul_(scale)
    return dq, _as_input(dk, extra_k), _as_input(dv, extra_v)


def _as_input(grad: Tensor, like: Tensor) -> Tensor:
    """(B, heads, L, D) accumulator -> (B, L, heads, D) in the input's dtype."""
    return grad.transpose(1, 2).to(like.dtype).contiguous()


@extra_backward.register_fake
def _extra_backward_fake(q, extra_k, extra_v, extra_mask, lse, delta, grad_out, scale):
    return torch.empty_like(q), torch.empty_like(extra_k), torch.empty_like(extra_v)


def _setup_context(ctx, inputs, output):
    q, extra_k, extra_v, extra_mask, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, extra_k, extra_v, extra_mask, out, lse)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):
    q, extra_k, extra_v, extra_mask, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    delta = (grad_out.to(lse.dtype) * out).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse
    dq, dk, dv = extra_backward(q, extra_k, extra_v, extra_mask, lse, delta, grad_out.to(lse.dtype).contiguous(), ctx.scale)
    return dq, dk, dv, None, None


extra_forward.register_autograd(_backward, setup_context=_setup_context)


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Two attentions of the same queries over disjoint key sets -> the attention over their union.

    out_* (..., D), lse_* (...); lse_b may be -inf (no visible key there: that part weighs 0).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    out = out_a * (lse_a - lse).exp()[..., None] + out_b * (lse_b - lse).exp()[..., None]
    return out, lse
