"""Sliced Ulysses' per-chunk steps fit diffusers' WanAttention (the phase-B target): q/k/v projected
per token chunk with Wan's QK RMSNorm over all heads and its rotary embedding cut to the chunk,
attention in key chunks merged by log-sum-exp, output projection; equals WanAttention's forward.
`wan_project` is the shape phase B's AttentionAccess record for WanAttention will take."""

import pytest
import torch

from slidefusion.parallel.chunked import attention_lse, merge

transformer_wan = pytest.importorskip("diffusers.models.transformers.transformer_wan")


def rotate(h, cos, sin):  # Wan's processor: interleaved pairs
    x1, x2 = h.unflatten(-1, (-1, 2)).unbind(-1)
    out = torch.empty_like(h)
    out[..., 0::2] = x1 * cos[..., 0::2] - x2 * sin[..., 1::2]
    out[..., 1::2] = x1 * sin[..., 1::2] + x2 * cos[..., 0::2]
    return out


def wan_project(m, x, args, kwargs, span):
    """x (G, n, C), this rank's tokens [start, start + n) -> (G, n, 3, heads, D)."""
    cos, sin = (t.narrow(1, *span) for t in kwargs.get("rotary_emb", args[2] if len(args) > 2 else None))
    q, k, v = m.norm_q(m.to_q(x)), m.norm_k(m.to_k(x)), m.to_v(x)  # the RMSNorm spans heads x D: per token
    q, k, v = (t.unflatten(2, (m.heads, -1)) for t in (q, k, v))
    return torch.stack((rotate(q, cos, sin), rotate(k, cos, sin), v), dim=2)


def test_token_chunks_with_lse_merge_equal_wan_attention():
    torch.manual_seed(0)
    heads, d = 5, 12
    m = transformer_wan.WanAttention(dim=heads * d, heads=heads, dim_head=d, eps=1e-6,
                                     processor=transformer_wan.WanAttnProcessor()).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn_like(p))
        cos, sin = transformer_wan.WanRotaryPosEmbed(d, (1, 2, 2), 64)(torch.randn(1, 4, 3, 6, 8))  # (1, N, 1, D)
        n = cos.shape[1]
        x = torch.randn(1, n, heads * d)
        reference = m(x, None, None, (cos, sin))
        cuts, parts, start = [7, 0, 20, n - 27], [], 0
        for size in cuts:
            parts.append(wan_project(m, x[:, start:start + size], (), {"rotary_emb": (cos, sin)}, (start, size)))
            start += size
        q, k, v = torch.cat(parts, dim=1).unbind(dim=2)
        partial = None
        for kc, vc in zip(k.split(cuts, dim=1), v.split(cuts, dim=1)):
            partial = merge(partial, attention_lse(q, kc, vc))
        out = m.to_out[0](partial[0].flatten(2))
    assert (out - reference).abs().max() < 1e-5
