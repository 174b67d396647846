"""A discrete-event model of the parallel schedules, for one rank and one model evaluation.

Two in-order resources per rank, as on a GPU: the compute stream and the link (NCCL and gloo run
one collective after another). An op starts when its resource is free and its inputs are done.
Compute runs `slowdown` slower while a transfer is in flight (communication kernels take SMs and
memory bandwidth). Each all-to-all costs latency + the larger of its intra-node and inter-node
bytes over that link's bandwidth. The op graph is built from the same `Schedule` data as the
engine: layer slices, (producer x consumer) chunks per switch, blocking or overlapped.
"""

from dataclasses import asdict, dataclass, field, replace

from slidefusion.core.errors import check
from slidefusion.parallel.layout import FRAMES, POSITIONS
from slidefusion.parallel.plan import SCHEDULES, Schedule


@dataclass
class Op:
    name: str
    resource: str  # "compute" | "link"
    seconds: float
    deps: list[int] = field(default_factory=list)


@dataclass
class Result:
    step_s: float
    compute_s: float  # time the compute stream was busy (slowdown included)
    exposed_comm_s: float  # time the compute stream waited for data
    link_s: float  # time the link was busy


def run(ops: list[Op], slowdown: float = 0.0) -> Result:
    """Simulate in-order execution of `ops` on their resources (compute, link, and any other link an
    op names, e.g. a ring's NIC next to a node's NVLink); returns the timings."""
    names = ["compute", "link"] + sorted({op.resource for op in ops} - {"compute", "link"})
    queues = {r: [i for i, op in enumerate(ops) if op.resource == r] for r in names}
    head = {r: 0 for r in queues}
    running: dict[str, tuple[int, float]] = {}  # resource -> (op, remaining work in seconds at full speed)
    done_at: dict[int, float] = {}
    busy = {r: 0.0 for r in names}
    now = 0.0
    while True:
        for r, queue in queues.items():
            if r not in running and head[r] < len(queue):
                i = queue[head[r]]
                if all(d in done_at for d in ops[i].deps):
                    running[r] = (i, ops[i].seconds)
                    head[r] += 1
        if not running:
            check(all(head[r] == len(q) for r, q in queues.items()), "simulator: the op graph deadlocks")
            break
        moving = any(r != "compute" for r in running)
        rate = {r: (1.0 / (1.0 + slowdown) if r == "compute" and moving else 1.0) for r in running}
        dt = min(left / rate[r] for r, (_, left) in running.items())
        now += dt
        for r in list(running):
            i, left = running[r]
            busy[r] += dt
            left -= dt * rate[r]
            if left <= 1e-15:
                done_at[i] = now
                del running[r]
            else:
                running[r] = (i, left)
    return Result(now, busy["compute"], now - busy["compute"], busy["link"])


@dataclass
class Link:
    """Per-rank link: ranks_per_node ranks share a node; bandwidths in bytes/s per rank."""

    ranks: int
    ranks_per_node: int
    intra_Bps: float
    inter_Bps: float
    latency_s: float

    def seconds(self, per_peer_bytes: float) -> float:
        """One collective in which this rank sends `per_peer_bytes` to every other rank."""
        g = min(self.ranks_per_node, self.ranks)
        intra = (g - 1) * per_peer_bytes / self.intra_Bps
        inter = (self.ranks - g) * per_peer_bytes / self.inter_Bps
        return self.latency_s + max(intra, inter)


@dataclass
class StepCosts:
    """One rank's costs for one model evaluation of an STDiT (spatial, temporal) x pairs.

    spatial_s / temporal_s: one layer on the rank's whole shard; slice_overhead_s: extra compute per
    slice (launches, smaller matrices); shard_bytes: one layer's tokens on one rank; qkv_fraction and
    attn_fraction split a spatial layer for Ulysses (before / inside / after its attention);
    gather_bytes: the output the rank shares at the end of a step (None: its tokens, shard_bytes; the
    engine gathers the output module's few values per token instead)."""

    pairs: int
    spatial_s: float
    temporal_s: float
    slice_overhead_s: float
    shard_bytes: float
    link: Link
    slowdown: float = 0.0
    qkv_fraction: float = 0.2
    attn_fraction: float = 0.3
    gather_bytes: float | None = None

    @property
    def gathered(self) -> float:
        return self.shard_bytes if self.gather_bytes is None else self.gather_bytes


