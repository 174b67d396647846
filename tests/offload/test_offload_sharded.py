"""Host state sharded over data-parallel ranks, without a process group: where groups are cut, and
that updating each shard on its own gives what updating the whole group gives, in every format.

The spawned, multi-rank tests of the engine and the trainer are in tests/training/test_distributed.py."""

import pytest
import torch
from torch import nn

from slidefusion.core.errors import UserError
from slidefusion.offload.optim.formats import block_starts
from slidefusion.offload.engine.host_state import GroupState
from slidefusion.offload.engine.layout import GroupSpec, layout_of
from slidefusion.offload.optim.update import update_group
from slidefusion.offload.policy import OffloadPolicy
from slidefusion.offload.engine.sharded import Sharding, piece
from slidefusion.offload.engine.shared_host import check_room
from slidefusion.optim import OptimConfig

SIZES = (3001, 77, 5000, 2048)  # awkward: tensors that are not whole blocks, one shorter than a vector tail


def _params(seed: int = 0) -> list[tuple[str, nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"w{i}", nn.Parameter(torch.randn(n, generator=g) * 0.1)) for i, n in enumerate(SIZES)]


def _group(policy, sharding=None, seed=0) -> GroupState:
    spec = GroupSpec("blocks[0]", 0, "", _params(seed), [])
    return GroupState(spec, policy, lambda n, dtype, dma: torch.empty(n, dtype=dtype), sharding)


def _policy(master, moments, rounding="stochastic"):
    optim = OptimConfig(lr=1e-2, weight_decay=0.1, eps=1e-8, max_grad_norm=None, warmup_steps=0, ema_decay=None)
    return OffloadPolicy(device="cpu", compute_dtype=torch.float32, master=master, moments=moments, rounding=rounding,
                         optim=optim, overlap=False)


@pytest.mark.parametrize("world", [2, 3, 4, 7])
@pytest.mark.parametrize("moments", ["fp32", "int8"])
def test_cuts_cover_the_group_and_int8_cuts_fall_on_block_starts(world, moments):
    layout = layout_of(_params())
    n = layout.numel
    cuts = Sharding(world, 0).cuts(layout, n, moments)
    assert len(cuts) == world + 1 and cuts[0] == 0 and cuts[-1] == n
    assert all(a <= b for a, b in zip(cuts, cuts[1:]))
    starts = set(block_starts(layout, n).tolist())  # an int8 block's absmax and a tensor's vector tail stay whole
    assert all(c in starts for c in cuts)
    assert piece(cuts) <= -(-n // world) + 2048  # shards are near even: at most a block more than 1/world


FORMATS = [("fp32", "fp32", "stochastic"), ("bf16", "bf16", "stochastic"), ("bf16", "int8", "stochastic"),
           ("bf16", "bf16", "kahan"), ("fp32", "int8", "stochastic")]


@pytest.mark.parametrize("master,moments,rounding", FORMATS)
@pytest.mark.parametrize("world", [2, 3])
def test_shards_updated_apart_equal_the_whole_group_bitwise(master, moments, rounding, world):
    """Three AdamW steps on the whole group, and on each rank's shard with its slice of the same
    gradient: master, moments and compute copy are bitwise the same (stochastic rounding hashes the
    element's index in the group, 8-bit blocks never straddle a cut)."""
    policy = _policy(master, moments, rounding)
    whole = _group(policy)
    shards = [_group(policy, Sharding(world, r)) for r in range(world)]
    g = torch.Generator().manual_seed(1)
    for step in range(1, 4):
        grad = torch.randn(whole.n_train, generator=g) * 10.0 ** -step
        update_group(whole, grad, step, 1e-2, 0.5 if step == 2 else 1.0, policy)
        for shard in shards:
            update_group(shard, grad[shard.lo:shard.hi].clone(), step, 1e-2, 0.5 if step == 2 else 1.0, policy)
    for key, value in whole.state().items():
        if key == "scales":  # absmax of m for every block, then of v: the shards' halves in order
            halves = [s.moments.scales.view(2, -1) for s in shards]
            joined = torch.cat([torch.cat([h[i] for h in halves]) for i in range(2)])
        else:
            joined = torch.cat([s.state()[key] for s in shards])
        assert torch.equal(joined.view(torch.uint8), value.view(torch.uint8)), key
    for shard in shards:
        assert torch.equal(shard.compute[shard.lo:shard.hi], whole.compute[shard.lo:shard.hi])


def test_a_shard_that_hashed_its_own_indices_would_round_differently():
    """The check above can fail: stochastic rounding keyed by the shard's own element index (base 0)
    gives another master than the whole group's."""
    from slidefusion.offload.optim import lean

    policy = _policy("bf16", "bf16")
    whole, shard = _group(policy), _group(policy, Sharding(2, 1))
    grad = torch.randn(whole.n_train, generator=torch.Generator().manual_seed(2)) * 1e-3
    update_group(whole, grad, 1, 1e-2, 1.0, policy)
    real = lean.LeanBuffers.block_starts
    try:
        lean.LeanBuffers.block_starts = lambda self: real(self) - self.base if self.base else real(self)
        original = lean.LeanBuffers.__init__

        def no_base(self, *args, **kwargs):
            original(self, *args, **kwargs)
            self.base = 0
        lean.LeanBuffers.__init__ = no_base
        update_group(shard, grad[shard.lo:].clone(), 1, 1e-2, 1.0, policy)
    finally:
        lean.LeanBuffers.block_starts, lean.LeanBuffers.__init__ = real, original
    assert not torch.equal(shard.master.value, whole.master.value[shard.lo:])


def test_an_empty_shard_is_fine():
    policy = _policy("fp32", "fp32")
    tiny = GroupSpec("rest", -1, "", [("b", nn.Parameter(torch.ones(5)))], [])
    states = [GroupState(tiny, policy, lambda n, d, dma: torch.empty(n, dtype=d), Sharding(4, r)) for r in range(4)]
    assert sorted(s.n_own for s in states) == [0, 0, 0, 5]  # one block: one rank owns it
    empty = next(s for s in states if s.n_own == 0)
    update_group(empty, torch.empty(0), 1, 1e-2, 1.0, policy)  # nothing to do, no error
    assert empty.own_ends == []


def test_shared_memory_too_small_says_how_much_and_where(tmp_path):
    with pytest.raises(UserError, match=r"needs 1e\+06 TB of shared memory in /dev/shm .* set parallel.shared_host=false"):
        check_room(10**18)
    with pytest.raises(UserError, match=str(tmp_path / "nowhere")):
        check_room(10, str(tmp_path / "nowhere"))
