"""The device side of the weights: resident groups, streamed blocks, and the gradient buffers.

Resident groups (the rest of the model, and the last `resident_blocks` blocks) own a device buffer
that is never streamed: after each update the optimizer thread issues one upload of the group's new
compute copy ("refresh"), at low priority on the copy thread so it fills the link's idle time
instead of delaying the streamed uploads, and the next use waits for it. The other blocks stream
through the `BlockStreamer`'s prefetch + 1 slots, twice per step (forward, backward recompute).
"""

import time
from collections.abc import Callable

import torch

from slidefusion.core.errors import UserError
from slidefusion.offload.engine.fp8 import Fp8Streaming
from slidefusion.offload.engine.layout import REST
from slidefusion.offload.engine.streamer import BlockStreamer
from slidefusion.offload.engine.transfer import DONE, Handle


class DeviceWeights:
    """Where each block's weights are on the device during a pass, and their refresh after updates."""

    def __init__(self, state, policy, h2d, updated: Callable[[int], Handle]):
        self.state, self.h2d, self.updated = state, h2d, updated
        device, dtype, n = policy.torch_device, policy.compute_dtype, len(state.blocks)
        self.direct = policy.direct  # every group "resident" in its own host buffer: nothing to copy
        self.resident = [REST, *range(0 if self.direct else n - policy.resident_blocks, n)]
        self.streamed = [b for b in range(n) if b not in self.resident]
        self.buffers = {key: state.groups[key].compute if self.direct else
                        torch.empty(state.groups[key].numel, dtype=dtype, device=device) for key in self.resident}
        self.refreshed: dict[int, Handle] = {key: DONE for key in self.resident}
        self.free: dict[int, Handle] = {key: DONE for key in self.resident}  # the last compute read of each buffer
        self.refresh_bytes, self.wait_s = 0, 0.0  # the resident groups' uploads, and compute's waits for them
        largest = max((state.blocks[b].numel for b in self.streamed), default=0)
        self.slots = [torch.empty(largest, dtype=dtype, device=device) for _ in range(policy.prefetch + 1)] if self.streamed else []
        sources = [state.blocks[b].compute for b in self.streamed]
        frozen = [state.blocks[b].frozen for b in self.streamed]
        codec = Fp8Streaming(frozen, len(self.slots), device) if any(f is not None for f in frozen) else None
        self.streamer = BlockStreamer(h2d, sources, self.slots, lambda k: (updated(self.streamed[k]),), codec)
        self.position: dict[int, int] = {}
        self.upload_all()

    def upload_all(self) -> None:
        """Every resident group's whole compute copy (frozen part included), waited for."""
        for key, buffer in self.buffers.items() if not self.direct else ():
            group = self.state.groups[key]
            self.h2d.copy(buffer[:group.compute.numel()], group.compute, (self.h2d.marker(),)).synchronize()
            if group.frozen is not None:  # an fp8 base: its codes up once, decoded into the buffer for good
                wire = torch.empty(group.frozen.wire.numel(), dtype=torch.uint8, device=buffer.device)
                self.h2d.copy(wire, group.frozen.wire, (self.h2d.marker(),)).synchronize()
                group.frozen.decode_into(wire, buffer)
            self.refreshed[key] = DONE
        self.streamer.holds = [None] * len(self.slots)  # nothing in the pool is current any more

    def begin_pass(self, forward: bool) -> None:
        """Start the forward pass (blocks in call order) or the backward pass (reversed)."""
        order = list(range(len(self.streamed)))
        self.streamer.start(order if forward else order[::-1], reuse=not forward)
        self.position = {block: k for k, block in enumerate(self.streamed if forward else self.streamed[::-1])}
        if forward:
            self.refreshed[REST].wait()
            self.state.rest.bind(self.buffers[REST])

    def acquire(self, block: int) -> torch.Tensor:
        """The flat device weights of `block`, once they have landed."""
        if block in self.buffers:
            start = time.perf_counter()
            self.refreshed[block].wait()
            self.wait_s += time.perf_counter() - start
            return self.buffers[block]
        return self.streamer.acquire(self.position[block])

    def release(self, block: int) -> None:
        if block in self.buffers:
            self.free[block] = self.h2d.marker()  # a refresh may overwrite the buffer after this
        else:
            self.streamer.release(self.position[block])

    def refresh(self, key: int, after: tuple[Handle, ...]) -> None:
        """On the optimizer thread, once `key`'s update is written: upload its trainable part."""
        if key in self.buffers and self.state.groups[key].n_train and not self.direct:
            group, n = self.state.groups[key], self.state.groups[key].n_train
            self.refreshed[key] = self.h2d.copy(self.buffers[key][:n], group.compute[:n], (*after, self.free[key]),
                                                low=key != REST)
            self.refresh_bytes += n * group.compute.element_size()

    def resident_bytes(self) -> int:
        return 0 if self.direct else sum(b.numel() * b.element_size() for b in self.buffers.values())

    def reserved_bytes(self) -> int:
        codec = self.streamer.codec
        return (self.resident_bytes() + sum(s.numel() * s.element_size() for s in self.slots)
                + (0 if codec is None else codec.reserved_bytes()))