def _program(schedule: Schedule, costs: StepCosts, n: int) -> list[Op]:
    if schedule.heads:
        return _ulysses_program(costs)
    ops: list[Op] = []
    P = costs.link.ranks
    layers = [(FRAMES, costs.spatial_s), (POSITIONS, costs.temporal_s)] * costs.pairs
    inbound: dict[int, list[int]] = {}  # consumer slice -> link ops it waits on
    for i, (axis, seconds) in enumerate(layers):
        slices = schedule.slices(axis, n)
        nxt = schedule.slices(layers[i + 1][0], n) if i + 1 < len(layers) else 0
        outbound: dict[int, list[int]] = {c: [] for c in range(nxt)}
        blocking: list[int] = []
        for k in range(slices):
            ops.append(Op(f"L{i} slice {k}", "compute", seconds / slices + costs.slice_overhead_s,
                          inbound.get(k, []) + blocking))
            me = len(ops) - 1
            for c in range(nxt):
                ops.append(Op(f"switch {i} ({k},{c})", "link",
                              costs.link.seconds(costs.shard_bytes / (P * slices * nxt)), [me]))
                outbound[c].append(len(ops) - 1)
                if not schedule.overlap:
                    blocking.append(len(ops) - 1)
        inbound = outbound
    last = len(ops) - 1
    ops.append(Op("gather tokens", "link", costs.link.seconds(costs.gathered), [last]))
    ops.append(Op("head", "compute", 0.0, [len(ops) - 1]))
    return ops


def _ulysses_program(costs: StepCosts) -> list[Op]:
    """Blocking: qkv, trade positions for heads (3 tensors), attend, trade back, rest; time is local."""
    ops: list[Op] = []
    per_peer = costs.shard_bytes / costs.link.ranks
    rest = 1.0 - costs.qkv_fraction - costs.attn_fraction
    for p in range(costs.pairs):
        for name, kind, seconds in (("qkv", "compute", costs.qkv_fraction * costs.spatial_s),
                                    ("a2a qkv", "link", costs.link.seconds(3 * per_peer)),
                                    ("attend", "compute", costs.attn_fraction * costs.spatial_s),
                                    ("a2a out", "link", costs.link.seconds(per_peer)),
                                    ("rest", "compute", rest * costs.spatial_s),
                                    ("temporal", "compute", costs.temporal_s)):
            ops.append(Op(f"{name} {p}", kind, seconds, [len(ops) - 1] if ops else []))
    ops.append(Op("gather tokens", "link", costs.link.seconds(costs.gathered), [len(ops) - 1]))
    ops.append(Op("head", "compute", 0.0, [len(ops) - 1]))
    return ops


@dataclass
class FullCosts:
    """One rank's costs for one model evaluation of a full-3D DiT under Ulysses, per block:
    qkv_s (projection of this rank's tokens, all heads, QK norm and rotary included), attn_s (softmax
    attention of this rank's heads over every token), out_s (output projection), rest_s (the block's
    other per-token work: norms, cross-attention, MLP); qkv_peer_bytes / out_peer_bytes: what this
    rank sends each peer in one whole exchange; gather_peer_bytes: the final token gather."""

    blocks: int
    qkv_s: float
    attn_s: float
    out_s: float
    rest_s: float
    qkv_peer_bytes: float
    out_peer_bytes: float
    gather_peer_bytes: float
    link: Link
    slice_overhead_s: float = 0.0
    slowdown: float = 0.0


