"""The simulator's full-3D case: Ulysses against sliced Ulysses for the models people serve.

Per rank and block (P ranks of a sequence group, n_r = B * ceil(N / P) video tokens, h_r =
ceil(heads / P) heads, D = C / heads, R = achieved FLOP/s):
  qkv   2 n_r 3C^2 / R           (+ the text tokens' projection where text joins the softmax)
  attn  4 B (N + L_joint)^2 h_r D / R
  out   2 n_r C^2 / R
  rest  2 n_r (mlp + cross q/out) C^2 / R + 4 n_r L C / R (cross-attention) + 4 B L C^2 / R (its text k/v)
Exchanges send this rank's tokens x 3C/P (q, k, v) and x C/P (output) values to each peer; the
step ends with a gather of the output module's patch values. Model sizes come from diffusers'
configs (WanTransformer3DModel and HunyuanVideoTransformer3DModel defaults, read in 0.42.1).
"""

import math
from dataclasses import asdict, dataclass, replace

from slidefusion.core.errors import choose
from slidefusion.parallel.simulate import HARDWARE, FullCosts, Hardware, Link, best_slices, simulate
from slidefusion.parallel.simulate_ring import P2P, UspCosts, simulate_usp, step_estimate


@dataclass(frozen=True)
class FullDims:
    name: str
    hidden: int
    heads: int
    blocks: int
    mlp_macs: float  # MLP multiply-adds per token, in units of C^2
    cross: bool  # cross-attention to text (Wan) rather than text in the self-attention (HunyuanVideo)
    text_len: int
    grid: tuple[int, int, int]  # video tokens T x H x W after the VAE and the patch
    batch: int  # 2 with classifier-free guidance (Wan), 1 guidance-distilled (HunyuanVideo)
    out_values: int = 64  # 16 latent channels x 1x2x2 patch
    steps: int = 50

    @property
    def tokens(self) -> int:
        return math.prod(self.grid)


FULL_MODELS = {
    # Wan 2.1 T2V 14B: 40 blocks, 40 heads x 128 = 5120, FFN 13824, umT5 text (512 tokens) by
    # cross-attention, QK RMSNorm across heads; 720p x 81 frames -> latents 21 x 90 x 160 -> 21 x 45 x 80.
    "wan2.1-14b-720p": FullDims("Wan 2.1 14B, 1280x720, 81 frames", 5120, 40, 40, 2 * 13824 / 5120, True, 512,
                                (21, 45, 80), 2),
    # HunyuanVideo 13B: 20 dual-stream + 40 single-stream blocks, 24 heads x 128 = 3072, MLP ratio 4,
    # LLaVA-Llama text (up to 256 tokens) joins the self-attention; 720p x 129 frames -> 33 x 45 x 80.
    "hunyuanvideo-720p": FullDims("HunyuanVideo 13B, 1280x720, 129 frames", 3072, 24, 60, 8.0, False, 256,
                                  (33, 45, 80), 1),
}

# xDiT's published HunyuanVideo times (1280x720, 129 frames, 50 steps, Ulysses, H100), seconds.
XDIT_HUNYUAN_H100 = {1: 1904.08, 2: 925.04, 4: 514.08, 8: 337.58}


