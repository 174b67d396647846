"""Training on several gloo ranks equals one process with the same global batch.

One spawned group of 2 ranks and one of 4 run every case (starting ranks is the slow part); the
single-process references run here. Every run is fp32 unless it says lean, on our tiny DiT3D,
3 steps of a global batch of 4 (4 ranks x 1, 2 x 2, or one process x 4):
  resident data parallel, FSDP2, the offload engine with host state sharded (copy threads and a
  resident block; lean state: bf16 master, 8-bit moments; one host copy per rank), sequence
  parallel (Ulysses, the offload engine), data x sequence parallel on 4 ranks, LoRA on a tiny Wan
  folder, resume of a 2-rank checkpoint on 4 ranks and on 1;
  a sequence-parallel loss and every gradient of our DiT3D and of diffusers' Wan;
  host bytes per node: one shared compute copy and one set of master and moments, for 2 ranks as for 4;
  bad input: one line from rank 0, exit 2, on every rank; a rank that dies ends the other in time.
AdamW's eps is 1e-3 here: with torch's 1e-8 a weight whose true gradient is zero moves by a whole
learning rate on reduction-order noise, which no tolerance could tell from a bug.
"""

import shutil
import time

import pytest
import torch
from distributed_helpers import GLOBAL, LOOSE_CLIP, engine_run, folder_overrides, overrides, sp_case, train

from slidefusion.parallel import ParallelError, spawn


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_wan_dir):
    root = tmp_path_factory.mktemp("distributed")
    from distributed_helpers import four_ranks, two_ranks

    two = spawn(two_ranks, 2, str(root), str(tiny_wan_dir), timeout_s=120, job_timeout_s=900)
    checkpoint = root / "offload" / "checkpoint-2"
    copy = root / "from-two"
    shutil.copytree(checkpoint, copy)
    four = spawn(four_ranks, 4, str(root), str(copy), timeout_s=120, job_timeout_s=900)
    one = {"ref": train(overrides(root, "ref", GLOBAL)),
           "lean": train(overrides(root, "reflean", GLOBAL, "offload.enabled=true", "offload.master=bf16",
                                   "offload.moments=int8", LOOSE_CLIP)),
           "lora": train(folder_overrides(tiny_wan_dir, root, "reflora", 2), "configs/wan-finetune.yaml")}
    from distributed_helpers import resume

    one["resumed"] = resume(overrides(root, "resumed1", GLOBAL, "offload.enabled=true", LOOSE_CLIP), copy)
    one["copying"] = engine_run(0, 1)
    one["tiled"] = engine_run(0, 1, tile=1, zero_copy=True, resident_blocks=0)
    return {"two": two, "four": four, "one": one}


def _close(a: dict, b: dict, atol: float = 1e-6) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name].float(), b[name].float(), rtol=1e-5, atol=atol), (name, (a[name] - b[name]).abs().max())


def _same_run(run: dict, ref: dict) -> None:
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-5)
    _close(run["weights"], ref["weights"])


@pytest.mark.parametrize("case", ["resident", "fsdp", "offload", "replicated", "sp"])
def test_two_ranks_equal_one_process(runs, case):
    for rank in runs["two"]:
        _same_run(rank[case], runs["one"]["ref"])


@pytest.mark.parametrize("case", ["copying", "tiled"])
def test_the_engine_itself_equals_one_process(runs, case):
    """copying: a CPU device with copy threads, as a GPU's (reduce-scatter, then the shard's copy to
    the host); tiled: every block run tile by tile, one frame per tile."""
    ranks, ref = [rank[case] for rank in runs["two"]], runs["one"][case]
    mean = [sum(losses) / len(losses) for losses in zip(*(r["losses"] for r in ranks))]  # each rank: its rows' loss
    assert mean == pytest.approx(ref["losses"], rel=1e-5)
    for run in ranks:
        _close(run["weights"], ref["weights"])


def test_two_nodes_of_two_ranks_equal_one_process(runs):
    """4 ranks as 2 nodes of 2 (LOCAL_WORLD_SIZE 2): a /dev/shm copy per node, the other node's
    shards all-gathered into it after each update."""
    ranks, ref = [rank["two_nodes"] for rank in runs["four"]], runs["one"]["copying"]
    for run in ranks:
        _close(run["weights"], ref["weights"])


@pytest.mark.parametrize("case", ["offload", "dp_sp"])
def test_four_ranks_equal_one_process(runs, case):
    for rank in runs["four"]:
        _same_run(rank[case], runs["one"]["ref"])


