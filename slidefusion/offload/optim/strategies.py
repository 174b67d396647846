"""When a group's AdamW update runs, and the host gradient buffers that timing needs.

`ImmediateUpdate` starts each group's update as soon as its gradient lands on the host, while the
device goes on with the backward of earlier blocks; two staging buffers are enough, used in turn.

`DeferredClippedUpdate` (with `max_grad_norm`): no update may start before the global norm is
known, so during backward the worker only takes each parameter's gradient norm (as
clip_grad_norm_ does, so the result is bitwise the same) and keeps every group's gradient in its
own staging buffer. After backward one job computes the clipping factor and applies the clipped
updates in forward order: the next step's forward waits for group b's update just before it needs
block b, so the updates overlap that forward instead of the backward. (Speculating instead, update
then roll back when clipping turns out to be needed, would keep a backup of master and moments.)

Both call `update(group, grad, step, lr, scale, after)` on the optimizer worker; `after` are the
handles a refresh upload of the group's new weights must wait for. `grad` is the group's flat
staging buffer, or (`policy.holds_gradients`: no staging) the list of autograd's gradients.
"""

from slidefusion.offload.engine.layout import REST
from slidefusion.offload.engine.transfer import DONE, Handle, ThreadHandle
from slidefusion.offload.optim.adam import clip_coefficient, parameter_norms


class ImmediateUpdate:
    def __init__(self, state, allocate, dtype, worker, update, staged: bool):
        largest = max(g.n_train for g in state.groups.values())
        self.buffers = [allocate(largest, dtype, True) for _ in range(2)] if staged else []
        self.free: list[Handle] = [DONE, DONE]
        self.turn = 0
        self.updated: dict[int, Handle] = {key: DONE for key in state.groups}
        self.worker, self.update = worker, update

    def staging(self, group):
        """(host buffer for `group`'s gradient, when the optimizer is done with it)."""
        self.turn = 1 - self.turn
        return self.buffers[self.turn][:group.n_train], self.free[self.turn]

    def landed(self, group, host, arrived: Handle, step: int, lr: float) -> Handle:
        """Schedule `group`'s update; returns its handle, after which `host` is free again."""
        job = lambda: self.update(group, host, step, lr, 1.0, (arrived,))  # noqa: E731
        self.updated[group.key] = self.free[self.turn] = self.worker.submit(job, (arrived,))
        return self.updated[group.key]

    def end_backward(self, step: int, lr: float, marker: Handle) -> None:
        """Every update is already scheduled."""

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class DeferredClippedUpdate:
    def __init__(self, state, allocate, dtype, worker, update, max_norm: float, staged: bool):
        self.state, self.worker, self.update, self.max_norm = state, worker, update, max_norm
        self.buffers = {key: allocate(g.n_train, dtype, True) for key, g in state.groups.items()} if staged else {}
        self.grads: dict[int, object] = {}  # this step's gradient of each group: its buffer, or autograd's list
        self.free: dict[int, Handle] = {key: DONE for key in state.groups}
        self.updated: dict[int, Handle] = {key: DONE for key in state.groups}
        self.norms: dict[int, list] = {}

    def staging(self, group):
        return self.buffers[group.key], self.free[group.key]

    def landed(self, group, host, arrived: Handle, step: int, lr: float) -> Handle:
        """Take the gradient's norms; returns DONE: every group's gradient is kept until the step's
        clipped updates, so a caller has nothing to wait for before handing over the next."""
        views = host if isinstance(host, list) else group.layout.views(host, len(group.trainable))
        norms, self.grads[group.key] = self.norms, host  # this step's dict
        self.worker.submit(lambda: norms.__setitem__(group.key, parameter_norms(views)), (arrived,))
        return DONE

    def end_backward(self, step: int, lr: float, marker: Handle) -> None:
        """One job: the clipping factor, then the updates in the order the next forward needs them,
        each group released as soon as it is written."""
        order = [key for key in (REST, *range(len(self.state.blocks))) if self.state.groups[key].n_train]
        handles = {key: ThreadHandle() for key in order}
        norms, self.norms = self.norms, {}
        grads, self.grads = self.grads, {}

        def clipped_updates():
            try:
                scale = clip_coefficient([norms[key][i] for key, i in self.state.norm_order], self.max_norm)
                for key in order:
                    self.worker.jitter()  # tests: a delay between groups, where the next forward races us
                    self.update(self.state.groups[key], grads[key], step, lr, scale, (marker,))
                    handles[key].set()
            except BaseException as error:
                for handle in handles.values():
                    if not handle.done():
                        handle.set(error)
                raise

        self.worker.submit(clipped_updates)
        self.updated.update(handles)
        self.free.update(handles)

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def make_strategy(policy, state, allocate, worker, update):
    dtype, staged = policy.compute_dtype, not policy.holds_gradients
    if policy.clip is None:
        return ImmediateUpdate(state, allocate, dtype, worker, update, staged)
    return DeferredClippedUpdate(state, allocate, dtype, worker, update, policy.clip, staged)