class GradientShipper:
    """Gradients to the host: gathered into one of two device buffers (one filling while the other
    drains) and copied on the d2h stream into the update strategy's staging buffer. On a CPU device
    they are copied straight into staging, or (`policy.holds_gradients`) handed over as autograd
    made them, at most two blocks' worth at once, as two staging buffers would hold."""

    def __init__(self, state, policy, d2h, strategy):
        largest = 0 if policy.direct else max(g.n_train for g in state.groups.values())  # direct: straight to staging
        device, dtype = policy.torch_device, policy.compute_dtype
        self.buffers = [torch.empty(largest, dtype=dtype, device=device) for _ in range(2)]
        self.free: list[Handle] = [DONE, DONE]
        self.turn, self.d2h, self.strategy, self.holds = 0, d2h, strategy, policy.holds_gradients
        self.bytes, self.wait_s = 0, 0.0

    @staticmethod
    def check_grads(group, grads: list) -> None:
        for entry, grad in zip(group.layout.entries, grads):
            if grad is None:  # torch.optim skips such a parameter and keeps a per-parameter step count
                raise UserError(f"parameter {entry.name} got no gradient from loss_fn; set requires_grad=False on "
                                "parameters the loss does not use before building the engine")

    def ship(self, group, grads: list, step: int, lr: float) -> None:
        """Send `group`'s trainable gradients (one per parameter, in layout order) to its update."""
        if group.n_train == 0:
            return
        self.check_grads(group, grads)
        if self.holds:
            return self._hand_over(group, grads, step, lr)
        direct = self.buffers[0].numel() == 0
        turn, self.turn = self.turn, 1 - self.turn
        self.free[turn].wait()  # the previous copy out of this buffer has finished
        host, free = self.strategy.staging(group)
        if direct:
            self._wait(free)
        flat = host if direct else self.buffers[turn][:group.n_train]
        for view, grad in zip(group.layout.views(flat, len(group.trainable)), grads):
            view.copy_(grad)
        if not direct:
            self._wait(free)
        arrived = DONE if direct else self.d2h.copy(host, flat, (self.d2h.marker(),))
        self.free[turn] = arrived
        self.bytes += flat.numel() * flat.element_size()  # (direct: written in place, the bytes the update reads)
        self.strategy.landed(group, host, arrived, step, lr)

    def _hand_over(self, group, grads: list, step: int, lr: float) -> None:
        turn, self.turn = self.turn, 1 - self.turn
        self._wait(self.free[turn])  # the update two groups back has read its gradients
        flat = [grad.reshape(-1) for grad in grads]
        self.bytes += sum(g.numel() * g.element_size() for g in flat)  # the bytes the update reads
        self.free[turn] = self.strategy.landed(group, flat, DONE, step, lr)

    def _wait(self, free: Handle) -> None:
        """Until the optimizer is done with the staging buffer: optimizer time compute cannot hide."""
        start = time.perf_counter()
        free.synchronize()
        self.wait_s += time.perf_counter() - start
