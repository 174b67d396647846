"""`OffloadEngine`: train an unchanged model whose persistent state lives in host memory.

The device holds only the non-block ("resident") weights and the `prefetch + 1` block buffers of
the `BlockStreamer`. Each block's `forward` is replaced, on the instance, by a hook that runs the
block through `_StreamedBlock`, an autograd function that checkpoints at the block boundary: its
backward re-uploads the block (in reverse order), recomputes it, and ships the weight gradients
to the host, where the optimizer worker runs exact AdamW on that block while the device goes on
with the backward of earlier blocks.

With `max_grad_norm`, no update may start before the global norm is known, so during backward
the worker only takes each parameter's gradient norm (as clip_grad_norm_ does, so the result is
bitwise the same) and applies the clipped updates afterwards, in forward order: the next step's
forward waits for block b's update just before it uploads block b, so the updates overlap that
forward instead of the backward ("defer"). Speculating instead (update, roll back when clipping
turns out to be needed) would keep a 12 B/param backup of master weights and moments.
"""

import os
import random
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from slidefusion.errors import UserError, check
from slidefusion.offload.adam import AdamWConfig, adamw_parallel_, clip_coefficient, parameter_norms
from slidefusion.offload.host_state import GroupState, split_groups
from slidefusion.offload.planner import available_host_memory, device_memory, engine_footprint, parse_bytes
from slidefusion.offload.streamer import BlockStreamer
from slidefusion.offload.transfer import DONE, Handle, ThreadHandle, Worker, make_copier

REST = -1  # index of the resident group (everything outside the blocks)


