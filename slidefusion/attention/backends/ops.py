"""Slide attention as torch.library custom ops: flash-attention's three tiers.

1. Custom ops `slidefusion::slide_forward` and `slidefusion::slide_backward` run one named kernel
   (`backends.KERNELS`) on normalised inputs. Each has a fake implementation that only states
   shapes and dtypes, so torch.compile traces through the op without running it, and meta
   tensors plan through it (the fake is also registered as the op's Meta kernel).
2. `register_autograd` makes slide_forward differentiable: `_setup_context` only saves tensors,
   `_backward` turns the output gradients into delta = rowsum(dout * out) - dlse and calls
   slide_backward. Gradients reach q, k, v and the offsets, and flow from both outputs.
3. The public function, `functional.slide_attention`, checks and normalises the arguments
   (`backends.normalise`) and calls `slide_with_lse`.
"""

from typing import Optional

import torch

from slidefusion.attention import backends

Tensor = torch.Tensor


@torch.library.custom_op("slidefusion::slide_forward", mutates_args=())
def slide_forward(
    q: Tensor, k: Tensor, v: Tensor, offsets: Optional[Tensor], kernel_size: list[int], scale: float, backend: str  # noqa: UP045
) -> tuple[Tensor, Tensor]:
    """(out (B, T, H, W, heads, D), lse (B, T, H, W, heads)) from kernel `backend`.

    Non-finite offsets, as in the reference: a NaN offset gives its query-head NaN outputs, as NaN
    inputs give in any torch op (a model with a NaN weight propagates NaN, as the stock model does),
    and an infinite one puts its point on the grid's edge (tiled and cpp are tested for both, triton
    for NaN). Finiteness is checked where input enters (configs, files, the CLI), not here.
    """
    out, lse = backends.kernel_module(backend).forward(q, k, v, offsets, tuple(kernel_size), scale)
    return out, lse.to(backends.lse_dtype(q.dtype))


@slide_forward.register_fake
def _slide_forward_fake(q, k, v, offsets, kernel_size, scale, backend):
    return torch.empty_like(q), q.new_empty(q.shape[:5], dtype=backends.lse_dtype(q.dtype))


@torch.library.custom_op("slidefusion::slide_backward", mutates_args=())
def slide_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Optional[Tensor],  # noqa: UP045
    lse: Tensor,
    delta: Tensor,
    grad_out: Tensor,
    kernel_size: list[int],
    scale: float,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, doffsets); doffsets is an empty tensor without offsets."""
    grads = backends.kernel_module(backend).backward(
        q, k, v, offsets, lse, delta, grad_out.contiguous(), tuple(kernel_size), scale
    )
    return tuple(g.contiguous() for g in grads)


@slide_backward.register_fake
def _slide_backward_fake(q, k, v, offsets, lse, delta, grad_out, kernel_size, scale, backend):
    doff = q.new_empty(0) if offsets is None else torch.empty_like(offsets)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), doff


def _setup_context(ctx, inputs, output):
    q, k, v, offsets, kernel_size, scale, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, offsets, out, lse)
    ctx.kernel_size, ctx.scale, ctx.backend = kernel_size, scale, backend


def _backward(ctx, grad_out, grad_lse):
    q, k, v, offsets, out, lse = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    delta = (grad_out.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # (B, T, H, W, heads)
    if grad_lse is not None:
        delta = delta - grad_lse  # d lse / d score = p, so it enters exactly where delta does
    dq, dk, dv, doff = slide_backward(q, k, v, offsets, lse, delta, grad_out, ctx.kernel_size, ctx.scale, ctx.backend)
    return dq, dk, dv, (None if offsets is None else doff), None, None, None


slide_forward.register_autograd(_backward, setup_context=_setup_context)


def slide_with_lse(n: backends.Normalised, kernel: tuple[int, int, int], backend: str) -> tuple[Tensor, Tensor]:
    """Differentiable (out, lse) of normalised arguments `n` through kernel `backend`."""
    return slide_forward(n.q, n.k, n.v, n.offsets, list(kernel), n.scale, backend)
