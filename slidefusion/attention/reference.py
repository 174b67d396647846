"""The plain, slow specification of the attention operators; the tests compare the fast ones to it.

Every operator here is masked dense attention over the flattened grid: it builds the full N x N
"may attend" mask from its definition and computes softmax(q k^T * scale) v explicitly, in at least
float32. No partitions, rolls or padding, so each function can be checked by reading it.
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
