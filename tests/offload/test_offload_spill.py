"""Checkpoints spilled to disk: bitwise the results of host-resident ones, whole or tiled; spill
files gone on success, on an exception, and (after a kill) at the next start; a full disk or an
unwritable folder is one line before the step."""

import copy
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from slidefusion.errors import UserError
from slidefusion.models import build_model, preset
from slidefusion.offload import OffloadEngine, OffloadPolicy
from slidefusion.offload.tiling.activation_store import SpilledCheckpoints
from slidefusion.offload.tiling.spill import SpillFile
from slidefusion.optim import OptimConfig

OPTIM = OptimConfig(lr=1e-3, max_grad_norm=None, warmup_steps=0, ema_decay=None)


def _model():
    config = preset("dit3d-tiny", depth=3, text_dim=8, attention="slide", attention_options={"kernel_size": (3, 3, 3)})
    torch.manual_seed(0)
    return build_model(config)


def _loss(model, step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2, 3, 6, 16, 16, generator=g)  # 6 x 8 x 8 tokens: block inputs of 2 x 384 x 32 x 4 B = 96 KiB
    out = model(x, torch.rand(2, generator=g), torch.randn(2, 4, 8, generator=g))
    return (out - x.flip(0)).pow(2).mean()


def _engine(model, **options) -> OffloadEngine:
    policy = OffloadPolicy(device="cpu", compute_dtype=torch.float32, zero_copy=False, optim=OPTIM, **options)
    return OffloadEngine(model, model.blocks, policy)


def _store(engine, folder, budget=0, anonymous=True) -> SpilledCheckpoints:
    """The engine's checkpoint store replaced by a spill store that takes every block input."""
    engine.checkpoints.close()
    engine.checkpoints = SpilledCheckpoints(str(folder), budget, engine.device, min_bytes=0, anonymous=anonymous)
    return engine.checkpoints


def _run(engine, steps=3):
    return [engine.train_step(lambda m, s=step: _loss(m, s)) for step in range(steps)]


def _bitwise(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


BLOCK = 2 * 384 * 32 * 4  # bytes of one block's input grid


@pytest.mark.parametrize("tile, budget", [(None, 0), (None, 2 * BLOCK + 1000), (2, 0)])
def test_spilled_checkpoints_are_bitwise_host_checkpoints(tmp_path, tile, budget):
    """Every block input to disk (budget 0), the oldest only (a budget holding about two), tiled."""
    model = _model()
    reference = _engine(copy.deepcopy(model), tile=tile)
    engine = _engine(model, tile=tile)
    store = _store(engine, tmp_path, budget)
    assert _run(engine) == _run(reference)
    _bitwise(engine.model_state_dict(), reference.model_state_dict())
    assert store.bytes_written > 0 and 0 < store.bytes_read <= store.bytes_written  # a block still in flight: from memory
    if budget:  # the two newest blocks of 3 stayed in memory: one block a step went to disk
        assert store.bytes_written < 3 * 2 * BLOCK
    engine.close()
    reference.close()


def test_the_disk_queues_hold_one_block(tmp_path):
    """Beside the block in use the store holds one block being written (forward) and one read ahead
    (backward), not more, and the results stay bitwise those of host checkpoints."""
    model = _model()
    reference = _engine(copy.deepcopy(model), tile=2)
    engine = _engine(model, tile=2)
    store = _store(engine, tmp_path)
    assert _run(engine) == _run(reference)
    _bitwise(engine.model_state_dict(), reference.model_state_dict())
    # block 0's entry also holds the conditioning every block shares (a few KiB): one entry, not two
    assert BLOCK <= store.reading.peak < 2 * BLOCK and BLOCK <= store.writing.peak < 2 * BLOCK
    assert store.reading.value == store.writing.value == 0
    engine.close()
    reference.close()


def test_the_policy_spills_through_the_engine(tmp_path):
    """offload.spill_dir through OffloadPolicy (the store the trainer gets), and nothing left behind."""
    model = _model()
    reference = _engine(copy.deepcopy(model))
    engine = _engine(model, spill_dir=str(tmp_path), spill_after=0)
    assert isinstance(engine.checkpoints, SpilledCheckpoints)
    assert _run(engine, 2) == _run(reference, 2)
    _bitwise(engine.model_state_dict(), reference.model_state_dict())
    assert engine.checkpoints.bytes_written > 0
    engine.close()
    reference.close()
    assert os.listdir(tmp_path) == []


def test_named_spill_files_go_on_success_and_on_an_exception(tmp_path):
    """Where O_TMPFILE is missing the file has a name: gone at close, after a failed step, and
    when the engine is never closed (the process exits)."""
    model = _model()
    engine = _engine(model)
    store = _store(engine, tmp_path, anonymous=False)
    (name,) = os.listdir(tmp_path)
    assert name.startswith(f"slidefusion-spill-{os.getpid()}-")
    _run(engine, 1)

    def broken(m):
        _loss(m, 0)  # the forward spills every block, then the loss fails
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        engine.train_step(broken)
    assert os.path.getsize(tmp_path / name) == 0 and store.entries == []  # the step's bytes freed
    engine.close()
    assert os.listdir(tmp_path) == []
    script = f"""
        from slidefusion.offload.tiling.spill import SpillFile
        spill = SpillFile({str(tmp_path)!r}, anonymous=False)
        raise SystemExit(1 if len(__import__("os").listdir({str(tmp_path)!r})) != 1 else 0)
    """
    assert subprocess.run([sys.executable, "-c", textwrap.dedent(script)]).returncode == 0
    assert os.listdir(tmp_path) == []


def test_stale_spill_files_of_a_killed_run_go_at_the_next_start(tmp_path):
    """Only dead owners' files: a live run's file, other names and symlinks stay."""
    script = f"""
        import os, signal, sys, torch
        from slidefusion.offload.tiling.spill import SpillFile
        spill = SpillFile({str(tmp_path)!r}, anonymous=False)
        spill.reserve(1 << 20)
        spill.write(0, torch.ones(1000))
        print(os.path.basename(spill.path), flush=True)
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.stdin.read()  # alive until told
    """
    live = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), "live"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        alive = live.stdout.readline().strip()  # started first: its own start cleans nothing of the next
        killed = subprocess.run([sys.executable, "-c", textwrap.dedent(script), "kill"], capture_output=True, text=True)
        assert killed.returncode == -signal.SIGKILL
        stale = killed.stdout.strip()
        (tmp_path / "slidefusion-spill-1-0123456789abcdef.txt").write_text("not ours")
        os.symlink(tmp_path / alive, tmp_path / "slidefusion-spill-2-0123456789abcdef.tmp")
        assert {stale, alive} <= set(os.listdir(tmp_path))
        spill = SpillFile(str(tmp_path))
        assert spill.removed == [stale]
        assert stale not in os.listdir(tmp_path) and alive in os.listdir(tmp_path)
        assert len(os.listdir(tmp_path)) == 3
        spill.close()
    finally:
        live.communicate("", timeout=60)
    assert alive not in os.listdir(tmp_path)


