"""The ring schedules' simulator program and the cost model behind `--parallel auto` / `--slices auto`,
on synthetic numbers (no timing), and the full-3D scenario's ring and USP rows."""

import dataclasses

import pytest

from slidefusion.parallel import cost
from slidefusion.parallel.cost import Candidate, Measured
from slidefusion.parallel.simulate import HARDWARE, FullCosts, Link, full_program, run
from slidefusion.parallel.simulate_full import full_scenario
from slidefusion.parallel.simulate_ring import P2P, UspCosts, calls, simulate_usp, usp_program


def usp(ulysses=4, ring=1, **overrides):
    link = Link(ulysses, ulysses, 1e9, 1e9, 1e-5)
    base = dict(blocks=3, ulysses=ulysses, ring=ring, qkv_s=0.2, attn_s=1.0, out_s=0.1, rest_s=0.5,
                qkv_peer_bytes=3e6, out_peer_bytes=1e6, block_bytes=2e6, gather_peer_bytes=1e3, ulysses_link=link,
                ring_link=P2P(1e-5, 1e9), gather_link=Link(4, 4, 1e9, 1e9, 1e-5))
    return UspCosts(**{**base, **overrides})


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_one_ring_is_sliced_ulysses(n):
    """R = 1 issues what `ulysses_attention` issues: the same step as the sliced-Ulysses program."""
    full = FullCosts(3, 0.2, 1.0, 0.1, 0.5, 3e6, 1e6, 1e3, Link(4, 4, 1e9, 1e9, 1e-5))
    assert simulate_usp(usp(), n).step_s == pytest.approx(run(full_program(full, n)).step_s, rel=1e-12)


@pytest.mark.parametrize("ulysses, ring, n", [(1, 4, 1), (1, 4, 3), (2, 2, 2), (4, 1, 4), (1, 2, 8)])
def test_program_does_all_the_work_once(ulysses, ring, n):
    c = usp(ulysses, ring, slice_overhead_s=1e-3)
    ops = usp_program(c, n)
    compute = sum(op.seconds for op in ops if op.resource == "compute")
    over = calls(n, ring) * 1e-3 if n > 1 else 0.0
    assert compute == pytest.approx(3 * (0.2 + 1.0 + 0.1 + 0.5 + over))
    hops = [op for op in ops if op.name.startswith("ring ")]
    assert len(hops) == 3 * (ring - 1) * n  # R - 1 hops of every chunk, every block
    assert sum(op.seconds for op in hops) == pytest.approx(3 * (ring - 1) * (n * 1e-5 + 2e6 / 1e9))
    trades = [op for op in ops if op.name.startswith("a2a")]
    assert len(trades) == (0 if ulysses == 1 else 3 * 2 * n)


def test_ring_hides_its_hops_under_the_attention_of_the_block_before():
    fast, slow = usp(1, 4, block_bytes=1e6), usp(1, 4, block_bytes=1e9)  # a hop of 1 ms or 1 s against 0.25 s tiles
    assert simulate_usp(fast, 1).exposed_comm_s < 0.01
    assert simulate_usp(slow, 1).exposed_comm_s > 3 * 3 * 0.5


def measured(**overrides) -> Measured:
    """Two ranks, Wan's tiny benchmark row (12 heads x 16), 8192 tokens, one sample, a 0.5 Gb/s link."""
    base = dict(ranks=2, heads=12, tokens=8192, batch=1, width=192, out_values=64, blocks=4, qkv_s=0.004,
                out_s=0.0015, rest_s=0.03, attn_unit_s=4e-10, latency_s=2e-4, Bps=0.5e9 / 8, call_s=0.0)
    return Measured(**{**base, **overrides})


def best(m: Measured, options=None) -> Candidate:
    return cost.rank(m, options or cost.candidates(m.ranks, m.heads, True))[0][1]


