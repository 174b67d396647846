"""Softmax attention computed in key chunks and merged by log-sum-exp (as ring attention does).

Sliced Ulysses receives keys and values chunk by chunk; each query chunk attends to every key chunk
as it arrives, and the partial results merge exactly: with o_i = softmax(q K_i^T s) V_i and
l_i = logsumexp(q K_i^T s), the whole is sum_i exp(l_i - l) o_i with l = logaddexp over i.
Tensors are token-major: (G, M, heads, D); log-sum-exps are (G, M, heads), float32.
"""

import torch
from torch import Tensor


def attention_lse(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor] | None:
    """Softmax attention of q (G, Mq, h, D) over k, v (G, Mk, h, D) at scale D^-0.5.

    Returns (out (G, Mq, h, D), lse (G, Mq, h) float32), or None when there are no queries or keys
    (the fused kernels do not accept empty sequences)."""
    if q.shape[1] == 0 or k.shape[1] == 0 or q.shape[2] == 0:
        return None
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))  # (G, h, M, D)
    if q.is_cuda:
        # Not run on this project's CPU machines; benchmarks/gpu/parallel.sh checks it against the reference.
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qh, kh, vh, None, True)[:2]
        lse = lse[..., :q.shape[1]]  # the kernel pads the sequence of its log-sum-exp
    elif q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qh, kh, vh)
    else:
        return attention_lse_reference(q, k, v)
    return out.transpose(1, 2), lse.transpose(1, 2).float()


def attention_lse_reference(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor] | None:
    """The plain specification of `attention_lse` (materialises the scores)."""
    if q.shape[1] == 0 or k.shape[1] == 0 or q.shape[2] == 0:
        return None
    scores = torch.einsum("gqhd,gkhd->ghqk", q, k) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(scores, dim=-1)  # (G, h, Mq)
    out = torch.einsum("ghqk,gkhd->gqhd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(1, 2).float()


def merge(a: tuple[Tensor, Tensor] | None, b: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor] | None:
    """Combine two partial attentions of the same queries over disjoint key sets."""
    if a is None or b is None:
        return b if a is None else a
    (oa, la), (ob, lb) = a, b
    lse = torch.logaddexp(la, lb)
    out = oa * torch.exp(la - lse).unsqueeze(-1).to(oa.dtype) + ob * torch.exp(lb - lse).unsqueeze(-1).to(ob.dtype)
    return out, lse