def test_a_full_disk_is_one_line_before_the_step(tmp_path):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = _engine(model, spill_dir=str(tmp_path), spill_reserve=10**18)  # an exabyte: no disk has it
    with pytest.raises(UserError) as error:
        engine.train_step(lambda m: _loss(m, 0))
    message = str(error.value)
    assert "\n" not in message and "offload.spill_dir=" in message and "GB free but a step spills" in message
    assert engine.step == 0
    _bitwise(engine.model_state_dict(), before)
    engine.close()
    assert os.listdir(tmp_path) == []


def test_a_failed_write_stops_the_forward_before_any_update(tmp_path):
    """A write that fails anyway (an I/O error past the reservation) stops at the next block."""
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = _engine(model)
    store = _store(engine, tmp_path)
    store.write_behind = 1  # each block waits for the write before it: the failure is seen at once

    def failing(offset, tensor):
        raise OSError(28, "No space left on device")

    store.file.write = failing
    with pytest.raises(UserError, match=r"writing checkpoints failed \(No space left on device\); the step stopped"):
        engine.train_step(lambda m: _loss(m, 0))
    _bitwise(engine.model_state_dict(), before)
    engine.close()


def test_an_unusable_spill_folder_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"offload.spill_dir='.*missing' is not an existing folder"):
        SpillFile(str(tmp_path / "missing"))
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        refused = _read_only(folder)
        with pytest.raises(UserError, match=r"offload.spill_dir='.*' is not writable \(.*\); choose a writable folder"):
            SpillFile(refused)
    finally:
        folder.chmod(0o755)
    assert os.listdir(folder) == []


def _read_only(folder) -> str:
    """`folder` (mode 0555), or where root ignores modes a folder the kernel refuses to write (/sys)."""
    if os.geteuid() != 0:
        return str(folder)
    if not os.path.isdir("/sys") or os.access("/sys", os.W_OK) and _writable("/sys"):
        pytest.skip("running as root with no read-only folder to try")
    return "/sys"


def _writable(folder: str) -> bool:
    try:
        SpillFile(folder).close()
        return True
    except UserError:
        return False