def test_a_fixed_cost_per_call_makes_many_slices_lose():
    free = best(measured(), cost.candidates(2, 12, True, degrees=[(2, 1)]))
    assert free.slices > 1  # a slow link and no cost per call: slicing hides the exchange
    chosen = [best(measured(call_s=s), cost.candidates(2, 12, True, degrees=[(2, 1)])).slices
              for s in (0.0, 1e-4, 1e-3, 1e-2, 1e-1)]
    assert chosen == sorted(chosen, reverse=True) and chosen[-1] == 1, chosen  # never more slices as calls cost more


def test_the_slice_counts_are_bounded_by_the_probe_and_timed():
    assert max(c.slices for c in cost.candidates(16, 40, True)) == max(cost.SLICES) == 2 * 4
    ranked = cost.rank(measured(), cost.candidates(2, 12, True))
    short = cost.shortlist(ranked, Candidate(2, 1, 1))
    assert short[0] == Candidate(2, 1, 1) and len(short) == 1 + cost.SHORTLIST
    assert short[1:] == [c for _, c in ranked if c != Candidate(2, 1, 1)][:cost.SHORTLIST]


def test_pick_keeps_plain_ulysses_unless_beaten_by_more_than_the_margin():
    plain, sliced, ring = Candidate(2, 1, 1), Candidate(2, 1, 4), Candidate(1, 2, 1)
    assert cost.pick({plain: 1.0, sliced: 0.995, ring: 1.2}, plain) == plain  # within the timing noise
    assert cost.pick({plain: 1.0, sliced: 0.95, ring: 0.97}, plain) == sliced
    assert cost.pick({plain: 1.0, sliced: 1.05}, plain) == plain  # never slower than plain Ulysses
    assert cost.pick({ring: 1.0, Candidate(1, 2, 2): 0.9}, None) == Candidate(1, 2, 2)


def test_the_candidates_follow_the_heads_and_the_operator():
    assert {(c.ulysses, c.ring) for c in cost.candidates(4, 2, True)} == {(2, 2), (1, 4)}  # 4 ranks > 2 heads
    assert cost.candidates(4, 5, False) == [Candidate(4, 1, 1)]  # a window operator: plain Ulysses only
    assert cost.candidates(3, 5, False, degrees=[(1, 3)]) == []


def test_uneven_heads_favour_the_ring_on_a_free_link():
    m = measured(ranks=4, heads=5, Bps=1e15, latency_s=0.0)
    ulysses = cost.predict(m, Candidate(4, 1, 1))  # ceil(5 / 4) = 2 heads over every query
    ring = cost.predict(m, Candidate(1, 4, 1))  # 5 heads over a quarter of the queries: 1.25
    assert ring < 0.8 * ulysses
    assert best(m).schedule == "ring"


def test_slow_link_prefers_the_ring_when_attention_hides_its_hops():
    """A ring moves keys and values once per hop, hidden under a block's attention; Ulysses' exchange
    waits in front of it: with a heavy attention and a slow link the model ranks a ring first."""
    m = measured(attn_unit_s=4e-9, Bps=0.2e9 / 8)
    plain = cost.predict(m, Candidate(2, 1, 1))
    top = best(m)
    assert top.ring == 2 and cost.predict(m, top) < 0.9 * plain


@pytest.mark.parametrize("inter", [50e9, 400e9])
def test_usp_beats_ulysses_across_nodes_and_ties_inside_one(inter):
    hw = dataclasses.replace(HARDWARE["h100"], inter_Bps_per_node=inter)
    rows = {(r["gpus"], r["cfg_parallel"]): r for r in full_scenario("hunyuanvideo-720p", hw)["rows"]}
    one_node, two, four = rows[8, False], rows[16, False], rows[32, False]
    assert abs(one_node["usp"]["step_s"] / one_node["sliced"]["step_s"] - 1) < 0.02  # nothing to gain in a node
    assert two["best"] == "usp" and two["usp_vs_sliced_ulysses"] > 1.2 and two["usp"]["ulysses"] == 8
    assert four["skipped"] == "32 ranks > 24 heads" and four["best"] == "usp"  # Ulysses stops at the heads
    wan = {(r["gpus"], r["cfg_parallel"]): r for r in full_scenario("wan2.1-14b-720p", hw)["rows"]}
    assert wan[16, False]["best"] == "usp" and wan[16, False]["usp_vs_sliced_ulysses"] > 1.1


