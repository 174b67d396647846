"""Host-resident training state: per group of parameters, flat contiguous buffers, allocated once.

    compute     compute dtype  the copy that is uploaded (trainable + frozen parameters; with an fp8
                               base, `policy.frozen_dtype`, the trainable prefix only)
    frozen      with an fp8 base: `fp8.FrozenCodes`, the frozen parameters' codes and scales
    master      `optim.formats.MasterWeights` over the trainable prefix (may be the compute copy itself)
    moments     `optim.formats.Moments` over the trainable prefix

The model's own `nn.Parameter`s are re-pointed at views of these buffers (trainable ones at the
master, frozen ones at the compute copy), so `model.state_dict()` reads the live weights and no
second host copy exists. A model built on the meta device (shapes only) gets its buffers here
directly and is filled by `load_weights`, so a checkpoint never exists twice in memory.
"""

import torch

from slidefusion.core.errors import UserError
from slidefusion.offload.engine.fp8 import FrozenCodes
from slidefusion.offload.engine.layout import REST, GroupSpec, layout_of, split_groups
from slidefusion.offload.optim.formats import MasterWeights, Moments


class GroupState:
    """The flat host buffers of one group, and the model parameters that view them.

    With `sharding` (data parallelism, `offload.engine.sharded`) this process owns the master weights and
    moments of values [lo, hi) of the trainable prefix only; the compute copy is whole (its other
    shards arrive from the other ranks after each update), the parameters view it, and
    `allocate_compute` may place it in memory the node's ranks share."""

    def __init__(self, spec: GroupSpec, policy, allocate, sharding=None, allocate_compute=None):
        self.name, self.key = spec.name, spec.key
        self.layout = layout_of(spec.named)
        self.params = [p for _, p in spec.named]
        self.local_names = spec.local_names()
        self.trainable = self.params[:len(spec.trainable)]
        self.n_train = sum(p.numel() for p in self.trainable)
        self.train_ends = [e.offset + e.numel for e in self.layout.entries[:len(self.trainable)]]  # AdamW's tensor tails
        self.cuts = sharding.cuts(self.layout, self.n_train, policy.moments) if sharding else [0, self.n_train]
        self.lo, self.hi = self.cuts[sharding.rank:sharding.rank + 2] if sharding else (0, self.n_train)
        self.sharded, self.writes_compute = sharding is not None, sharding is None or sharding.writes_compute
        self.shares_compute = allocate_compute is not None  # the node's ranks map one compute copy
        fp8 = policy.frozen_dtype is not None and self.layout.numel > self.n_train  # codes replace the frozen copy
        numel = self.n_train if fp8 else self.layout.numel
        self.compute = (allocate_compute or (lambda n, d: allocate(n, d, True)))(numel, policy.compute_dtype)
        self.frozen = FrozenCodes(self.layout.entries[len(self.trainable):], self.n_train, policy.frozen_dtype,
                                  policy.frozen_scales, allocate) if fp8 else None
        self.master = MasterWeights(policy.master, policy.rounding, self.n_own, self.compute[self.lo:], allocate)
        self.moments = Moments(policy.moments, self.layout, self.n_train, allocate, (self.lo, self.hi))
        if not any(p.is_meta for p in self.params):
            with torch.no_grad():
                for entry, param in zip(self.layout.entries, self.params):
                    self.write(entry.offset, entry.numel, param.detach())
        self.bind_host()

    @property
    def numel(self) -> int:
        return self.layout.numel

    @property
    def n_own(self) -> int:
        """Trainable values whose master and moments this process holds."""
        return self.hi - self.lo

    @property
    def own_ends(self) -> list[int]:
        """AdamW's tensor ends inside [lo, hi), counted from lo."""
        return [min(e, self.hi) - self.lo for e in self.train_ends if e > self.lo] if self.n_own else []

    def write(self, offset: int, numel: int, value: torch.Tensor) -> None:
        """Store `value` (any float dtype) at `offset`: master (+ compensation) and compute copy.
        Sharded, the master's part in [lo, hi) and its compute copy (the rest arrives from its owners)."""
        if offset >= self.n_train and self.frozen is not None:
            self.frozen.write(offset, value)
            return
        value = value.reshape(-1)
        if offset >= self.n_train:
            if self.writes_compute:
                self.compute[offset:offset + numel].copy_(value)
            return
        start, end = max(offset, self.lo), min(offset + numel, self.hi)
        if start >= end:
            return
        value, at, numel = value[start - offset:end - offset], start - self.lo, end - start
        master = self.master.value[at:at + numel]
        master.copy_(value)
        if self.master.comp is not None:  # keep what rounding to bf16 dropped
            self.master.comp[at:at + numel].copy_(value.float() - master.float())
        if not self.master.is_compute:
            self.compute[start:end].copy_(self._decoded(at, numel))

    def _decoded(self, at: int, numel: int) -> torch.Tensor:
        """The master's value in fp32 (hi + lo with Kahan compensation), from its element `at`."""
        value = self.master.value[at:at + numel].float()
        return value if self.master.comp is None else value + self.master.comp[at:at + numel].float()

    def bind_host(self) -> None:
        """Point the model's parameters at their host views: trainable ones at the master (sharded:
        at the whole compute copy, as no process holds the whole master)."""
        trainable = self.layout.views(self.compute if self.sharded else self.master.value, len(self.trainable))
        # an fp8 base: the frozen parameters view their codes (the engine's device copies hold values)
        frozen = self.frozen.views() if self.frozen is not None else self.layout.views(self.compute)[len(self.trainable):]
        for view, param in zip(trainable + frozen, self.params):
            if param.is_meta:  # `.data =` cannot change a tensor's type; swap it (the object stays)
                torch.utils.swap_tensors(param, torch.nn.Parameter(view, requires_grad=param.requires_grad))
            else:
                param.data = view
        self.seen_versions = self.versions()

    def bind(self, flat: torch.Tensor) -> None:
        """Point the model's parameters at views of `flat` (a device buffer) for a step."""
        for view, param in zip(self.layout.views(flat), self.params):
            param.data = view

    def versions(self) -> int:
        """Sum of the parameters' version counters: it moves when anyone writes through them
        (load_state_dict, init_from), never when the optimizer writes the flat buffers."""
        return sum(p._version for p in self.params)

    def written_outside(self) -> bool:
        return self.versions() != self.seen_versions

    def refresh_compute(self) -> None:
        """The compute copy from the master, after a write through the model or a state load.
        Sharded, a write through the model went into the compute copy: the master shard takes it."""
        if self.master.comp is not None and self.written_outside():
            self.master.comp.zero_()  # a write through the model set the bf16 value alone
        if self.sharded and self.written_outside():
            if not self.master.is_compute:
                self.master.value.copy_(self.compute[self.lo:self.hi])
        elif not self.master.is_compute:
            self.compute[self.lo:self.hi].copy_(self._decoded(0, self.n_own))
        self.seen_versions = self.versions()

    def state(self) -> dict[str, torch.Tensor]:
        return {**self.master.tensors(), **self.moments.tensors()}

    def compute_bytes(self) -> int:
        return self.compute.numel() * self.compute.element_size()

    def host_bytes(self) -> int:
        """This process's own bytes: the compute copy (unless shared), fp8 codes, its master and moments."""
        codes = 0 if self.frozen is None else self.frozen.host_bytes()  # else the compute copy holds them
        return ((0 if self.shares_compute else self.compute_bytes()) + codes + self.master.host_bytes()
                + self.moments.host_bytes())

    def frozen_bytes(self) -> int:
        """Host bytes of the frozen parameters: their compute copy, or their fp8 codes and scales."""
        if self.frozen is not None:
            return self.frozen.host_bytes()
        return (self.numel - self.n_train) * self.compute.element_size()


