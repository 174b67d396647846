"""The four users of the hook registry stacked in pairs on one model: offload streaming, tiling, a
parallel plan and the slide-attention swap.

Every pair is attached in both orders. Where the pair stacks, the stacked model runs, both detach
orders are tried, and afterwards the model's forward output, state dict and every module's
`__dict__` are bitwise what they were. Where it cannot stack, the second attach is one UserError
line and leaves the first user's hooks working and removable.

"tiling" is resident tiling (`tile_blocks`); the engine's own tiling (`OffloadPolicy(tile=...)`) is
part of streaming. Why the refusals: streaming, resident tiling and the parallel plans each run every block through
their own hook (a block streamed and tiled would be checkpointed twice; a parallel plan runs blocks
on another rank's tokens), so a model carries one of them at a time. The swap changes what the model
is made of, which the others read when attached: it goes on first and comes off last.
"""

import itertools
import os
import socket

import pytest
import torch
import torch.distributed as dist

from slidefusion.core import hooks
from slidefusion.core.errors import UserError
from slidefusion.models import build_model, preset

USERS = ("offload", "tiling", "parallel", "swap")
ENGINES = ("offload", "tiling", "parallel")


@pytest.fixture(scope="module")
def one_rank():
    """A one-rank gloo group, so `parallelize` attaches its hooks in this process."""
    if dist.is_initialized():
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model():
    torch.manual_seed(0)
    model = build_model(preset("stdit-tiny", text_dim=16))
    with torch.no_grad():  # adaLN-Zero starts every block as the identity: wake them up
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model.eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 3, 4, 4, 6, generator=g), torch.rand(2, generator=g), torch.randn(2, 5, 16, generator=g)


def _forward(model):
    """The model's output on fixed inputs, on one intra-op thread: the offload engine's worker threads
    change torch's thread settings while they start and stop, and a matmul split over another
    number of threads rounds differently; that is not what this test is about."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            return model(*_inputs())
    finally:
        torch.set_num_threads(threads)


def attach(user: str, model):
    """Attach `user` to `model`; returns the function that detaches it."""
    if user == "offload":
        from slidefusion.families import adapter_for
        from slidefusion.offload import OffloadEngine, OffloadPolicy

        engine = OffloadEngine(model, adapter_for(model).blocks(model),
                               OffloadPolicy(device="cpu", compute_dtype=torch.float32, zero_copy=False))
        return engine.close
    if user == "tiling":
        from slidefusion.offload.tiling.tile_runner import tile_blocks, untile_blocks

        tile_blocks(model, 1)
        return lambda: untile_blocks(model)
    if user == "parallel":
        from slidefusion.parallel import ParallelConfig, parallelize

        return parallelize(model, ParallelConfig(schedule="dsp")).detach
    from slidefusion.swap import use_slide_attention

    return use_slide_attention(model, kernel_size=(1, 3, 3), offsets=None).remove


def _legal(first: str, second: str) -> bool:
    return first == "swap" and second in ENGINES


def _snapshot(model):
    return ({k: v.clone() for k, v in model.state_dict().items()},
            {name: dict(vars(m)) for name, m in model.named_modules()})


def _assert_original(model, reference, snapshot):
    state, dicts = snapshot
    assert torch.equal(_forward(model), reference)
    after = model.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    for name, module in model.named_modules():
        assert set(vars(module)) == set(dicts[name]), name  # no leftovers (registry, instance forward)
        assert all(vars(module)[k] is v for k, v in dicts[name].items() if k in ("_modules", "forward")), name
    assert not list(hooks.hooked_modules(model))


@pytest.mark.parametrize("first, second", list(itertools.permutations(USERS, 2)))
def test_pairs_stack_or_refuse_and_detach_to_the_original(one_rank, first, second):
    model = _model()
    reference, snapshot = _forward(model), _snapshot(model)
    detach_first = attach(first, model)
    if not _legal(first, second):
        with pytest.raises(UserError) as error:
            attach(second, model)
        assert "\n" not in str(error.value) and "hooks" in str(error.value)
        detach_first()
        _assert_original(model, reference, snapshot)
        return
    swapped = _forward(model)
    detach_second = attach(second, model)
    if second != "offload":  # the engine's forward belongs to its train_step
        assert torch.allclose(_forward(model), swapped, atol=1e-5)  # the stack computes what the swap did
    with pytest.raises(UserError, match="remove them before the slide attention"):
        detach_first()  # the swap comes off last
    detach_second()
    detach_first()
    _assert_original(model, reference, snapshot)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_engine_comes_off_and_on_again_around_the_swap(one_rank, engine):
    """An engine detached from a swapped model leaves the swap intact: it attaches again, comes off
    again, and the swap then comes off to the original model."""
    model = _model()
    reference, snapshot = _forward(model), _snapshot(model)
    remove_swap = attach("swap", model)
    detach = attach(engine, model)
    detach()
    detach = attach(engine, model)  # again, on the swapped model the first detach left behind
    detach()
    remove_swap()
    _assert_original(model, reference, snapshot)
