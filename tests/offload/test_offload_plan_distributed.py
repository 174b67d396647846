"""The multi-GPU planner (`slidefusion plan ... --gpus N --nodes M`): per-GPU memory, per-node host
bytes, and the collectives' terms of the step time."""

import pytest

from slidefusion.cli import main
from slidefusion.core.errors import UserError
from slidefusion.offload.plan.distributed import Cluster, plan_cluster
from slidefusion.offload.plan.model_shape import model_shape
from slidefusion.offload.plan.planner import Machine, grid_for, plan_policy
from slidefusion.offload.policy import OffloadPolicy
from slidefusion.offload.tiling.activations import Workload

POLICY = OffloadPolicy(compute_dtype="bfloat16")
MACHINE = Machine(gpu_memory=141e9, host_memory=1.5e12, pcie_bytes_s=55e9, tflops=990.0)


def _work(shape, frames=81):
    grid = grid_for(frames, 480, 832, shape.patch, (4, 8, 8))
    return Workload(1, grid[0] * grid[1] * grid[2], "flash", frames=grid[0])


def _plan(gpus, nodes=1, **options):
    shape = model_shape("wan2.1-14b")
    return shape, plan_cluster(shape, _work(shape), Cluster(gpus, nodes, **options), POLICY, MACHINE)


def test_node_host_bytes_do_not_grow_with_the_ranks_of_a_node_sharing_one_copy():
    shape, two = _plan(2)
    _, eight = _plan(8)
    state = lambda p: sum(v for k, v in p.node_host.items() if "staging" not in k)  # noqa: E731
    assert state(two) == pytest.approx(state(eight), rel=1e-6)  # one compute copy + one master/moments set
    assert any("x1 (shared)" in k for k in eight.node_host)
    _, replicated = _plan(8, shared=False)
    assert state(replicated) - state(eight) == pytest.approx(7 * shape.params * 2, rel=1e-6)


def test_one_gpu_is_the_one_gpu_plan_and_has_no_collectives():
    shape, one = _plan(1)
    alone = plan_policy(shape, _work(shape), POLICY, MACHINE)
    assert one.gpu.device == alone.device
    assert one.terms["reduce-scatter"] == 0 and one.terms["all-gather"] == 0


def test_collective_terms():
    shape, eight = _plan(8, interconnect=100e9)
    assert eight.terms["reduce-scatter"] == pytest.approx(7 / 8 * shape.params * 2 / 100e9)
    assert eight.terms["all-gather"] == 0  # one node: the shards meet in the shared host copy
    _, two_nodes = _plan(8, 2, interconnect=50e9)
    assert two_nodes.terms["all-gather"] == pytest.approx(shape.params / 16 * 2 / 50e9)  # the other node's shards
    assert two_nodes.step_s >= max(two_nodes.terms.values())
    assert eight.terms["host AdamW (shard)"] == pytest.approx(_plan(1)[1].terms["host AdamW (shard)"] / 8)


def test_sequence_parallel_cuts_each_gpu_s_tokens():
    _, dp = _plan(8)
    _, sp = _plan(8, sp=4)
    assert sp.gpu.device_bytes < dp.gpu.device_bytes and sp.global_batch == dp.global_batch // 4
    with pytest.raises(UserError, match="--sp 3 does not divide the 8 GPUs"):
        Cluster(8, sp=3)


def test_plan_command_for_eight_gpus(capsys):
    assert main(["plan", "--model", "wan2.1-14b", "--frames", "81", "--height", "480", "--width", "832", "--gpus", "8"]) == 0
    out = capsys.readouterr().out
    for part in ("8 data parallel x 1 sequence parallel", "per GPU:", "per node host:", "compute copy x1 (shared)",
                 "reduce-scatter", "all-gather", "verdict: fits"):
        assert part in out, part


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "8", "--sp", "3"], "--sp 3 does not divide the 8 GPUs"),
    (["--gpus", "8", "--sp", "64"], "--sp 64 is more than the 40 attention heads"),
    (["--nodes", "2"], "add --gpus N"),
])
def test_plan_bad_cluster_is_one_line(argv, message, capsys):
    code = main(["plan", "--model", "wan2.1-14b", "--frames", "81", "--height", "480", "--width", "832", *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and message in err, err