class HostState:
    """Every group of one engine: `blocks[i]` in call order and `rest`."""

    def __init__(self, model, blocks, policy, allocate, sharding=None, allocate_compute=None):
        specs, rest = split_groups(model, blocks)
        self.format = {"master": policy.master, "moments": policy.moments, "rounding": policy.rounding}
        self.blocks = [GroupState(spec, policy, allocate, sharding, allocate_compute) for spec in specs]
        self.rest = GroupState(rest, policy, allocate, sharding, allocate_compute)
        self.groups = {REST: self.rest, **{g.key: g for g in self.blocks}}
        self.norm_order = _parameter_order(model, self.groups)

    def host_bytes(self) -> int:
        return sum(g.host_bytes() for g in self.groups.values())

    def trainable_numel(self) -> int:
        return sum(g.n_train for g in self.groups.values())

    def frozen_numel(self) -> int:
        return sum(g.numel - g.n_train for g in self.groups.values())

    def frozen_bytes(self) -> int:
        """Host bytes of the frozen parameters: their compute copy alone (or fp8 codes and scales)."""
        return sum(g.frozen_bytes() for g in self.groups.values())

    def state_dict(self) -> dict:
        """Copies of every group's persistent state, and the storage format it is in."""
        return {"format": dict(self.format),
                "groups": {g.name: {k: v.clone() for k, v in g.state().items()} for g in self.groups.values()}}

    def load_state_dict(self, state: dict) -> None:
        saved, expected = state.get("groups", {}), {g.name: g for g in self.groups.values()}
        stored = state.get("format", {"master": "fp32", "moments": "fp32", "rounding": self.format["rounding"]})
        if {k: stored.get(k) for k in ("master", "moments")} != {k: self.format[k] for k in ("master", "moments")}:
            raise UserError(f"offload state was saved with master={stored.get('master')}, moments={stored.get('moments')}; "
                            f"this engine has master={self.format['master']}, moments={self.format['moments']}")
        if set(saved) != set(expected):
            raise UserError(f"offload state has groups {sorted(saved)[:3]}...; this engine has {sorted(expected)[:3]}... "
                            "(a different model)")
        for name, group in expected.items():
            for key, target in group.state().items():
                tensor = saved[name].get(key)
                if tensor is None or tensor.numel() != target.numel():
                    raise UserError(f"offload state {name}.{key} is missing or has the wrong size for this model")
                target.copy_(tensor)
            group.refresh_compute()


def _parameter_order(model, groups: dict) -> list[tuple[int, int]]:
    """(group key, index among its trainable parameters) of each trainable parameter in
    `model.parameters()` order: the order clip_grad_norm_ sums the norms in, which the clipped
    result depends on bitwise."""
    where = {}
    for key, group in groups.items():
        where.update({id(p): (key, i) for i, p in enumerate(group.trainable)})
    return [where[id(p)] for p in model.parameters() if id(p) in where]
