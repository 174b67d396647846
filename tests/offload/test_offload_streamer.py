"""The block pool: every acquired slot holds exactly its block, under random copy delays."""

import random
import time

import pytest
import torch

from slidefusion.offload.engine.streamer import BlockStreamer
from slidefusion.offload.engine.transfer import DONE, ThreadCopier


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_each_position_sees_its_own_block_in_both_passes(prefetch):
    sizes = [5, 9, 3, 9, 7, 2]
    sources = [torch.full((n,), float(b)) for b, n in enumerate(sizes)]  # hash-coded: value = block index
    slots = [torch.full((max(sizes),), -1.0) for _ in range(prefetch + 1)]
    copier = ThreadCopier("test-h2d")
    rng = random.Random(prefetch)
    copier.set_jitter(lambda: time.sleep(rng.uniform(0, 0.003)))
    streamer = BlockStreamer(copier, sources, slots, lambda b: (DONE,))
    for order, reuse in ((list(range(6)), False), (list(range(5, -1, -1)), True)):
        streamer.start(order, reuse=reuse)
        for k, block in enumerate(order):
            weights = streamer.acquire(k)[:sizes[block]]
            time.sleep(rng.uniform(0, 0.002))  # "compute" while later uploads land
            assert torch.equal(weights, sources[block]), (order, k)
            streamer.release(k)
    # the backward pass starts with the blocks the forward pass left in the pool
    uploaded = sum(sizes) + sum(sizes[:6 - min(prefetch + 1, 6)])
    assert streamer.h2d_bytes == uploaded * 4
    assert streamer.peak_bytes <= (prefetch + 1) * max(sizes) * 4
    copier.close()


def test_a_failing_copy_is_raised_where_it_is_waited_on():
    copier = ThreadCopier("test-fail")
    handle = copier.copy(torch.zeros(3), torch.zeros(4))
    with pytest.raises(RuntimeError, match="offload worker failed"):
        handle.synchronize()
    copier.close()
