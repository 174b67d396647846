"""`OffloadEngine(model, blocks, policy)`: train an unchanged model whose persistent state lives on the host.

The pieces, each in its own file, built here in order:
  HostState        host buffers per group (a block, or the rest): compute copy, master, moments
  DeviceWeights    resident groups on the device, the other blocks streamed with prefetch
  update strategy  when AdamW runs on the host: immediately per block, or deferred for clipping
  GradientShipper  weight gradients from the device to the strategy's host staging (a CPU device
                   with fp32 state: autograd's own tensors, read in place)
  hooks            each block's forward routed through a checkpointing autograd function
  runner           how one block computes: whole, or tile by tile (`tiling.tile_runner`, policy.tile)
  checkpoints      where block inputs wait for backward: kept, or host memory + disk (policy.spill_dir)
With `ranks` (data parallelism over torch.distributed, `sharded`): each rank keeps a shard of every
group's master and moments, gradients are reduce-scattered as backward produces them, and each
update's result is published to the other ranks (`sharded.DataParallel`).
Whether a configuration fits is the caller's question, answered before the engine is built
(`plan.resolve.fitting_policy`, or `plan.footprint.engine_plan` + `require_fit`).
"""

import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_unflatten

from slidefusion.families import adapter_for
from slidefusion.core.errors import UserError, check
from slidefusion.offload.engine.accumulate import GradientAccumulator
from slidefusion.offload.engine.device import DeviceWeights, GradientShipper
from slidefusion.core.hooks import refuse_hooks, within
from slidefusion.offload.engine.hooks import STREAM, block_leaves, forward_with_graph, input_and_weight_grads, install_hooks, refused, remove_hooks
from slidefusion.offload.engine.fp8 import check_device
from slidefusion.offload.engine.host_state import HostState
from slidefusion.offload.engine.layout import REST
from slidefusion.offload.engine.loading import load_named_tensors, move_buffers
from slidefusion.offload.engine.pinning import HostAllocator
from slidefusion.offload.engine.sharded import DataParallel, RankGroups, ShardedShipper
from slidefusion.offload.engine.sharded_state import first_nonfinite, gather_state, gather_weights, host_bytes, scatter_state
from slidefusion.offload.engine.stats import EngineStats
from slidefusion.offload.engine.transfer import InlineWorker, Worker, make_copier
from slidefusion.offload.optim.strategies import make_strategy
from slidefusion.offload.optim.update import update_group
from slidefusion.offload.plan.resolve import resolve
from slidefusion.offload.policy import OffloadPolicy
from slidefusion.offload.tiling.activation_store import make_checkpoints
from slidefusion.offload.tiling.tile_runner import make_runner


