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

Under data parallelism (`engine.sharded.DataParallel`, passed as `dp`) the same two run on this rank's
shard of each group: staging holds the reduced shard, every gradient is scaled by 1 / (data-parallel
ranks), the clipping norm is summed over the ranks (`engine.sharded.ShardNorms`), and a group counts as
updated once the other ranks' shards of its compute copy have arrived (`dp.publish`).
"""

from slidefusion.offload.engine.layout import REST
from slidefusion.offload.engine.transfer import DONE, Handle, ThreadHandle
from slidefusion.offload.optim.adam import clip_coefficient, parameter_norms


def _local(group) -> int:
    return group.n_train


class LocalNorms:
    """Clipping in one process: each parameter's norm as clip_grad_norm_ takes it, then its factor."""

    def of(self, group, host):
        views = host if isinstance(host, list) else group.layout.views(host, len(group.trainable))
        return parameter_norms(views)

    def coefficient(self, state, norms: dict, max_norm: float) -> float:
        return clip_coefficient([norms[key][i] for key, i in state.norm_order], max_norm)


class ImmediateUpdate:
    def __init__(self, state, allocate, dtype, worker, update, staged: bool, dp=None):
        self.size = size = _local if dp is None else dp.staging_numel
        largest = max(size(g) for g in state.groups.values())
        self.buffers = [allocate(largest, dtype, True) for _ in range(2)] if staged else []
        self.free: list[Handle] = [DONE, DONE]
        self.turn = 0
        self.updated: dict[int, Handle] = {key: DONE for key in state.groups}
        self.worker, self.update, self.dp = worker, update, dp
        self.scale = 1.0 if dp is None else dp.grad_scale

    def staging(self, group):
        """(host buffer for `group`'s gradient, when the optimizer is done with it)."""
        self.turn = 1 - self.turn
        return self.buffers[self.turn][:self.size(group)], self.free[self.turn]

    def landed(self, group, host, arrived: Handle, step: int, lr: float) -> Handle:
        """Schedule `group`'s update; returns its handle, after which `host` is free again."""
        job = lambda: self.update(group, host, step, lr, self.scale, (arrived,))  # noqa: E731
        self.updated[group.key] = self.free[self.turn] = self.worker.submit(job, (arrived,))
        if self.dp is not None:
            self.updated[group.key] = self.dp.publish(group, self.free[self.turn])
        return self.free[self.turn]

    def end_backward(self, step: int, lr: float, marker: Handle) -> None:
        """Every update is already scheduled."""

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class DeferredClippedUpdate:
    def __init__(self, state, allocate, dtype, worker, update, max_norm: float, staged: bool, dp=None):
        self.state, self.worker, self.update, self.max_norm, self.dp = state, worker, update, max_norm, dp
        size = _local if dp is None else dp.staging_numel
        self.buffers = {key: allocate(size(g), dtype, True) for key, g in state.groups.items()} if staged else {}
        self.rule = LocalNorms() if dp is None else dp.norms()
        self.scale = 1.0 if dp is None else dp.grad_scale
        self.grads: dict[int, object] = {}  # this step's gradient of each group: its buffer, or autograd's list
        self.free: dict[int, Handle] = {key: DONE for key in state.groups}
        self.updated: dict[int, Handle] = {key: DONE for key in state.groups}
        self.norms: dict[int, list] = {}

    def staging(self, group):
        return self.buffers[group.key], self.free[group.key]

    def landed(self, group, host, arrived: Handle, step: int, lr: float) -> Handle:
        """Take the gradient's norms; returns DONE: every group's gradient is kept until the step's
        clipped updates, so a caller has nothing to wait for before handing over the next."""
        norms, self.grads[group.key] = self.norms, host  # this step's dict
        self.worker.submit(lambda: norms.__setitem__(group.key, self.rule.of(group, host)), (arrived,))
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
                scale = self.rule.coefficient(self.state, norms, self.max_norm) * self.scale
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
        self.free.update(handles)
        if self.dp is None:
            self.updated.update(handles)
        else:  # published in the same order on every rank (`clipped_updates` sets `handles` itself)
            self.updated.update({key: self.dp.publish(self.state.groups[key], h) for key, h in handles.items()})

    def host_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def make_strategy(policy, state, allocate, worker, update, dp=None):
    dtype, staged = policy.compute_dtype, dp is not None or not policy.holds_gradients
    if policy.clip is None:
        return ImmediateUpdate(state, allocate, dtype, worker, update, staged, dp)
    return DeferredClippedUpdate(state, allocate, dtype, worker, update, policy.clip, staged, dp)