def test_lean_state_equals_the_lean_single_process_run(runs):
    """bf16 master and 8-bit moments: the ranks round each element as one process would (the random
    streams hash the element's place in its group, 8-bit blocks stay whole), so the weights are
    bitwise the same but where the gradient's reduction order moved a value across a rounding
    boundary: weights near zero (zero-initialised biases, whose bf16 steps are tiny), and a few
    others by one bf16 step."""
    ref = runs["one"]["lean"]
    for rank in runs["two"]:
        run = rank["lean"]
        assert run["losses"] == pytest.approx(ref["losses"], rel=1e-4)
        large = {k: v.abs() >= 1e-3 for k, v in ref["weights"].items()}
        same = sum(int((torch.eq(run["weights"][k], ref["weights"][k]) & large[k]).sum()) for k in large)
        total = sum(int(m.sum()) for m in large.values())
        assert same >= 0.99 * total, (same, total)
        for name, value in ref["weights"].items():
            assert torch.allclose(run["weights"][name].float(), value.float(), rtol=2 ** -7, atol=1e-6), name


def test_lora_on_a_wan_folder_equals_one_process(runs):
    ref = runs["one"]["lora"]
    assert all(k.count("lora") for k in ref["weights"])
    for rank in runs["two"]:
        _same_run(rank["lora"], ref)


@pytest.mark.parametrize("name", ["dit3d", "wan"])
def test_sequence_parallel_loss_and_every_gradient_equal_one_process(runs, name):
    model, loss_fn = sp_case(name)
    loss = loss_fn(model)
    loss.backward()
    for rank in runs["two"]:
        got = rank["sp_grads"][name]
        assert got["loss"] == pytest.approx(loss.item(), rel=1e-6)
        for key, param in model.named_parameters():
            want = param.grad if param.grad is not None else torch.zeros_like(param)
            assert torch.allclose(got["grads"][key], want, rtol=1e-4, atol=1e-7), key


def test_resume_from_two_ranks_on_one_and_on_four(runs):
    ref = runs["one"]["ref"]
    for run in (runs["one"]["resumed"], *(rank["resumed"] for rank in runs["four"])):
        assert run["losses"] == pytest.approx(ref["losses"][2:], rel=1e-5)
        _close(run["weights"], ref["weights"])


def test_one_host_copy_per_node_whatever_the_ranks(runs):
    """Per node: the compute copy once and one set of master weights and moments, for 2 ranks as for 4;
    each rank holds its share. One copy per rank would hold the compute copy twice."""
    two = [rank["offload"]["stats"] for rank in runs["two"]]
    four = [rank["offload"]["stats"] for rank in runs["four"]]
    replicated = runs["two"][0]["replicated"]["stats"]
    assert two[0]["host_bytes_node"] == four[0]["host_bytes_node"]
    assert sum(s["host_bytes_rank"] for s in two) == sum(s["host_bytes_rank"] for s in four)
    assert max(s["host_bytes_rank"] for s in four) < 0.6 * max(s["host_bytes_rank"] for s in two)
    compute = replicated["host_bytes_rank"] - two[0]["host_bytes_rank"]  # what a rank's private copy adds
    assert compute > 0 and replicated["host_bytes_node"] >= two[0]["host_bytes_node"] + compute
    print("host bytes per node:", {"2 ranks, shared": two[0]["host_bytes_node"], "4 ranks, shared": four[0]["host_bytes_node"],
                                   "2 ranks, one copy each": replicated["host_bytes_node"]},
          "per rank:", [s["host_bytes_rank"] for s in two], [s["host_bytes_rank"] for s in four])


EXPECTED = {"sp does not divide": "parallel.sp=3 does not divide the world of 2 ranks",
            "sp > heads": "parallel.sp=2: ulysses splits attention heads over ranks: 2 ranks > 1 heads",
            "configs differ": "rank 1 differs from rank 0 at run.seed (0 on rank 0, 1 there)",
            "fsdp with offload": "parallel.fsdp=true shards resident training; --offload",
            "sp with tiles": "parallel.sp=2 with offload.tile=1: tiles inside a sequence-parallel block",
            "another model": "its model config differs from this run's"}


@pytest.mark.parametrize("case", list(EXPECTED))
def test_bad_input_is_one_line_from_rank_zero_and_exit_two(runs, case):
    (code0, err0), (code1, err1) = runs["two"][0]["bad"][case], runs["two"][1]["bad"][case]
    assert code0 == code1 == 2
    assert err0.count("\n") == 1 and err0.startswith("slidefusion train: error: ") and EXPECTED[case] in err0, err0
    assert err1 == "", err1


def test_a_rank_that_dies_ends_the_others_in_time_with_one_line(tmp_path):
    from distributed_helpers import dies_mid_run

    with pytest.raises(ParallelError) as info:  # parallel.timeout_s=5 in the run
        spawn(dies_mid_run, 2, str(tmp_path), str(tmp_path), timeout_s=60, job_timeout_s=240)
    after = time.time() - float((tmp_path / "died").read_text())
    assert "rank 0 died with exit code 3" in str(info.value) and "rank 1 died with exit code 3" in str(info.value)
    lines = (tmp_path / "rank0.err").read_text().splitlines()
    assert len(lines) == 1 and "rank 0: another rank failed or stopped answering" in lines[0], lines
    assert after < 30, after  # the 5 s timeout (a closed socket ends it sooner), and a busy machine's slack