class OffloadEngine:
    """Forward, backward and AdamW for `model`, with `blocks` (the model's blocks in call order,
    from one or several module lists) streamed from host memory. See `OffloadPolicy` for the knobs
    and `stats` (an `EngineStats`) for what it moved and waited for."""

    def __init__(self, model: nn.Module, blocks, policy: OffloadPolicy | None = None,
                 allocator: HostAllocator | None = None, ranks: RankGroups | None = None):
        policy = OffloadPolicy() if policy is None else policy
        check(isinstance(policy, OffloadPolicy), f"policy={policy!r} must be an OffloadPolicy")
        self.policy = policy = resolve(policy)  # a concrete compute dtype; auto tiles and residency are refused
        self.device, self.model = policy.torch_device, model
        self.blocks = list(blocks) if isinstance(blocks, (list, tuple, nn.ModuleList)) else blocks
        refuse_hooks(model, refused(ranks is not None))  # before anything is moved: a refused model stays as it was
        self.allocator = allocator or HostAllocator.for_device(self.device, policy.pin_budget, policy.pin_chunk)
        self.dp = None if ranks is None else DataParallel(ranks, self.device)
        check(self.dp is None or policy.frozen_dtype is None, "lora.base_dtype (an fp8 frozen base) is not supported "
              "with --offload on several ranks yet; leave it unset, or train on one process")
        if policy.frozen_dtype is not None:
            check_device(policy.frozen_dtype, self.device, policy.compute_dtype)
        shards = () if self.dp is None else (self.dp.sharding, self.dp.compute_allocator(model, self.blocks, policy,
                                                                                          self.allocator))
        self.state = HostState(model, self.blocks, policy, self.allocator.empty, *shards)
        check(policy.resident_blocks <= len(self.blocks),
              f"resident_blocks={policy.resident_blocks} must be <= the model's {len(self.blocks)} blocks")
        move_buffers(model, self.device)
        self.h2d, self.d2h = (make_copier(f"offload-{way}", self.device, policy.pin_chunk) for way in ("h2d", "d2h"))
        # under data parallelism the update waits on a collective: on a thread of its own, never the compute's
        self.worker = Worker("offload-adamw") if policy.overlapped or self.dp else InlineWorker()
        self.strategy = make_strategy(policy, self.state, self.allocator.empty, self.worker, self._update, self.dp)
        self.accumulator = None  # host gradient sums, for steps of several micro-batches (`accumulate`)
        self.weights = DeviceWeights(self.state, policy, self.h2d, lambda key: self.strategy.updated[key])
        self.grads = (GradientShipper(self.state, policy, self.d2h, self.strategy) if self.dp is None else
                      ShardedShipper(self.state, policy, self.d2h, self.strategy, self.dp.comm, ranks.world))
        if self.dp is not None:
            self.dp.start(self.state, lambda key: self.weights.refresh(key, ()))
            self.weights.upload_all()
            self.host_bytes = host_bytes(self.state, self.dp.shared_bytes, self.dp.comm)
        self.runner = make_runner(policy, model, self.blocks)  # one block's computation: whole or tiled
        self.checkpoints = make_checkpoints(policy, self.device)  # where block inputs wait for backward
        self.step, self.lr, self.out_spec = 0, policy.optim.lr, None
        self._pos, self._called, self._exposed_opt = 0, [], 0.0
        self.anchor = torch.zeros((), device=self.device, requires_grad=True)  # every block output needs grad
        self.stats = EngineStats()
        _record(self, 0.0)
        install_hooks(self)

    # -- the step ---------------------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        check(lr >= 0, f"lr={lr} must be >= 0")
        self.lr = lr

    def train_step(self, loss_fn: Callable[[nn.Module], torch.Tensor] | list) -> float:
        """Forward + backward of `loss_fn(model)` and one AdamW update; returns the loss.

        A list of loss functions is one step of several micro-batches (each loss already scaled by
        its share): their gradients add up in host memory (`accumulate`) and the update runs on the
        last one's backward. Returns the sum of their losses.
        The update of the last blocks may still be running when this returns; the next step, and
        `model_state_dict`/`state_dict`, wait for exactly the parts they need."""
        start = time.perf_counter()
        fns = list(loss_fn) if isinstance(loss_fn, (list, tuple)) else [loss_fn]
        check(len(fns) >= 1, "train_step needs at least one loss function")
        value = 0.0
        for number, fn in enumerate(fns):
            if len(fns) == 1:
                self.grads.strategy = self.strategy
            else:
                self.grads.strategy = _accumulator(self)
                self.grads.strategy.begin(first=number == 0, last=number == len(fns) - 1)
            value += _micro_batch(self, fn)
        self.grads.strategy = self.strategy
        self.strategy.end_backward(self.step + 1, self.lr, self.d2h.marker())
        self.step += 1
        _record(self, time.perf_counter() - start)
        return value

    def _forward_backward(self, loss_fn) -> float:
        enabled = self.policy.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.policy.compute_dtype, enabled=enabled):
            loss = loss_fn(self.model)
        if self._called != list(range(len(self.blocks))):
            raise UserError(f"loss_fn ran blocks {self._called}; the engine needs every block once, in order")
        if self.policy.checkpoint:
            self.weights.begin_pass(forward=False)
        self.checkpoints.begin_backward()
        loss.backward()
        return loss.item()

    def _wait_update(self, key: int) -> None:
        """Host wait for the last update of group `key`: the optimizer time compute cannot hide."""
        start = time.perf_counter()
        self.strategy.updated[key].synchronize()
        self._exposed_opt += time.perf_counter() - start

    # -- one block, called from the hooks ---------------------------------------------------------

    def call_block(self, index: int, params: dict, args, kwargs, grad_outputs=None, leaves=None):
        """The runner on block `index` with `params` (local name -> tensor): its forward, or with
        `grad_outputs` its gradients (of the inputs, and of `leaves`)."""
        with within(self.blocks[index], STREAM):  # calls of the block reach its own forward
            if grad_outputs is None:
                return self.runner.forward(self.blocks[index], params, args, kwargs)
            return self.runner.grads(self.blocks[index], params, args, kwargs, grad_outputs, leaves)

    def block_forward(self, index: int, tensors: list, spec):
        """Forward of block `index`: outputs and, without checkpointing, the graph kept for backward."""
        if self._pos != index:
            raise UserError(f"block {index} ran at position {self._pos}; the engine needs every block once, in order")
        self._called.append(index)
        self._pos += 1
        self._wait_update(index)
        group, weights = self.state.blocks[index], self.weights.acquire(index)
        if self.policy.checkpoint:
            args, kwargs = tree_unflatten(tensors, spec)
            with torch.no_grad():
                out = self.call_block(index, dict(zip(group.local_names, group.layout.views(weights))), args, kwargs)
            self.weights.release(index)
            return out, None
        kept = weights[:group.numel]
        kept = kept if index in self.weights.buffers else kept.clone()  # the graph needs these until backward
        self.weights.release(index)
        return forward_with_graph(self, index, kept, tensors, spec)

    def block_backward(self, index: int, tensors: list, spec, graph, grad_outputs) -> list:
        """Recompute block `index` (unless its graph was kept), ship its weight gradients to the
        host and return the input gradients."""
        group = self.state.blocks[index]
        if graph is None:
            params, leaves, inputs = block_leaves(self, index, self.weights.acquire(index)[:group.numel], tensors)
            args, kwargs = tree_unflatten(inputs, spec)
            input_grads, weight_grads = self.call_block(index, params, args, kwargs, grad_outputs, leaves)
            self.weights.release(index)
        else:
            input_grads, weight_grads = input_and_weight_grads(graph, grad_outputs)
        self.grads.ship(group, weight_grads, self.step + 1, self.lr)
        return input_grads

    def _update(self, group, grad: torch.Tensor, step: int, lr: float, scale: float, after: tuple) -> None:
        """On the optimizer worker: AdamW on one group, then its refresh upload if it is resident
        (under data parallelism the publisher refreshes, once the other shards have arrived)."""
        update_group(group, grad, step, lr, scale, self.policy)
        if self.dp is None:
            self.weights.refresh(group.key, after)

    # -- state ------------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait until every scheduled update (and refresh upload) has been applied."""
        for handle in list(self.strategy.updated.values()):
            handle.synchronize()
        self.worker.submit(lambda: None).synchronize()
        for handle in list(self.weights.refreshed.values()):
            handle.synchronize()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The master weights (frozen parameters: their compute copy, or with an fp8 base their
        float8 codes, unscaled) and buffers, keyed as `model.state_dict()`. Under data parallelism
        every rank must call it (the shards are gathered)."""
        self.synchronize()
        weights = {k: v.detach() for k, v in self.model.state_dict().items()}
        return weights if self.dp is None else {**weights, **gather_weights(self.state, self.dp.comm)}

    def first_nonfinite(self) -> str | None:
        """The first weight holding NaN or infinity, or None (every rank must call it under data parallelism)."""
        self.synchronize()
        if self.dp is None:
            return next((k for k, v in self.model_state_dict().items() if v.is_floating_point()
                         and not torch.isfinite(v).all()), None)
        return first_nonfinite(self.state, self.dp.comm)

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: master weights, moments, step, lr (copies). Under
        data parallelism gathered from the shards, in the form one process saves, on rank 0 only
        (other ranks get step and lr alone); every rank must call it."""
        self.synchronize()
        if self.dp is None:
            return {"step": self.step, "lr": self.lr, **self.state.state_dict()}
        return {"step": self.step, "lr": self.lr, **(gather_state(self.state, self.dp.comm) or {})}

    def load_state_dict(self, state: dict) -> None:
        """A state as `state_dict` returns it, whatever the number of ranks that saved it."""
        self.synchronize()
        if self.dp is None:
            self.state.load_state_dict(state)
        else:
            scatter_state(self.state, state)
            self.dp.publisher.publish_all()
        self.weights.upload_all()
        self.step, self.lr = int(state["step"]), float(state["lr"])

    def load_weights(self, named_tensors) -> None:
        """Fill the weights from `(name, tensor)` pairs in any order (e.g. streamed from safetensors
        shards), each written straight into its host buffers; every parameter exactly once."""
        self.synchronize()
        load_named_tensors(self.model, self.state, named_tensors, self.device)
        if self.dp is not None:
            self.dp.publisher.publish_all()
        self.weights.upload_all()

    def close(self) -> None:
        """Finish pending updates, stop the threads and give back a plain host model."""
        self.synchronize()
        remove_hooks(self)
        self.runner.close()
        self.checkpoints.close()
        for target in (self.h2d, self.d2h, self.worker, *(() if self.dp is None else (self.dp,))):
            target.close()