def full_costs(dims: FullDims, hw: Hardware, ranks: int, per_node: int, batch: int | None = None) -> FullCosts:
    """One rank's per-block costs for `dims` under Ulysses on a group of `ranks` (per_node per node)."""
    b = dims.batch if batch is None else batch
    c, n = dims.hidden, dims.tokens
    local = b * math.ceil(n / ranks)
    mine, head_dim = math.ceil(dims.heads / ranks), c // dims.heads
    joint = 0 if dims.cross else dims.text_len
    text_dense = b * joint * 2 * (4 + dims.mlp_macs) * c * c  # text tokens in the block, on every rank
    cross = (2 * local * 2 * c * c + 4 * local * dims.text_len * c + 4 * b * dims.text_len * c * c) if dims.cross else 0
    link = Link(ranks, min(per_node, ranks), hw.intra_Bps, hw.inter_Bps_per_node / min(per_node, ranks),
                hw.latency_s if ranks > 1 else 0.0)
    values = hw.bytes_per_value
    return FullCosts(
        blocks=dims.blocks,
        qkv_s=(2 * local * 3 * c * c + text_dense * 3 / (4 + dims.mlp_macs)) / hw.flops,
        attn_s=4 * b * (n + joint) ** 2 * mine * head_dim / hw.flops,
        out_s=2 * local * c * c / hw.flops,
        rest_s=(2 * local * dims.mlp_macs * c * c + cross + text_dense * (1 + dims.mlp_macs) / (4 + dims.mlp_macs))
        / hw.flops,
        qkv_peer_bytes=local * 3 * c / ranks * values, out_peer_bytes=local * c / ranks * values,
        gather_peer_bytes=local * dims.out_values * values, link=link,
        slice_overhead_s=hw.slice_overhead_s, slowdown=hw.slowdown)