def _full_block(ops: list[Op], costs: FullCosts, n: int, b: int) -> None:
    """One block of (sliced) Ulysses, in the order `ulysses.ulysses_attention` issues it."""
    def add(name, resource, seconds, deps):
        ops.append(Op(f"{name} {b}", resource, seconds, deps))
        return len(ops) - 1

    over, link = costs.slice_overhead_s if n > 1 else 0.0, costs.link
    last = add("rest", "compute", costs.rest_s, [len(ops) - 1] if ops else [])
    sends = []
    for k in range(n):
        last = add(f"qkv {k}", "compute", costs.qkv_s / n + over, [last])
        sends.append(add(f"a2a qkv {k}", "link", link.seconds(costs.qkv_peer_bytes / n), [last]))
    tile, returns = costs.attn_s / (n * n), []
    for j in range(n - 1):  # arrival j: 2j + 1 tiles of (query chunk, key chunk)
        last = add(f"attend {j}", "compute", (2 * j + 1) * tile + 2 * over, [last, sends[j]])
    for a in range(n):  # the last key chunk: each query chunk completes and goes back at once
        seconds = tile + over if a < n - 1 else n * tile + over
        last = add(f"attend last {a}", "compute", seconds, [last, sends[-1]])
        returns.append(add(f"a2a out {a}", "link", link.seconds(costs.out_peer_bytes / n), [last]))
    for a in range(n):
        last = add(f"out {a}", "compute", costs.out_s / n + over, [last, returns[a]])


def full_program(costs: FullCosts, n: int) -> list[Op]:
    ops: list[Op] = []
    for b in range(costs.blocks):
        _full_block(ops, costs, n, b)
    ops.append(Op("gather tokens", "link", costs.link.seconds(costs.gather_peer_bytes), [len(ops) - 1]))
    ops.append(Op("head", "compute", 0.0, [len(ops) - 1]))
    return ops


def simulate(schedule: str, costs: StepCosts | FullCosts, slices: int = 1) -> Result:
    if isinstance(costs, FullCosts):
        check(schedule == "ulysses", f"a full-3D model runs under ulysses only, not {schedule}")
        return run(full_program(costs, slices), costs.slowdown)
    return run(_program(SCHEDULES[schedule], costs, slices), costs.slowdown)


def best_slices(schedule: str, costs: StepCosts | FullCosts, candidates=(1, 2, 4, 8, 16, 32)) -> int:
    """The slice count with the shortest simulated step (the smallest on ties)."""
    return min(candidates, key=lambda n: (round(simulate(schedule, costs, n).step_s, 12), n))


# ---- the cost model: FLOPs of an STDiT layer on a shard, and hardware profiles ----------------------

@dataclass(frozen=True)
class ModelDims:
    hidden: int
    pairs: int
    heads: int
    mlp_ratio: float = 4.0
    text_len: int = 300
    patch: tuple[int, int, int] = (1, 2, 2)
    out_values: int = 16  # values per token the output module produces: latent channels x patch volume


SIM_MODELS = {
    # Open-Sora 1.2 STDiT3-XL/2: 28 (spatial, temporal) pairs, width 1152, 16 heads, T5 text (300 tokens).
    "stdit3-xl": ModelDims(hidden=1152, pairs=28, heads=16),
}


def model_dims(name: str) -> ModelDims:
    if name in SIM_MODELS:
        return SIM_MODELS[name]
    from slidefusion.models import preset

    config = preset(name)  # raises a UserError listing the valid presets
    check(config.arch == "stdit", f"simulate needs an stdit model; {name} is {config.arch}")
    patch = config.patch_size
    return ModelDims(config.hidden, config.depth, config.heads, config.mlp_ratio, 77, patch,
                     config.in_channels * patch[0] * patch[1] * patch[2])


def layer_flops(dims: ModelDims, tokens: float, seq: float) -> tuple[float, float]:
    """(flops outside self-attention, flops inside it) for `tokens` tokens whose self-attention
    spans `seq` tokens: qkv+proj 4C^2, cross q+proj 2C^2, MLP 2rC^2 (x2 for multiply-add)."""
    c = dims.hidden
    dense = 2 * tokens * (6 + 2 * dims.mlp_ratio) * c * c + 4 * tokens * dims.text_len * c
    return dense, 4 * tokens * seq * c