def _micro_batch(engine: OffloadEngine, loss_fn) -> float:
    """One forward and backward; the gradients shipped to `engine.grads.strategy`."""
    engine.checkpoints.begin_step()  # a disk that cannot hold the step fails here, before any work
    _refresh_written_weights(engine)
    engine._wait_update(REST)
    engine.weights.begin_pass(forward=True)
    engine._pos, engine._called = 0, []
    rest = engine.state.rest
    try:
        value = engine._forward_backward(loss_fn)
        engine.grads.ship(rest, [p.grad for p in rest.trainable], engine.step + 1, engine.lr)
    finally:
        engine.checkpoints.end_step()
        rest.bind_host()
        for p in rest.params:
            p.grad = None
    return value


def _accumulator(engine: OffloadEngine):
    """The host gradient sums of steps with several micro-batches, allocated at first use."""
    if engine.accumulator is None:
        engine.accumulator = GradientAccumulator(engine.state, engine.allocator.empty, engine.policy.compute_dtype,
                                                 engine.worker, engine.strategy, not engine.policy.holds_gradients)
    return engine.accumulator


def _refresh_written_weights(engine: OffloadEngine) -> None:
    """Someone wrote the weights through the model (load_state_dict, init_from): recast, re-upload."""
    groups = engine.state.groups.values()
    if any(g.written_outside() for g in groups):
        engine.synchronize()
        for group in groups:
            if group.written_outside():
                group.refresh_compute()
        engine.weights.upload_all()