@pytest.mark.parametrize("tokens, ulysses, ring, slices", [(75, 2, 2, 3), (6, 1, 4, 4), (45, 3, 1, 2), (7, 2, 3, 2)])
def test_every_rank_meets_every_key_once(tokens, ulysses, ring, slices):
    """Hash-coded positions through the ring's layout: each rank's own tokens, chunked, traded inside its
    Ulysses group and then met on every ring hop cover every token exactly once, in uneven splits and
    with empty chunks."""
    from slidefusion.parallel.layout import Split
    from slidefusion.parallel.ring import RingLayout

    layout = RingLayout(Split(tokens, ulysses * ring), ulysses, slices)
    position = list(range(tokens))  # token i is coded by its own index

    def chunk(p, k):
        start = sum(layout.chunk(p, j) for j in range(k)) + Split(tokens, ulysses * ring).start(p)
        return position[start:start + layout.chunk(p, k)]

    for p in range(ulysses * ring):
        r = p // ulysses
        seen = []
        for h in range(ring):  # hop 0 is the local block
            for k in range(slices):
                block = [t for u in range(ulysses) for t in chunk(((r - h) % ring) * ulysses + u, k)]
                assert len(block) == layout.block((r - h) % ring, k)
                seen += block
        assert sorted(seen) == position  # every key once
        mine = [t for k in range(slices) for t in chunk(p, k)]
        assert mine == position[Split(tokens, ulysses * ring).start(p):][:len(mine)]  # queries stay in place


def test_gpu_script_parses_and_dry_runs(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = root / "benchmarks" / "gpu" / "parallel.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable}
    dry = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert dry.returncode == 0 and "parallel_streams.py" in dry.stdout and "skipped" in dry.stdout, dry.stderr
    plan = subprocess.run([sys.executable, str(root / "benchmarks" / "gpu" / "parallel_streams.py"), "--dry-run"],
                          capture_output=True, text=True, timeout=120)
    assert plan.returncode == 0 and "would check the ring merge" in plan.stdout, plan.stderr


def test_plans_refuse_what_the_ring_cannot_split():
    from slidefusion.core.errors import UserError
    from slidefusion.models import build_model, preset
    from slidefusion.parallel import ParallelConfig
    from slidefusion.parallel.plan import SCHEDULES, check_fit, plan_for

    window = build_model(preset("dit3d-tiny", attention="window"))
    with pytest.raises(UserError, match="a mask that ring cannot split; valid: ulysses"):
        plan_for(window, SCHEDULES["usp"], 2)
    with pytest.raises(UserError, match="3 ranks > 2 heads \\(Ulysses cannot\\)"):
        plan_for(window, SCHEDULES["auto"], 3)
    with pytest.raises(UserError, match="ulysses --slices 2 cuts softmax attention into key chunks"):
        check_fit(window, ParallelConfig("ulysses", 2), 2)  # it would compute dense attention: a wrong result
    assert not plan_for(window, SCHEDULES["auto"], 2).dense  # auto may still run it as plain Ulysses
    dense = build_model(preset("dit3d-tiny"))
    assert plan_for(dense, SCHEDULES["ring"], 4).heads == 2  # past the head count
    with pytest.raises(UserError, match="--ulysses 4 splits attention heads: 4 > 2 heads"):
        check_fit(dense, ParallelConfig("usp", ulysses=4), 4)
    with pytest.raises(UserError, match="--ulysses 2 x --ring 2 = 4 must equal the ranks per sequence group \\(2\\)"):
        check_fit(dense, ParallelConfig("usp", ulysses=2, ring=2, cfg_parallel=True), 4)  # CFG halves: 2 ranks each
