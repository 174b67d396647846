"""Gradient accumulation in host memory: several micro-batches, one AdamW update.

`GradientAccumulator` stands between the `GradientShipper` and the update strategy for a step of
several micro-batches. Each group's gradient lands in a staging buffer (compute dtype) as usual;
the optimizer worker adds it into the group's float32 sum on the host (the first micro-batch of a
step copies instead of adding). On the step's last micro-batch, once its gradient is added, the
sum is handed to the strategy as the group's gradient, so the overlapped update (immediate, or
deferred for clipping) starts during that micro-batch's backward exactly as it would for one
large batch. The sums cost 4 bytes per trainable parameter of host memory, allocated at the first
step with more than one micro-batch.

The order of float32 additions is the resident optimizer's (`param.grad` accumulates micro-batch
after micro-batch), so the result equals a resident run of the same micro-batches within rounding
of the compute dtype, and bitwise with float32 compute on a CPU device.
"""

from __future__ import annotations

import torch

from slidefusion.offload.engine.transfer import DONE, Handle


class GradientAccumulator:
    """The strategy interface (`staging`, `landed`) over float32 sums per group; see the module."""

    def __init__(self, state, allocate, dtype, worker, strategy, staged: bool):
        self.state, self.worker, self.strategy = state, worker, strategy
        self.sums = {key: allocate(g.n_train, torch.float32, True) for key, g in state.groups.items() if g.n_train}
        largest = max((g.n_train for g in state.groups.values()), default=0)
        self.buffers = [allocate(largest, dtype, True) for _ in range(2)] if staged else []
        self.free: list[Handle] = [DONE, DONE]
        self.turn = 0
        self.first, self.last = True, False

    def begin(self, first: bool, last: bool) -> None:
        """The next micro-batch's position in its step."""
        self.first, self.last = first, last

    @property
    def updated(self) -> dict[int, Handle]:
        return self.strategy.updated

    def staging(self, group):
        """(host buffer for `group`'s gradient, when the previous add out of it has finished)."""
        self.turn = 1 - self.turn
        return self.buffers[self.turn][:group.n_train], self.free[self.turn]

    def landed(self, group, host, arrived: Handle, step: int, lr: float) -> Handle:
        """Add the gradient into the group's sum (after it `arrived`); on the last micro-batch hand the
        sum to the strategy. Returns the handle after which `host` may be reused."""
        total, first = self.sums[group.key], self.first
        grads = host if isinstance(host, list) else [host]
        views = group.layout.views(total, len(group.trainable)) if isinstance(host, list) else [total]
        # The sum may still be read by the previous step's update: wait for it before overwriting.
        after = (arrived, self.strategy.updated[group.key]) if first else (arrived,)

        def add() -> None:
            with torch.no_grad():
                for view, grad in zip(views, grads):
                    flat = view.view(-1)
                    flat.copy_(grad.view(-1)) if first else flat.add_(grad.view(-1))

        added = self.worker.submit(add, after)
        if not isinstance(host, list):
            self.free[self.turn] = added
        if self.last:
            handed = [v.view(-1) for v in views] if isinstance(host, list) else total
            self.strategy.landed(group, handed, added, step, lr)
        return added

    def end_backward(self, step: int, lr: float, marker: Handle) -> None:
        """A micro-batch's backward is over; the strategy hears of the step's end from the engine."""

    def host_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.sums.values(), *self.buffers))