class OffloadEngine:
    """Forward, backward and AdamW for `model`, streaming `blocks` from host memory.

    `stats` holds running totals since construction (bytes, seconds, `steps`) and the peak device
    parameter bytes. Optional sizing arguments: `device_memory` / `host_memory` (bytes or '141GB';
    default: the device's total and the host's MemAvailable) and `activation_bytes` (the
    planner's activation estimate for the workload) feed the fit check made at construction.
    """

    def __init__(self, model: nn.Module, blocks: nn.ModuleList, device="cuda", compute_dtype=torch.bfloat16,
                 lr: float = 1e-4, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 max_grad_norm: float | None = None, prefetch: int = 1, checkpoint: bool = True,
                 device_memory: int | str | None = None, host_memory: int | str | None = None,
                 activation_bytes: int = 0, optimizer_threads: int | None = None):
        check(isinstance(prefetch, int) and prefetch >= 0, f"prefetch={prefetch!r} must be an int >= 0")
        check(max_grad_norm is None or max_grad_norm > 0, f"max_grad_norm={max_grad_norm} must be > 0 or None")
        check(compute_dtype in (torch.float32, torch.bfloat16, torch.float16),
              f"compute_dtype={compute_dtype} is unsupported; valid: torch.float32, torch.bfloat16, torch.float16")
        self.device = _device(device)
        self.model, self.blocks, self.compute_dtype = model, blocks, compute_dtype
        self.adamw = AdamWConfig(lr, betas, eps, weight_decay)
        self.exact = compute_dtype == torch.float32  # bitwise torch.optim.AdamW; else the one-pass kernel
        # On a CPU "device" the cores compute; with a GPU they are free for AdamW's memory streams.
        self.optimizer_threads = optimizer_threads if optimizer_threads is not None else (
            1 if self.device.type == "cpu" else max(1, (os.cpu_count() or 2) // 2))
        check(self.optimizer_threads >= 1, f"optimizer_threads={optimizer_threads} must be >= 1")
        self.lr, self.max_grad_norm, self.checkpoint, self.prefetch = lr, max_grad_norm, checkpoint, prefetch
        per_block, rest = split_groups(model, blocks)
        self._check_fits(per_block, rest, device_memory, host_memory, activation_bytes)
        pin = self.device.type == "cuda"
        self.groups = [GroupState(f"blocks[{i}]", named, compute_dtype, pin) for i, named in enumerate(per_block)]
        self.rest = GroupState("rest", rest, compute_dtype, pin)
        self._local_names = [[name for name, _ in block.named_parameters()] for block in blocks]  # split_groups' order
        self._norm_order = self._parameter_order()
        self._move_the_rest(rest)
        self._allocate_device_buffers()
        self.h2d, self.d2h = make_copier("offload-h2d", self.device), make_copier("offload-d2h", self.device)
        self.worker = Worker("offload-adamw")
        self.updated: dict[int, Handle] = {REST: DONE, **{b: DONE for b in range(len(self.groups))}}
        self.streamer = BlockStreamer(self.h2d, [g.compute for g in self.groups], self.slots,
                                      lambda b: (self.updated[b],))
        self.step, self._in_block, self._rest_h2d, self._exposed_opt = 0, False, 0, 0.0
        self.stats = {"steps": 0, "step_s": 0.0, "optimizer_s": 0.0, "exposed_optimizer_s": 0.0,
                      "exposed_transfer_s": 0.0, "h2d_bytes": 0, "d2h_bytes": 0, "peak_device_param_bytes": 0,
                      "device_param_bytes_reserved": self._reserved_param_bytes(),
                      "host_state_bytes": sum(g.host_bytes() for g in self.groups) + self.rest.host_bytes()}
        self._anchor = torch.zeros((), device=self.device, requires_grad=True)  # every block output needs grad
        self._install_hooks()

    # -- construction ----------------------------------------------------------------------------

    def _check_fits(self, per_block, rest, device_mem, host_mem, activation_bytes) -> None:
        """Refuse, with the planner's reason, a configuration that cannot fit."""
        numels = [sum(p.numel() for _, p in named) for named in per_block]
        plan = engine_footprint(numels, sum(p.numel() for _, p in rest), torch.finfo(self.compute_dtype).bits // 8,
                                self.prefetch, self.max_grad_norm is not None, self.checkpoint)
        if activation_bytes:
            plan.device["activations (given)"] = int(activation_bytes)
        plan.device_capacity = parse_bytes(device_mem, "device_memory") if device_mem is not None else device_memory(self.device)
        plan.host_capacity = parse_bytes(host_mem, "host_memory") if host_mem is not None else available_host_memory()
        plan.check_capacity()
        if not plan.fits:
            raise UserError(f"this offload configuration {plan.verdict()}; run `slidefusion plan` to size it")
        self.plan = plan

    def _parameter_order(self) -> list[tuple[int, int]]:
        """(group, index in group) of each trained parameter in `model.parameters()` order: the
        order clip_grad_norm_ sums the norms in, which the clipped result depends on bitwise."""
        where = {id(p): (REST, i) for i, p in enumerate(self.rest.params)}
        for b, group in enumerate(self.groups):
            where.update({id(p): (b, i) for i, p in enumerate(group.params)})
        return [where[id(p)] for p in self.model.parameters() if id(p) in where]

    def _move_the_rest(self, rest) -> None:
        """Buffers and frozen parameters go to the device for good; trainable resident weights get
        a device copy that is bound to them only during a step."""
        trainable = {id(p) for _, p in rest}
        for group in self.groups:
            trainable.update(id(p) for p in group.params)
        for module in self.model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                if buffer is not None:
                    setattr(module, name, buffer.to(self.device))
        for param in self.model.parameters():
            if id(param) not in trainable:
                param.data = param.data.to(self.device, self.compute_dtype if param.is_floating_point() else None)
        self.rest_device = torch.empty(self.rest.numel, dtype=self.compute_dtype, device=self.device)

    def _allocate_device_buffers(self) -> None:
        largest = max(g.numel for g in self.groups)
        new = lambda: torch.empty(largest, dtype=self.compute_dtype, device=self.device)
        self.slots = [new() for _ in range(self.prefetch + 1)]
        # Gradients: two device buffers (one filling while the other drains to the host) and two
        # host staging buffers, or with clipping one per group, held until the norm is known.
        self.grad_device = [torch.empty(max(largest, self.rest.numel), dtype=self.compute_dtype, device=self.device) for _ in range(2)]
        self.grad_device_free: list[Handle] = [DONE, DONE]
        pin = self.device.type == "cuda"
        host = lambda n: torch.empty(n, dtype=self.compute_dtype, pin_memory=pin)
        if self.max_grad_norm is None:
            self.grad_host = [host(max(largest, self.rest.numel)) for _ in range(2)]
        else:
            self.grad_host = {b: host(g.numel) for b, g in enumerate(self.groups)} | {REST: host(self.rest.numel)}
        self.grad_host_free: dict = {key: DONE for key in (range(2) if self.max_grad_norm is None else self.grad_host)}
        self._grad_turn = 0

    def _reserved_param_bytes(self) -> int:
        size = torch.finfo(self.compute_dtype).bits // 8
        return (len(self.slots) * self.slots[0].numel() + self.rest.numel) * size

    def _install_hooks(self) -> None:
        for index, block in enumerate(self.blocks):
            block.forward = _BlockHook(self, index, block.forward)

    # -- the step ---------------------------------------------------------------------------------

    def set_lr(self, lr: float) -> None:
        check(lr >= 0, f"lr={lr} must be >= 0")
        self.lr = lr

    def train_step(self, loss_fn: Callable[[nn.Module], torch.Tensor]) -> float:
        """Forward + backward of `loss_fn(model)` and one AdamW update; returns the loss.

        The update of the last blocks may still be running when this returns; the next step, and
        `model_state_dict`/`state_dict`, wait for exactly the parts they need."""
        start = time.perf_counter()
        self._refresh_written_weights()
        self._bind_rest()
        self._pos, self._called, self._norms = 0, [], {}
        self.streamer.start(list(range(len(self.groups))), reuse=False)
        try:
            with self._autocast():
                loss = loss_fn(self.model)
            if self._called != list(range(len(self.groups))):
                raise UserError(f"loss_fn ran blocks {self._called}; the engine needs every block once, in order")
            self._pos = 0
            self.streamer.start(self._called[::-1], reuse=True)
            loss.backward()
            value = loss.item()
            self._ship_grads(REST, [p.grad for p in self.rest.params])
        finally:
            self.rest.bind_master()
            for p in self.rest.params:
                p.grad = None
        if self.max_grad_norm is not None:
            self._schedule_clipped_updates()
        self.step += 1
        self._update_stats(time.perf_counter() - start)
        return value

    def _autocast(self):
        enabled = self.compute_dtype != torch.float32
        return torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=enabled)

    def _refresh_written_weights(self) -> None:
        """Someone wrote the weights through the model (load_state_dict, init_from): recast."""
        groups = [self.rest, *self.groups]
        if any(g.written_outside() for g in groups):
            self.synchronize()
            for group in groups:
                if group.written_outside():
                    group.refresh_compute()

    def _bind_rest(self) -> None:
        self._wait_update(REST)
        # after the marker: the last step's kernels may still read rest_device
        self.h2d.copy(self.rest_device, self.rest.compute, (self.h2d.marker(),)).wait()
        self._rest_h2d += self.rest.numel * self.rest.compute.element_size()
        self.rest.bind(self.rest_device)

    def _wait_update(self, key: int) -> None:
        """Host wait for the last update of group `key`: the optimizer time compute cannot hide."""
        start = time.perf_counter()
        self.updated[key].synchronize()
        self._exposed_opt += time.perf_counter() - start

    # -- one block, called from the hook and from _StreamedBlock ---------------------------------

    def run_block(self, index: int, weights: list[torch.Tensor], args, kwargs):
        """The block's own forward with `weights` (one tensor per parameter) in place of its own."""
        params = dict(zip(self._local_names[index], weights))
        self._in_block = True
        try:
            return torch.func.functional_call(self.blocks[index], params, args, kwargs)
        finally:
            self._in_block = False

    def block_forward(self, index: int, tensors: list[torch.Tensor], spec):
        """Forward of block `index` (position self._pos of the pass): outputs and, without
        checkpointing, the graph kept for backward."""
        if self._pos != index:
            raise UserError(f"block {index} ran at position {self._pos}; the engine needs every block once, in order")
        self._called.append(index)
        k, self._pos = self._pos, self._pos + 1
        self._wait_update(index)
        weights = self.streamer.acquire(k)
        args, kwargs = tree_unflatten(tensors, spec)
        if self.checkpoint:
            with torch.no_grad():
                out = self.run_block(index, self.groups[index].layout.views(weights), args, kwargs)
            self.streamer.release(k)
            return out, None
        kept = weights[:self.groups[index].numel].clone()  # the graph needs these until backward
        self.streamer.release(k)
        return self._forward_with_graph(index, kept, tensors, spec)

    def _forward_with_graph(self, index, weights, tensors, spec):
        with torch.enable_grad():
            # One leaf per parameter: a single flat leaf would make autograd build a zero-filled
            # flat-sized gradient for every view of it, then add them all up.
            leaves = [view.detach().requires_grad_() for view in self.groups[index].layout.views(weights)]
            inputs = [t.detach().requires_grad_(t.requires_grad) if torch.is_tensor(t) else t for t in tensors]
            args, kwargs = tree_unflatten(inputs, spec)
            out = self.run_block(index, leaves, args, kwargs)
        return out, (leaves, inputs, out)

    def block_backward(self, index: int, tensors, spec, graph, grad_outputs) -> list:
        """Recompute block `index` from its saved inputs (unless the graph was kept), ship the
        weight gradients to the host and return the input gradients."""
        k, self._pos = self._pos, self._pos + 1
        if graph is None:
            weights = self.streamer.acquire(k)
            leaves, inputs, out = self._forward_with_graph(index, weights[:self.groups[index].numel], tensors, spec)[1]
        else:
            leaves, inputs, out = graph
        outs, _ = tree_flatten(out)
        pairs = [(o, g) for o, g in zip(outs, grad_outputs) if torch.is_tensor(o) and o.requires_grad and g is not None]
        wanted = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
        grads = torch.autograd.grad([o for o, _ in pairs], wanted + leaves, [g for _, g in pairs], allow_unused=True)
        if graph is None:
            self.streamer.release(k)
        self._ship_grads(index, grads[len(wanted):])
        by_input = iter(grads[:len(wanted)])
        return [next(by_input) if torch.is_tensor(t) and t.requires_grad else None for t in inputs]

    # -- gradients to the host, and the optimizer -----------------------------------------------

    def _ship_grads(self, key: int, grads: list[torch.Tensor | None]) -> None:
        """Gather `key`'s gradients into a device buffer, copy it to a host buffer on the d2h
        stream, and hand that to the optimizer worker."""
        group = self.rest if key == REST else self.groups[key]
        turn, self._grad_turn = self._grad_turn, 1 - self._grad_turn
        self.grad_device_free[turn].wait()  # the previous copy out of this buffer has finished
        flat = self.grad_device[turn][:group.numel]
        for entry, view, grad in zip(group.layout.entries, group.layout.views(flat), grads):
            if grad is None:  # torch.optim skips such a parameter and keeps a per-parameter step count
                raise UserError(f"parameter {entry.name} got no gradient from loss_fn; set requires_grad=False on "
                                "parameters the loss does not use before building the engine")
            view.copy_(grad)
        slot = key if self.max_grad_norm is not None else turn
        start = time.perf_counter()
        self.grad_host_free[slot].synchronize()  # the optimizer is done with this staging buffer
        self._exposed_opt += time.perf_counter() - start
        host = self.grad_host[slot][:group.numel]
        arrived = self.d2h.copy(host, flat, (self.d2h.marker(),))
        self.grad_device_free[turn] = arrived
        self.stats["d2h_bytes"] += group.numel * flat.element_size()
        if self.max_grad_norm is None:
            step, lr = self.step + 1, self.lr
            done = self.worker.submit(lambda: self._update(group, host, step, lr), (arrived,))
            self.updated[key] = self.grad_host_free[slot] = done
        else:
            norms = self._norms  # this step's dict, whatever step is current when the job runs
            views = group.layout.views(host)
            self.worker.submit(lambda: norms.__setitem__(key, parameter_norms(views)), (arrived,))

    def _schedule_clipped_updates(self) -> None:
        """After backward: one job computes the clipping factor, then updates the groups in the
        order the next forward needs them, releasing each as soon as it is written."""
        order = [REST, *range(len(self.groups))]
        handles = {key: ThreadHandle() for key in order}
        step, lr, norms = self.step + 1, self.lr, self._norms

        def clipped_updates():
            try:
                scale = clip_coefficient([norms[g][i] for g, i in self._norm_order], self.max_grad_norm)
                for key in order:
                    self.worker.jitter()  # tests: a delay between groups, where the next forward races us
                    group = self.rest if key == REST else self.groups[key]
                    self._update(group, self.grad_host[key][:group.numel], step, lr, scale)
                    handles[key].set()
            except BaseException as error:
                for handle in handles.values():
                    if not handle.done():
                        handle.set(error)
                raise

        self.worker.submit(clipped_updates)
        self.updated.update(handles)
        self.grad_host_free.update(handles)

    def _update(self, group: GroupState, grad: torch.Tensor, step: int, lr: float, scale: float = 1.0) -> None:
        """AdamW on one group (runs on the optimizer worker)."""
        adamw_parallel_(group.master, grad, group.exp_avg, group.exp_avg_sq, group.compute, step, lr, self.adamw,
                        grad_scale=scale, exact=self.exact, threads=self.optimizer_threads)

    def _update_stats(self, seconds: float) -> None:
        s = self.stats
        s["steps"] += 1
        s["step_s"] += seconds
        s["optimizer_s"] = self.worker.busy_s
        s["exposed_transfer_s"] = self.streamer.wait_s
        s["h2d_bytes"] = self.streamer.h2d_bytes + self._rest_h2d
        s["exposed_optimizer_s"] = self._exposed_opt + self.h2d.host_wait_s  # CUDA: upload issue waited on it
        size = torch.finfo(self.compute_dtype).bits // 8
        pool = self.streamer.peak_bytes if self.checkpoint else sum(g.numel for g in self.groups) * size
        s["peak_device_param_bytes"] = pool + self.rest.numel * size

    # -- state ------------------------------------------------------------------------------------

    def synchronize(self) -> None:
        """Wait until every scheduled update has been applied."""
        for handle in list(self.updated.values()):
            handle.synchronize()
        self.worker.submit(lambda: None).synchronize()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 master weights and the model's buffers, keyed as `model.state_dict()`."""
        self.synchronize()
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict:
        """Everything needed to resume exactly: master weights, moments, step, lr (copies)."""
        self.synchronize()
        groups = {g.name: {"master": g.master.clone(), "exp_avg": g.exp_avg.clone(), "exp_avg_sq": g.exp_avg_sq.clone()}
                  for g in (*self.groups, self.rest)}
        return {"step": self.step, "lr": self.lr, "groups": groups}

    def load_state_dict(self, state: dict) -> None:
        self.synchronize()
        expected = {g.name: g for g in (*self.groups, self.rest)}
        saved = state.get("groups", {})
        if set(saved) != set(expected):
            raise UserError(f"offload state has groups {sorted(saved)[:3]}...; this engine has {sorted(expected)[:3]}... "
                            "(a different model)")
        for name, group in expected.items():
            for key in ("master", "exp_avg", "exp_avg_sq"):
                tensor = saved[name][key]
                if tensor.numel() != group.numel:
                    raise UserError(f"offload state {name}.{key} has {tensor.numel()} values; this model needs {group.numel}")
                getattr(group, key).copy_(tensor)
            group.refresh_compute()
        self.step, self.lr = int(state["step"]), float(state["lr"])

    def inject_delays(self, max_seconds: float, seed: int = 0) -> None:
        """Testing aid: random sleeps before every copy and optimizer job, to expose races."""
        for offset, target in enumerate((self.h2d, self.d2h)):
            rng = random.Random(seed + offset)
            target.set_jitter(lambda rng=rng: time.sleep(rng.uniform(0, max_seconds)))
        rng = random.Random(seed + 7)
        self.worker.jitter = lambda: time.sleep(rng.uniform(0, max_seconds))

    def close(self) -> None:
        """Finish pending updates, stop the threads and give back a plain host model (fp32)."""
        self.synchronize()
        for block in self.blocks:
            if isinstance(block.__dict__.get("forward"), _BlockHook):
                del block.forward
        for target in (self.h2d, self.d2h, self.worker):
            target.close()


def _device(name) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    check(device is not None and device.type in ("cpu", "cuda"), f"device={name!r} is unsupported; valid: cpu, cuda")
    check(device.type != "cuda" or torch.cuda.is_available(), f"device={name!r} but CUDA is not available here; use device='cpu'")
    return device


class _BlockHook:
    """Stands in for `block.forward` on the instance; routes calls through the engine."""

    def __init__(self, engine: OffloadEngine, index: int, original):
        self.engine, self.index, self.original = engine, index, original

    def __call__(self, *args, **kwargs):
        if self.engine._in_block:  # the engine itself running the block with streamed weights
            return self.original(*args, **kwargs)
        tensors, spec = tree_flatten((args, kwargs))
        if not torch.is_grad_enabled():
            out, _ = self.engine.block_forward(self.index, tensors, spec)
            return out
        outs = _StreamedBlock.apply(self.engine, self.index, spec, self.engine._anchor, *tensors)
        return tree_unflatten(list(outs), self.engine._out_spec)


class _StreamedBlock(torch.autograd.Function):
    """One block as a checkpoint: forward without a graph, backward recomputes (see engine)."""

    @staticmethod
    def forward(ctx, engine, index, spec, anchor, *tensors):
        out, graph = engine.block_forward(index, list(tensors), spec)
        outs, engine._out_spec = tree_flatten(out)
        ctx.engine, ctx.index, ctx.spec, ctx.graph = engine, index, spec, graph
        ctx.autocast = torch.is_autocast_enabled(engine.device.type)
        ctx.save_for_backward(*[t if torch.is_tensor(t) else None for t in tensors])
        ctx.others = [None if torch.is_tensor(t) else t for t in tensors]
        return tuple(o.detach() if torch.is_tensor(o) else o for o in outs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        saved = ctx.saved_tensors
        tensors = [s if o is None else o for s, o in zip(saved, ctx.others)]
        with torch.autocast(ctx.engine.device.type, dtype=ctx.engine.compute_dtype, enabled=ctx.autocast):
            grads = ctx.engine.block_backward(ctx.index, tensors, ctx.spec, ctx.graph, grad_outputs)
        ctx.graph = None
        return (None, None, None, None, *grads)