@dataclass(frozen=True)
class Hardware:
    """Achieved rates, not peaks. Values are assumptions unless calibrated (see `calibrate`)."""

    name: str
    flops: float  # achieved FLOP/s of the block math
    intra_Bps: float  # per-rank all-to-all bandwidth inside a node
    inter_Bps_per_node: float  # between nodes, shared by the node's ranks
    latency_s: float
    slice_overhead_s: float
    slowdown: float
    bytes_per_value: int = 2


HARDWARE = {
    # AWS P4d (8 x A100 40GB SXM, NVSwitch 600 GB/s per GPU both ways, 4 x 100 Gb/s EFA per node).
    # Achieved rates: 130 TFLOP/s = 42% of the 312 bf16 peak for STDiT3-XL's blocks (width 1152, head
    # dim 72, which FlashAttention pads to 96); NCCL all-to-all inside the node ~150 GB/s per GPU (half
    # of 300 one way); 400 Gb/s = 50 GB/s per node between nodes at line rate, shared by its 8 GPUs;
    # 40 us per collective, 60 us extra compute per slice, compute 10% slower while a transfer runs.
    # `calibration_steps` shows what each assumption does to the paper's three numbers.
    "a100": Hardware("a100", 130e12, 150e9, 50e9, 40e-6, 60e-6, 0.1),
    # H100 SXM 80GB (8 per node, NVLink4 900 GB/s both ways: ~225 GB/s all-to-all per GPU). The FLOP rate
    # is fitted to xDiT's HunyuanVideo times (simulate_full.xdit_check); the link between nodes is a
    # P5's 3200 Gb/s EFA unless --inter-gbps says otherwise.
    "h100": Hardware("h100", 336e12, 225e9, 400e9, 40e-6, 30e-6, 0.1),
}

# The first version of this profile (50% of peak, hidden tokens gathered every step): the numbers the
# issue quoted (DSP 43.6% on 2 nodes, 2.38x from 1 to 4 nodes).
FIRST_PROFILE = dict(flops=156e12, gather="tokens")


def scenario_costs(dims: ModelDims, hw: Hardware, frames: int, positions: int, batch: int,
                   nodes: int, per_node: int, gather: str = "output") -> StepCosts:
    """Costs for a latent of `frames` x `positions` tokens per sample (CFG doubles the batch).
    gather: "output" (what the engine shares each step: the output module's values) or "tokens"."""
    P = nodes * per_node
    tokens = batch * frames * positions / P
    s_dense, s_attn = layer_flops(dims, tokens, positions)
    t_dense, t_attn = layer_flops(dims, tokens, frames)
    c = dims.hidden
    link = Link(P, per_node, hw.intra_Bps, hw.inter_Bps_per_node / per_node, hw.latency_s)
    qkv = 2 * tokens * 3 * c * c / (s_dense + s_attn)
    return StepCosts(dims.pairs, (s_dense + s_attn) / hw.flops, (t_dense + t_attn) / hw.flops,
                     hw.slice_overhead_s, tokens * c * hw.bytes_per_value, link, hw.slowdown,
                     qkv_fraction=qkv, attn_fraction=s_attn / (s_dense + s_attn),
                     gather_bytes=tokens * (c if gather == "tokens" else dims.out_values) * hw.bytes_per_value)


def paper_scenario(hw: Hardware, node_counts=(1, 2, 4), per_node: int = 8, slice_options=(1, 2, 4, 8, 16),
                   gather: str = "output") -> dict:
    """Open-Sora STDiT3-XL/2, 720p (90 x 160 latent, patch 2 -> S = 3600), ~16 s (T ~ 102), CFG batch 2."""
    dims = SIM_MODELS["stdit3-xl"]
    rows = []
    for nodes in node_counts:
        costs = scenario_costs(dims, hw, 102, 3600, 2, nodes, per_node, gather)
        rows.append(schedule_rows(costs, slice_options, {"nodes": nodes, "gpus": nodes * per_node}))
    return summarise(rows, node_counts)


