"""Parallel schedules on real gloo ranks with an emulated slow link, next to the simulator's prediction.

Each rank runs the model forward (one sampling step, CFG batch 2) under every schedule, alternating
schedules after a warm-up; every transfer is delayed as a link of --gbps / --latency-us would
(`LinkDelay`, a benchmarking-only option). Per schedule: median step wall time and exposed
communication (time blocked in waits), and the discrete-event model's prediction from this run's
measured per-layer compute costs and the emulated link. JSON with the machine facts.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/parallel.py --quick
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from slidefusion.parallel import LinkDelay, ParallelConfig, Tracer, parallelize, spawn  # noqa: E402
from slidefusion.parallel.layout import FRAMES, POSITIONS, Split, block_view, shard, to_canonical  # noqa: E402
from slidefusion.parallel.simulate import Link, StepCosts, layer_flops, model_dims, simulate  # noqa: E402


def random_model(name: str):
    from slidefusion.models import build_model, preset

    torch.manual_seed(0)
    model = build_model(preset(name))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def _median_time(fn, repeats=3) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_costs(model, inputs, rank, world) -> dict:
    """This rank's per-layer compute (whole shard and a quarter of it) and the embed + head time."""
    x, t, ctx = inputs
    tokens, c, context = model.embed(x, t, ctx)
    canonical, hw = to_canonical(tokens), tokens.shape[2:4]
    out = {}
    for kind, axis in (("spatial", FRAMES), ("temporal", POSITIONS)):
        block = next(b for b in model.blocks if b.kind == kind)
        piece = shard(canonical, axis, Split(canonical.shape[axis], world), rank)
        quarter = piece.narrow(axis, 0, max(1, piece.shape[axis] // 4))
        out[kind] = _median_time(lambda: block(block_view(piece, axis, hw), c, context, None))
        out[kind + "_quarter"] = _median_time(lambda: block(block_view(quarter, axis, hw), c, context, None))
        out[kind + "_quarter_fraction"] = quarter.shape[axis] / piece.shape[axis]
    out["embed_head"] = _median_time(lambda: model.head(model.embed(x, t, ctx)[0], c))
    out["shard_bytes"] = canonical.numel() * canonical.element_size() / world
    return out


def predict(name, slices, costs, link: LinkDelay, world, preset_name, grid) -> float:
    dims = model_dims(preset_name)
    frames, positions = grid
    overhead = max(0.0, costs["spatial_quarter"] - costs["spatial"] * costs["spatial_quarter_fraction"])
    dense, attn = layer_flops(dims, 1.0, positions)
    bps = link.gbps * 1e9 / 8
    step = StepCosts(dims.pairs, costs["spatial"], costs["temporal"], overhead, costs["shard_bytes"],
                     Link(world, world, bps, bps, link.latency_us * 1e-6), 0.0,
                     qkv_fraction=6 * dims.hidden ** 2 / (dense + attn), attn_fraction=attn / (dense + attn))
    return simulate(name, step, slices).step_s + costs["embed_head"]


def job(rank, world, options):
    torch.set_num_threads(1)
    model = random_model(options["model"])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, model.config.in_channels, *options["latent"], generator=g)
    inputs = (x, torch.rand(2, generator=g), torch.randn(2, 12, model.config.text_dim, generator=g))
    link = LinkDelay(options["latency_us"], options["gbps"])
    runners = {}
    for name, slices in options["cases"]:
        tracer = Tracer(rank=rank)
        runners[name, slices] = (parallelize(model, ParallelConfig(name, slices, link_delay=link, timeout_s=120),
                                             tracer=tracer), tracer)
    with torch.no_grad():
        costs = measure_costs(model, inputs, rank, world)
        for _ in range(options["warmup"]):
            for runner, _ in runners.values():
                runner(*inputs)
        for runner, tracer in runners.values():
            tracer.steps.clear()
        for _ in range(options["repeats"]):  # alternate schedules so load drift hits all alike
            for runner, _ in runners.values():
                runner(*inputs)
    grid = (options["latent"][0] // model.config.patch_size[0],
            options["latent"][1] // model.config.patch_size[1] * options["latent"][2] // model.config.patch_size[2])
    rows = []
    for (name, slices), (_, tracer) in runners.items():
        rows.append({"schedule": name, "slices": slices,
                     "wall_s": statistics.median(s["wall_s"] for s in tracer.steps),
                     "exposed_comm_s": statistics.median(s["exposed_comm_s"] for s in tracer.steps),
                     "predicted_s": predict(name, slices, costs, link, world, options["model"], grid)})
    return {"rows": rows, "costs": costs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small model and few repeats (about a minute)")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--gbps", type=float, default=None, help="emulated link, Gb/s (default: 0.5, quick 0.2)")
    parser.add_argument("--latency-us", type=float, default=200.0)
    parser.add_argument("--out", default="outputs/benchmarks/parallel.json")
    args = parser.parse_args()
    quick = args.quick
    options = {
        "model": "stdit-tiny" if quick else "stdit-small",
        "latent": (8, 16, 16) if quick else (8, 32, 32),
        "gbps": args.gbps or (0.2 if quick else 0.5), "latency_us": args.latency_us,
        "warmup": 1, "repeats": 3 if quick else 7,
        "cases": [("dsp", 1), ("ulysses", 1), ("scalefusion", 2), ("scalefusion", 4),
                  ("scalefusion-inter", 2), ("scalefusion-inter", 4)],
    }
    start = time.perf_counter()
    results = spawn(job, args.ranks, options, timeout_s=300)
    rows = max(results, key=lambda r: sum(x["wall_s"] for x in r["rows"]))["rows"]  # the slowest rank
    dsp = next(r["wall_s"] for r in rows if r["schedule"] == "dsp")
    print(f"{args.ranks} gloo ranks, {options['model']}, latent {options['latent']}, CFG batch 2, "
          f"link {options['gbps']} Gb/s + {options['latency_us']:.0f} us per transfer")
    print(f"{'schedule':<18} {'slices':>6} {'step ms':>8} {'exposed ms':>10} {'vs dsp':>6} {'predicted ms':>12}")
    for r in rows:
        print(f"{r['schedule']:<18} {r['slices']:>6} {1e3 * r['wall_s']:>8.1f} {1e3 * r['exposed_comm_s']:>10.1f} "
              f"{dsp / r['wall_s']:>5.2f}x {1e3 * r['predicted_s']:>12.1f}")
    report = {"options": options, "ranks": args.ranks, "rows": rows, "costs": [r["costs"] for r in results],
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "torch": torch.__version__, "threads_per_rank": 1},
              "seconds": time.perf_counter() - start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({report['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