def usp_costs(dims: FullDims, hw: Hardware, ulysses: int, ring: int, per_node: int, batch: int | None = None) -> UspCosts:
    """One rank's per-block costs under Ulysses x Ring (U consecutive ranks per head all-to-all, R per
    ring). The per-token work is Ulysses' on the same tokens; the attention splits the queries over
    the ring (text tokens that join the softmax too: xDiT keeps them on every rank, a simplification
    here); a ring that spans nodes moves its blocks over the node's NICs while the head all-to-all
    stays on NVLink, so the two are separate links ("nic" and "link"). A ring steps in lockstep, so
    every hop takes as long as the one that crosses nodes."""
    b, ranks = dims.batch if batch is None else batch, ulysses * ring
    per_rank = full_costs(dims, hw, ranks, per_node, b)  # per-token work, gather
    c, values = dims.hidden, hw.bytes_per_value
    local, mine = b * math.ceil(dims.tokens / ranks), math.ceil(dims.heads / ulysses)
    seq = dims.tokens + (0 if dims.cross else dims.text_len)
    g = min(per_node, ulysses)
    ulysses_link = Link(ulysses, g, hw.intra_Bps, hw.inter_Bps_per_node / g, hw.latency_s)
    # A hop that leaves the node goes through the sending rank's own share of the node's NICs (one
    # NIC per GPU or two, rail-optimised), even when it is the only rank of its node crossing.
    hop = (P2P(hw.latency_s, hw.inter_Bps_per_node / per_node, "nic") if ranks > per_node
           else P2P(hw.latency_s, hw.intra_Bps, "link"))
    return UspCosts(
        blocks=dims.blocks, ulysses=ulysses, ring=ring, qkv_s=per_rank.qkv_s, out_s=per_rank.out_s,
        rest_s=per_rank.rest_s, attn_s=4 * b * seq * (seq / ring) * mine * (c // dims.heads) / hw.flops,
        qkv_peer_bytes=local * 3 * c / ulysses * values, out_peer_bytes=local * c / ulysses * values,
        block_bytes=2 * local * ulysses * mine * (c // dims.heads) * values,
        gather_peer_bytes=per_rank.gather_peer_bytes, ulysses_link=ulysses_link, ring_link=hop,
        gather_link=per_rank.link, slice_overhead_s=hw.slice_overhead_s, slowdown=hw.slowdown)


def _best_ring(dims: FullDims, hw: Hardware, ranks: int, per_node: int, batch: int, candidates) -> dict:
    """The fastest ring (U = 1) and the fastest USP (1 < U < ranks, U <= heads) over the slice counts."""
    out = {}
    for name, degrees in (("ring", [(1, ranks)]),
                          ("usp", [(u, ranks // u) for u in range(2, ranks) if ranks % u == 0 and u <= dims.heads])):
        options = [(step_estimate(costs, n), n, u, r, costs) for u, r in degrees
                   for costs in [usp_costs(dims, hw, u, r, per_node, batch)]
                   for n in [n for n in candidates if n * r <= 64] or [1]]  # R hops already pipeline R blocks
        if options:
            _, n, u, r, costs = min(options, key=lambda o: (round(o[0], 9), o[1], -o[2]))
            out[name] = {**asdict(simulate_usp(costs, n)), "ulysses": u, "ring": r, "slices": n}
    return out


def _row(dims: FullDims, hw: Hardware, gpus: int, per_node: int, cfg: bool, candidates) -> dict:
    ranks, batch = (gpus // 2, 1) if cfg else (gpus, dims.batch)
    row = {"gpus": gpus, "nodes": max(1, gpus // per_node), "cfg_parallel": cfg, "ranks_per_group": ranks}
    if ranks > 1:
        row.update(_best_ring(dims, hw, ranks, per_node, batch, candidates))
    if ranks > dims.heads:
        return {**row, "skipped": f"{ranks} ranks > {dims.heads} heads"}
    costs = full_costs(dims, hw, ranks, per_node, batch)
    plain = simulate("ulysses", costs, 1)
    n = best_slices("ulysses", costs, candidates) if ranks > 1 else 1
    sliced = simulate("ulysses", costs, n)
    hidden = 1 - sliced.exposed_comm_s / plain.exposed_comm_s if plain.exposed_comm_s > 0 else 1.0
    return {**row, "slices": n, "ulysses": asdict(plain), "sliced": asdict(sliced), "hidden_share": hidden,
            "speedup": plain.step_s / sliced.step_s}


def full_scenario(name: str, hw: Hardware, gpu_counts=(1, 2, 4, 8, 16, 32), per_node: int = 8,
                  candidates=(1, 2, 4, 8, 16)) -> dict:
    """Ulysses and sliced Ulysses on each GPU count (CFG-parallel too where the model uses CFG)."""
    choose(name, FULL_MODELS, "full-3D model")
    dims = FULL_MODELS[name]
    rows = []
    for gpus in gpu_counts:
        for cfg in (False, True) if dims.batch == 2 else (False,):
            if not cfg or gpus % 2 == 0:
                rows.append(_row(dims, hw, gpus, per_node, cfg, candidates))
    base = next(r for r in rows if r["gpus"] == 1)
    for row in rows:
        if "skipped" not in row:
            row["scaling_vs_1"] = base["ulysses"]["step_s"] / row["sliced"]["step_s"]
            row["ulysses_scaling_vs_1"] = base["ulysses"]["step_s"] / row["ulysses"]["step_s"]
        steps = {k: row[k]["step_s"] for k in ("sliced", "ring", "usp") if k in row}
        if steps:
            row["best"] = min(steps, key=steps.get)
            row["best_scaling_vs_1"] = base["ulysses"]["step_s"] / steps[row["best"]]
            if "usp" in row and "sliced" in row:
                row["usp_vs_sliced_ulysses"] = row["sliced"]["step_s"] / row["usp"]["step_s"]
    return {"model": asdict(dims), "hardware": asdict(hw), "rows": rows}


def xdit_check(hw: Hardware | None = None) -> dict:
    """Fit the achieved FLOP rate R and a serial time S (text encoders, VAE decode: work Ulysses does not
    split) to xDiT's 1- and 8-GPU HunyuanVideo times, then predict its 2- and 4-GPU times."""
    hw = hw or HARDWARE["h100"]
    dims = FULL_MODELS["hunyuanvideo-720p"]

    def total(rate, gpus, serial=0.0):
        return serial + dims.steps * simulate("ulysses", full_costs(dims, replace(hw, flops=rate), gpus, 8), 1).step_s

    low, high = 50e12, 2000e12
    for _ in range(60):  # bisection on R: S = T1 - model(1) must also give T8
        rate = (low + high) / 2
        serial = XDIT_HUNYUAN_H100[1] - total(rate, 1)
        gap = XDIT_HUNYUAN_H100[8] - total(rate, 8, serial)
        low, high = (rate, high) if gap > 0 else (low, rate)
    predicted = {g: total(rate, g, serial) for g in XDIT_HUNYUAN_H100}
    eight = _row(dims, replace(hw, flops=rate), 8, 8, False, (1, 2, 4, 8, 16))
    return {"rate_flops": rate, "serial_s": serial, "published_s": XDIT_HUNYUAN_H100, "predicted_s": predicted,
            "published_speedup_8": XDIT_HUNYUAN_H100[1] / XDIT_HUNYUAN_H100[8],
            **{f"{k}_8_gpu_s": serial + dims.steps * eight[k]["step_s"] for k in ("sliced", "ring", "usp")}}


def _ring_cells(r: dict) -> str:
    """`step s` and `UxR/n` of the best ring and the best USP of a row (blank where none ran)."""
    cells = []
    for key in ("ring", "usp"):
        x = r.get(key)
        if x is None:
            cells.append(f"{'':>8} {'':>8}")
            continue
        shape = f"{x['ulysses']}x{x['ring']}/{x['slices']}" if key == "usp" else f"/{x['slices']}"
        cells.append(f"{x['step_s']:>8.2f} {shape:>8}")
    return " ".join(cells)


def _wins(rows: list[dict]) -> list[str]:
    """Rows where ring or USP beats sliced Ulysses by more than 1 %, with the gain."""
    out = []
    for r in rows:
        if r.get("best") not in ("ring", "usp"):
            continue
        x = r[r["best"]]
        if "sliced" in r and r["sliced"]["step_s"] < 1.01 * x["step_s"]:
            continue
        shape = f"usp {x['ulysses']}x{x['ring']}" if r["best"] == "usp" else "ring"
        gain = (f"{r['sliced']['step_s'] / x['step_s']:.2f}x sliced Ulysses" if "sliced" in r
                else "Ulysses cannot split the heads")
        out.append(f"{r['gpus']} GPUs{' CFG-parallel' if r['cfg_parallel'] else ''} ({shape}, {gain})")
    return out


def format_full(report: dict) -> str:
    lines = [f"{report['model']['name']} on {report['hardware']['name']} "
             f"({report['hardware']['inter_Bps_per_node'] * 8 / 1e9:.0f} Gb/s between nodes)",
             f"{'gpus':>4} {'nodes':>5} {'cfg':>3}  {'ulysses s':>9} {'exposed':>7}  {'sliced s':>8} {'n':>2} "
             f"{'exposed':>7} {'hidden':>6} {'gain':>5} {'scaling':>7}  {'ring s':>8} {'/n':>8} {'usp s':>8} "
             f"{'UxR/n':>8}  best"]
    for r in report["rows"]:
        head = f"{r['gpus']:>4} {r['nodes']:>5} {'yes' if r['cfg_parallel'] else 'no':>3}  "
        tail = f"  {_ring_cells(r)}  {r.get('best', '')}"
        if "skipped" in r:
            lines.append(head + f"{'n/a: ' + r['skipped']:<62}" + tail)
            continue
        u, s = r["ulysses"], r["sliced"]
        lines.append(head + f"{u['step_s']:>9.2f} {u['exposed_comm_s']:>7.3f}  {s['step_s']:>8.2f} {r['slices']:>2} "
                     f"{s['exposed_comm_s']:>7.3f} {100 * r['hidden_share']:>5.0f}% {r['speedup']:>4.2f}x "
                     f"{r['scaling_vs_1']:>6.2f}x" + tail)
    lines.append("ring schedules beat Ulysses at: " + ("; ".join(_wins(report["rows"])) or "no GPU count here"))
    return "\n".join(lines)


def format_xdit(check_report: dict) -> str:
    pub, pred = check_report["published_s"], check_report["predicted_s"]
    rows = ", ".join(f"{g} GPU {pub[g]:.0f} s (model {pred[g]:.0f} s)" for g in pub)
    return (f"xDiT HunyuanVideo on H100, Ulysses: {rows}; fitted {check_report['rate_flops'] / 1e12:.0f} TFLOP/s "
            f"and {check_report['serial_s']:.0f} s not split by Ulysses; on 8 GPUs sliced Ulysses "
            f"{check_report['sliced_8_gpu_s']:.0f} s, ring {check_report['ring_8_gpu_s']:.0f} s, "
            f"USP {check_report['usp_8_gpu_s']:.0f} s")