def schedule_rows(costs: StepCosts, slice_options, extra: dict) -> dict:
    out = {**extra, "schedules": {}}
    for name in SCHEDULES:
        n = 1 if name in ("dsp", "ulysses") else best_slices(name, costs, slice_options)
        result = simulate(name, costs, n)
        out["schedules"][name] = {"slices": n, **asdict(result),
                                  "comm_share": result.exposed_comm_s / result.step_s}
    for name in ("scalefusion", "scalefusion-inter"):
        out["schedules"][name]["by_slices"] = {n: simulate(name, costs, n).step_s for n in slice_options}
    return out


def summarise(rows: list[dict], node_counts) -> dict:
    base = rows[0]["schedules"]
    for row in rows:
        s = row["schedules"]
        row["dsp_comm_share"] = s["dsp"]["comm_share"]
        for name in SCHEDULES:
            s[name]["speedup_vs_dsp"] = s["dsp"]["step_s"] / s[name]["step_s"]
            s[name]["scaling_vs_first"] = base[name]["step_s"] / s[name]["step_s"]
    return {"rows": rows, "paper": PAPER}


def calibration_steps(hw: Hardware | None = None) -> list[dict]:
    """The paper's three numbers (DSP's share on 2 nodes, scalefusion over DSP on 2 nodes, strong
    scaling 1 -> 4 nodes) as the profile moves from its first version to the documented P4d one,
    one assumption at a time."""
    hw = hw or HARDWARE["a100"]
    first = replace(hw, flops=FIRST_PROFILE["flops"])
    steps = [("first profile: 156 TFLOP/s, hidden tokens gathered each step", first, "tokens"),
             ("gather the output module's 16 values per token instead", first, "output"),
             ("130 TFLOP/s, hidden tokens gathered", hw, "tokens"),
             ("104 TFLOP/s, hidden tokens gathered", replace(hw, flops=104e12), "tokens"),
             ("documented P4d profile: 130 TFLOP/s, output gathered", hw, "output")]
    out = []
    for label, profile, gather in steps:
        rows = paper_scenario(profile, (1, 2, 4), gather=gather)["rows"]
        two, four = rows[1]["schedules"], rows[2]["schedules"]
        out.append({"assumption": label, "dsp_comm_share_2_nodes": two["dsp"]["comm_share"],
                    "scalefusion_vs_dsp_2_nodes": two["scalefusion"]["speedup_vs_dsp"],
                    "inter_vs_dsp_2_nodes": two["scalefusion-inter"]["speedup_vs_dsp"],
                    "scaling_1_to_4_nodes": four["scalefusion-inter"]["scaling_vs_first"]})
    return out


PAPER = {
    "dsp_comm_share_2_nodes": "up to 34%",
    "scalefusion_vs_dsp": "1.36-1.4x on average",
    "strong_scaling_1_to_4_nodes": "3.6x",
    "slices": "more than about 16 slices hurts",
}


def format_table(report: dict) -> str:
    lines = [f"{'nodes':>5} {'gpus':>4}  {'schedule':<18} {'slices':>6} {'step s':>8} {'exposed s':>9} "
             f"{'comm %':>6} {'vs dsp':>6} {'scaling':>7}"]
    for row in report["rows"]:
        for name, s in row["schedules"].items():
            lines.append(f"{row.get('nodes', ''):>5} {row.get('gpus', ''):>4}  {name:<18} {s['slices']:>6} "
                         f"{s['step_s']:>8.3f} {s['exposed_comm_s']:>9.3f} {100 * s['comm_share']:>5.1f}% "
                         f"{s['speedup_vs_dsp']:>5.2f}x {s['scaling_vs_first']:>6.2f}x")
    lines.append("paper (ScaleFusion, MLSys 2025): " + "; ".join(f"{k.replace('_', ' ')}: {v}" for k, v in report["paper"].items()))
    return "\n".join(lines)
