"""A sharded engine's state as one process's: gathered for checkpoints, cut again on load.

`gather_state` assembles every group's master weights and moments from the ranks' shards into
exactly the dict an engine on one process saves (`HostState.state_dict`), so a checkpoint resumes
on any number of ranks, one included: `scatter_state` takes this rank's shard of such a dict.
8-bit moments keep one absmax per quantization block; shards hold whole blocks, so their scales
concatenate. `gather_weights` gives the full master weights (`OffloadEngine.model_state_dict`).
"""

import torch
import torch.distributed as dist

from slidefusion.core.errors import UserError
from slidefusion.offload.engine.sharded import piece


def _block_span(group) -> tuple[int, int, int]:
    """(first block, end block, blocks in the group) of this rank's 8-bit scales."""
    from slidefusion.offload.optim.formats import block_starts

    starts = block_starts(group.layout, group.n_train)
    first = int((starts < group.lo).sum())
    return first, first + group.moments.starts.numel() - 1, starts.numel() - 1


def _pieces(group, key: str, tensor: torch.Tensor) -> list[torch.Tensor]:
    """`tensor` (this rank's part of state `key`) as the parts that concatenate across ranks."""
    if key != "scales":
        return [tensor]
    blocks = group.moments.starts.numel() - 1
    return [tensor[:blocks], tensor[blocks:]]  # absmax of m, then of v


def _gather(comm, part: torch.Tensor, sizes: list[int], dst: int | None) -> torch.Tensor | None:
    """Every rank's `part` (rank j holds `sizes[j]` values), concatenated; on `dst` only, or on all (None)."""
    size, world = max(max(sizes), 1), len(sizes)
    send = torch.zeros(size, dtype=part.dtype)
    send[:part.numel()].copy_(part)
    out = torch.empty(world * size, dtype=part.dtype) if dst in (None, comm.groups.rank) else None
    if dst is None:  # the host group (gloo, the world): the optimizer thread is idle while the state is read
        comm.all_gather(out, send, comm.groups.host, "state all-gather").synchronize()
    else:  # it spans the world, so its ranks are the global ones
        dist.gather(send, list(out.split(size)) if out is not None else None, dst=dst, group=comm.groups.host)
    if out is None:
        return None
    return torch.cat([out[j * size:j * size + sizes[j]] for j in range(world)])


def _part_sizes(group, key: str) -> list[list[int]]:
    """Per part of state `key` (see `_pieces`), how many values each rank holds: known from the cuts."""
    if key != "scales":
        return [[b - a for a, b in zip(group.cuts, group.cuts[1:])]]
    from slidefusion.offload.optim.formats import block_starts

    starts = block_starts(group.layout, group.n_train)
    blocks = [int(((starts >= a) & (starts < b)).sum()) for a, b in zip(group.cuts, group.cuts[1:])]
    return [blocks, blocks]


def gather_state(state, comm, dst: int | None = 0) -> dict | None:
    """`HostState.state_dict()` of the whole model from the shards: on rank `dst` (None: on all);
    the others get None. Every rank must call it."""
    groups = {}
    for group in state.groups.values():
        saved = {}
        for key, tensor in group.state().items():
            parts = [_gather(comm, p, sizes, dst) for p, sizes in zip(_pieces(group, key, tensor), _part_sizes(group, key))]
            saved[key] = None if parts[0] is None else torch.cat(parts)
        groups[group.name] = saved
    if dst is not None and comm.groups.rank != dst:
        return None
    return {"format": dict(state.format), "groups": groups}


def scatter_state(state, saved: dict) -> None:
    """Take this rank's shard of a whole-model `HostState.state_dict()` (the checks of
    `HostState.load_state_dict`, then the copies); the caller publishes the compute copy."""
    check_format(state, saved)
    expected = {g.name: g for g in state.groups.values()}
    for name, group in expected.items():
        for key, target in group.state().items():
            tensor = saved["groups"][name].get(key)
            if tensor is None or tensor.numel() != _whole(group, key, target):
                raise UserError(f"offload state {name}.{key} is missing or has the wrong size for this model")
            target.copy_(_own(group, key, tensor))
        group.refresh_compute()


def _whole(group, key: str, target: torch.Tensor) -> int:
    if key == "scales":
        return 2 * _block_span(group)[2]
    return group.n_train


def _own(group, key: str, tensor: torch.Tensor) -> torch.Tensor:
    if key != "scales":
        return tensor[group.lo:group.hi]
    first, end, total = _block_span(group)
    return torch.cat([tensor[first:end], tensor[total + first:total + end]])


def check_format(state, saved: dict) -> None:
    """The storage format and the groups of `saved` match `state` (as `HostState.load_state_dict`)."""
    stored = saved.get("format", {"master": "fp32", "moments": "fp32"})
    if {k: stored.get(k) for k in ("master", "moments")} != {k: state.format[k] for k in ("master", "moments")}:
        raise UserError(f"offload state was saved with master={stored.get('master')}, moments={stored.get('moments')}; "
                        f"this engine has master={state.format['master']}, moments={state.format['moments']}")
    names = {g.name for g in state.groups.values()}
    if set(saved.get("groups", {})) != names:
        raise UserError(f"offload state has groups {sorted(saved.get('groups', {}))[:3]}...; this engine has "
                        f"{sorted(names)[:3]}... (a different model)")


def gather_weights(state, comm) -> dict[str, torch.Tensor]:
    """The whole master weights (trainable) and compute copy (frozen) by state_dict name, on every rank."""
    out = {}
    for group in state.groups.values():
        master = _gather(comm, group.master.value[:group.n_own], _part_sizes(group, "master")[0], None) if group.n_train else None
        for i, entry in enumerate(group.layout.entries):
            source = master if i < len(group.trainable) else group.compute
            out[entry.name] = source[entry.offset:entry.offset + entry.numel].view(entry.shape)
    return out


def first_nonfinite(state, comm) -> str | None:
    """The name of the first weight holding NaN or infinity on any rank (this rank checks its
    master shard and the frozen compute copy), or None; one all-reduce."""
    names = [e.name for g in state.groups.values() for e in g.layout.entries]
    bad = torch.zeros(len(names), dtype=torch.float32)
    index = 0
    for group in state.groups.values():
        for i, entry in enumerate(group.layout.entries):
            a, b = entry.offset, entry.offset + entry.numel
            if i < len(group.trainable):
                a, b = max(a, group.lo), min(b, group.hi)
                values = group.master.value[a - group.lo:b - group.lo] if a < b else None
            else:
                values = group.compute[a:b]
            if values is not None and not torch.isfinite(values.float()).all():
                bad[index] = 1
            index += 1
    comm.all_reduce(bad, comm.groups.host, "finite check").synchronize()
    hit = torch.nonzero(bad).flatten()
    return names[int(hit[0])] if hit.numel() else None


def host_bytes(state, shared_bytes: int, comm) -> tuple[int, int]:
    """(this rank's host bytes, its node's): own state plus, once per node, a shared compute copy."""
    groups = comm.groups
    mine = torch.tensor([float(state.host_bytes())])
    if groups.node is not None:
        comm.all_reduce(mine, groups.node, "host bytes").synchronize()
        return int(state.host_bytes()), int(mine.item()) + shared_bytes
    return int(state.host_bytes()), int(state.host_bytes()) * groups.local_world


__all__ = ["gather_state", "scatter_state", "gather_weights", "first_nonfinite", "host_bytes", "piece"]
