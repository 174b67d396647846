"""The host optimizer: one group's AdamW update, in the storage format the policy chose."""

import torch

from slidefusion.offload.optim.adam import adamw_parallel_
from slidefusion.offload.optim.lean import LeanBuffers, lean_adamw_, seeds


def update_group(group, grad: torch.Tensor, step: int, lr: float, scale: float, policy) -> None:
    """AdamW on `group`'s trainable prefix with `grad` (compute dtype: flat, or with fp32 state a
    list of one flat gradient per parameter); writes the master, the moments and the compute copy.
    Sharded (data parallelism), on this process's values [lo, hi) of it, `grad` being their gradient.
    Runs on the optimizer worker."""
    n, lo = group.n_own, group.lo
    if n == 0:
        return
    master, moments = group.master, group.moments
    compute = None if master.is_compute else group.compute[lo:lo + n]
    if master.kind == "fp32" and moments.kind == "fp32":
        adamw_parallel_(master.value, grad, moments.exp_avg, moments.exp_avg_sq, compute, step, lr, policy.optim,
                        grad_scale=scale, ends=group.own_ends, threads=policy.threads, in_torch_pool=not policy.overlapped)
        return
    buffers = LeanBuffers(master.value, master.comp, moments.exp_avg, moments.exp_avg_sq, moments.exp_avg_scale,
                          moments.exp_avg_sq_scale, moments.starts, grad, compute, base=lo)
    lean_adamw_(buffers, step, lr, policy.optim, scale, seeds(policy.seed, step, group.key), policy.threads,
                in_torch_pool=not policy.overlapped)
