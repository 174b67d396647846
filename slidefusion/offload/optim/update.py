"""The host optimizer: one group's AdamW update, in the storage format the policy chose."""

import torch

from slidefusion.offload.optim.adam import adamw_parallel_
from slidefusion.offload.optim.lean import LeanBuffers, lean_adamw_, seeds


def update_group(group, grad: torch.Tensor, step: int, lr: float, scale: float, policy) -> None:
    """AdamW on `group`'s trainable prefix with `grad` (compute dtype: flat, or with fp32 state a
    list of one flat gradient per parameter); writes the master, the moments and the compute copy.
    Runs on the optimizer worker."""
    n = group.n_train
    if n == 0:
        return
    master, moments = group.master, group.moments
    if master.kind == "fp32" and moments.kind == "fp32":
        adamw_parallel_(master.value, grad, moments.exp_avg, moments.exp_avg_sq,
                        None if master.is_compute else group.compute[:n], step, lr, policy.optim, grad_scale=scale,
                        ends=group.train_ends, threads=policy.threads, in_torch_pool=not policy.overlapped)
        return
    buffers = LeanBuffers(master.value, master.comp, moments.exp_avg, moments.exp_avg_sq, moments.exp_avg_scale,
                          moments.exp_avg_sq_scale, moments.starts, grad, None if master.is_compute else group.compute[:n])
    lean_adamw_(buffers, step, lr, policy.optim, scale, seeds(policy.seed, step, group.key), policy.threads,
                in_torch_pool=not policy.overlapped)
