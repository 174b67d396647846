"""The simulator's calibration against the ScaleFusion paper, and its full-3D (sliced Ulysses) case."""

import dataclasses

import pytest

from slidefusion.parallel.simulate import HARDWARE, FullCosts, Link, calibration_steps, full_program, run, simulate
from slidefusion.parallel.simulate_full import XDIT_HUNYUAN_H100, full_costs, full_scenario, FULL_MODELS, xdit_check


def within(value, target, tolerance=0.2):
    return abs(value - target) <= tolerance * target


def test_documented_p4d_profile_reproduces_the_paper_and_the_first_one_does_not():
    steps = {row["assumption"].split(":")[0]: row for row in calibration_steps()}
    first, p4d = steps["first profile"], steps["documented P4d profile"]
    assert abs(first["dsp_comm_share_2_nodes"] - 0.436) < 0.005  # the 43.6%
    assert within(p4d["dsp_comm_share_2_nodes"], 0.34) and within(p4d["scalefusion_vs_dsp_2_nodes"], 1.36)
    assert within(p4d["scaling_1_to_4_nodes"], 3.6)
    assert not within(first["scaling_1_to_4_nodes"], 3.6)  # 2.38x: the per-step gather of hidden tokens caps it
    slow = steps["104 TFLOP/s, hidden tokens gathered"]
    assert within(slow["dsp_comm_share_2_nodes"], 0.34, 0.02) and not within(slow["scaling_1_to_4_nodes"], 3.6)


def costs(**overrides):
    base = dict(blocks=3, qkv_s=0.2, attn_s=1.0, out_s=0.1, rest_s=0.5, qkv_peer_bytes=3e6, out_peer_bytes=1e6,
                gather_peer_bytes=1e3, link=Link(4, 4, 1e9, 1e9, 1e-5), slice_overhead_s=0.0)
    return FullCosts(**{**base, **overrides})


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_sliced_program_does_all_the_work_once(n):
    ops = full_program(costs(), n)
    compute = sum(op.seconds for op in ops if op.resource == "compute")
    assert abs(compute - 3 * (0.2 + 1.0 + 0.1 + 0.5)) < 1e-9
    link = sum(op.seconds for op in ops if op.resource == "link")
    per_chunk = 3 * n * 2 * 1e-5  # latency per exchange chunk, q/k/v and output
    assert abs(link - (3 * 3 * (3e6 + 1e6) / 1e9 + per_chunk + 1e-5 + 3 * 1e3 / 1e9)) < 1e-9


def test_slicing_hides_the_exchange_under_attention():
    c = costs()
    plain, sliced = simulate("ulysses", c, 1), simulate("ulysses", c, 4)
    assert abs(plain.step_s - plain.compute_s - plain.exposed_comm_s) < 1e-12
    assert plain.exposed_comm_s > 0.03 and sliced.exposed_comm_s < 0.25 * plain.exposed_comm_s
    free = costs(qkv_peer_bytes=0, out_peer_bytes=0, gather_peer_bytes=0, link=Link(4, 4, 1e9, 1e9, 0.0))
    assert abs(simulate("ulysses", free, 4).step_s - simulate("ulysses", free, 1).step_s) < 1e-9


@pytest.mark.parametrize("name", list(FULL_MODELS))
def test_sliced_ulysses_hides_80_percent_on_two_nodes(name):
    for inter in (50e9, 400e9):  # P4d's 400 Gb/s and P5's 3200 Gb/s per node
        hw = dataclasses.replace(HARDWARE["h100"], inter_Bps_per_node=inter)
        two = next(r for r in full_scenario(name, hw)["rows"] if r["gpus"] == 16 and not r["cfg_parallel"])
        assert two["ulysses"]["exposed_comm_s"] > 0.05 and two["hidden_share"] >= 0.8, two


def test_hunyuan_on_32_ranks_is_not_ulysses_and_the_xdit_fit_predicts_the_middle_points():
    rows = full_scenario("hunyuanvideo-720p", HARDWARE["h100"])["rows"]
    assert next(r for r in rows if r["gpus"] == 32)["skipped"] == "32 ranks > 24 heads"
    fit = xdit_check()
    for gpus in (1, 8):  # fitted
        assert abs(fit["predicted_s"][gpus] - XDIT_HUNYUAN_H100[gpus]) < 1.0
    for gpus in (2, 4):  # predicted: within 12% of the published times
        assert within(fit["predicted_s"][gpus], XDIT_HUNYUAN_H100[gpus], 0.12)
    assert 200e12 < fit["rate_flops"] < 600e12 and 0 < fit["serial_s"] < 300


def test_full_costs_follow_the_head_split():
    dims = FULL_MODELS["wan2.1-14b-720p"]
    c8, c16 = full_costs(dims, HARDWARE["h100"], 8, 8), full_costs(dims, HARDWARE["h100"], 16, 8)
    assert c16.attn_s / c8.attn_s == pytest.approx(3 / 5)  # ceil(40/16) = 3 heads against 5: uneven
    assert run(full_program(c8, 1)).step_s > 0