def _record(engine: OffloadEngine, seconds: float) -> None:
    s, weights, size = engine.stats, engine.weights, engine.policy.compute_bytes
    if seconds:
        s.steps += 1
        s.step_s += seconds
    s.optimizer_s = engine.worker.busy_s
    s.exposed_transfer_s = weights.streamer.wait_s + weights.wait_s
    s.exposed_optimizer_s = (engine._exposed_opt + engine.grads.wait_s + engine.h2d.host_wait_s  # CUDA: uploads waited
                             + engine.worker.exposed_s)
    s.h2d_bytes, s.d2h_bytes = weights.streamer.h2d_bytes + weights.refresh_bytes, engine.grads.bytes
    streamed = [engine.state.blocks[b].numel for b in weights.streamed]
    pool = weights.streamer.peak_bytes if engine.policy.checkpoint else sum(streamed) * size
    s.peak_device_param_bytes = pool + weights.resident_bytes()
    s.device_param_bytes_reserved = weights.reserved_bytes()
    s.host_state_bytes = engine.state.host_bytes()
    s.host_bytes_per_param = (s.host_state_bytes - engine.state.frozen_bytes()) / max(1, engine.state.trainable_numel())
    s.frozen_bytes_per_param = engine.state.frozen_bytes() / max(1, engine.state.frozen_numel())
    s.staging_bytes = engine.strategy.host_bytes() + (engine.accumulator.host_bytes() if engine.accumulator else 0)
    s.pinned_bytes, s.pageable_copy_bytes = engine.allocator.pinned_bytes, engine.allocator.pageable_dma_bytes
    if engine.dp is not None:
        s.host_bytes_rank, s.host_bytes_node = engine.host_bytes if hasattr(engine, "host_bytes") else (0, 0)
        s.comm_bytes, s.exposed_comm_s = engine.dp.comm.bytes, engine.grads.wait_s
    else:
        s.host_bytes_rank = s.host_bytes_node = s.host_state_bytes


def engine_blocks(model: nn.Module, adapter=None) -> nn.ModuleList:
    """The blocks the engine streams, in call order, whatever the model class (its groups follow them);
    `adapter`: the model's, where the caller holds it already (default: looked up by class)."""
    return nn.ModuleList((adapter or adapter_for(model)).blocks(model))
