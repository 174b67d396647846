"""Parallel schedules on real gloo ranks with an emulated slow link, next to the simulator's prediction.

Three rows of models, each run by every rank under each of its schedules, one forward (a sampling
step, CFG batch 2, through the model's adapter) at a time, alternating schedules after a warm-up so
load drift hits all alike:
  spatial-temporal: stdit (dsp, ulysses, scalefusion, scalefusion-inter);
  full-3D:          dit3d, every block attending over all tokens (ulysses plain and --slices N);
  wan:              diffusers' WanTransformer3DModel, random, the full-3D row's size (ulysses plain and sliced).
Every transfer is delayed as a link of --gbps / --latency-us would (`LinkDelay`, benchmarks only).
Per case: median step wall time and exposed communication (time blocked in waits), and the
discrete-event model's prediction from this run's measured block pieces and the emulated link.
JSON with the machine facts.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/parallel.py --quick
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/parallel.py --suite wan --ranks 4

`--anchor diffusers` runs the grid against diffusers' own context parallelism instead (`--grid-ranks`,
`--tokens`, `--links`, `--batch` pick part of it, to split the long 32k-token rows into jobs): the same
random WanTransformer3DModel and inputs under diffusers' `enable_parallelism(ContextParallelConfig(
ulysses_degree=P))` and under slidefusion's schedules (ulysses plain and sliced, ring, usp, `--slices
auto`, `--parallel auto`), alternating, with diffusers' collectives delayed by the same link rule
(`slidefusion.testing.cp_anchor`); tokens 2k / 8k / 32k x links none / 2 / 0.5 Gb/s x 2 and 4 ranks.
On CPU diffusers needs one workaround (its device-count division), recorded in the JSON; its ring
needs a CUDA attention backend, so on CPU the anchor is its Ulysses. 4 ranks on a 2-core machine
time-share the cores: compare those rows with care.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/parallel.py --anchor diffusers --quick
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/parallel.py --anchor diffusers
"""

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from slidefusion.families import TextConditioning, adapter_for  # noqa: E402
from slidefusion.parallel import LinkDelay, ParallelConfig, Tracer, hooks, parallelize, spawn  # noqa: E402
from slidefusion.parallel.auto import measure_costs  # noqa: E402
from slidefusion.parallel.comm import Comm  # noqa: E402
from slidefusion.parallel.plan import SCHEDULES  # noqa: E402
from slidefusion.parallel.simulate import Link, simulate  # noqa: E402

SUITES = {
    # name: (model, overrides, latent (T, H, W), quick latent, cases)
    "st": ("stdit-small", {}, (8, 32, 32), (8, 16, 16),
           [("dsp", 1), ("ulysses", 1), ("scalefusion", 2), ("scalefusion", 4),
            ("scalefusion-inter", 2), ("scalefusion-inter", 4)]),
    # full-3D: 12 heads so 2 and 4 ranks split them; 2x2 patches give 8 x 16 x 16 = 2048 tokens.
    "full": ("dit3d-small", {"heads": 12, "patch_size": (1, 2, 2), "depth": 4}, (8, 32, 32), (4, 24, 24),
             [("ulysses", 1), ("ulysses", 2), ("ulysses", 4), ("ulysses", 8)]),
    # diffusers' WanTransformer3DModel (random weights) of the same width, heads and tokens as the
    # full-3D row: 12 heads x 16, FFN 768, 4 blocks, Wan's 16 latent channels, 2048 tokens.
    "wan": ("wan", dict(num_attention_heads=12, attention_head_dim=16, ffn_dim=768, num_layers=4, in_channels=16,
                        out_channels=16, text_dim=64, freq_dim=64, rope_max_seq_len=64), (8, 32, 32), (4, 24, 24),
            [("ulysses", 1), ("ulysses", 2), ("ulysses", 4), ("ulysses", 8)]),
}


def build_model(name: str, overrides: dict):
    """Our preset with every weight random, or a random diffusers model of a tiny family."""
    if name in ("wan", "latte"):
        from slidefusion.testing.tiny import tiny_model

        return tiny_model(name, **overrides)
    from slidefusion.models import build_model as build, preset

    torch.manual_seed(0)
    model = build(preset(name, **overrides))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model.eval()


def predict(handle, comm: Comm, latent_shape, link: LinkDelay, outside_s: float) -> float:
    """The simulator's step time from this rank group's measured pieces and the emulated link."""
    engine = handle.engine
    costs = measure_costs(engine, handle.model, latent_shape)
    bps = link.gbps * 1e9 / 8
    costs = dataclasses.replace(costs, link=Link(comm.size, comm.size, bps, bps, link.latency_us * 1e-6))
    return simulate(engine.schedule.name, costs, handle.slices).step_s + outside_s


def _outside_blocks_seconds(model, call) -> float:
    """One forward with every block skipped: embedding, conditioning, output head (not split here)."""
    skipped = copy.deepcopy(model)
    for block in adapter_for(skipped).blocks(skipped):
        hooks.attach(block, "skip", lambda module, call_next, x, *args, **kwargs: x)
    call(skipped)
    start = time.perf_counter()
    for _ in range(3):
        call(skipped)
    return (time.perf_counter() - start) / 3


def job(rank, world, options):
    torch.set_num_threads(1)
    model = build_model(options["model"], options["overrides"])
    adapter = adapter_for(model)
    g = torch.Generator().manual_seed(0)
    shape = (2, adapter.latent_channels(model), *options["latent"])
    x, t = torch.randn(shape, generator=g), torch.rand(2, generator=g) * adapter.objective.scale
    text = TextConditioning(torch.randn(2, 12, adapter.text_width(model), generator=g))

    def call(m):
        return adapter.predict(m, x, t, text)

    link = LinkDelay(options["latency_us"], options["gbps"])
    runners = {}
    for name, slices in options["cases"]:  # one copy per case: a model has one parallel setup at a time
        tracer = Tracer(rank=rank)
        config = ParallelConfig(name, slices, link_delay=link, timeout_s=300)
        runners[name, slices] = (parallelize(copy.deepcopy(model), config, tracer=tracer, latent_shape=shape), tracer)
    with torch.no_grad():
        for _ in range(options["warmup"]):
            for handle, _ in runners.values():
                call(handle.model)
        for _, tracer in runners.values():
            tracer.steps.clear()
        for _ in range(options["repeats"]):  # alternate schedules so load drift hits all alike
            for handle, _ in runners.values():
                call(handle.model)
        outside = _outside_blocks_seconds(model, call)
        comm = Comm(None, Tracer(rank=rank, enabled=False), link)
        rows = []
        for (name, slices), (handle, tracer) in runners.items():
            rows.append({"schedule": name, "slices": slices,
                         "wall_s": statistics.median(s["wall_s"] for s in tracer.steps),
                         "exposed_comm_s": statistics.median(s["exposed_comm_s"] for s in tracer.steps),
                         "predicted_s": predict(handle, comm, shape, link, outside)})
    return {"rows": rows}


def run_suite(suite: str, args) -> dict:
    model, overrides, latent, quick_latent, cases = SUITES[suite]
    options = {"model": model, "overrides": overrides, "latent": quick_latent if args.quick else latent,
               "gbps": args.gbps, "latency_us": args.latency_us, "warmup": 1,
               "repeats": args.repeats or (3 if args.quick else 7),
               "cases": [c for c in cases if SCHEDULES[c[0]].heads or suite == "st"]}
    start = time.perf_counter()
    results = spawn(job, args.ranks, options, timeout_s=600)
    rows = max(results, key=lambda r: sum(x["wall_s"] for x in r["rows"]))["rows"]  # the slowest rank
    anchor = rows[0]
    print(f"\n{suite}: {args.ranks} gloo ranks, {model} {overrides or ''}, latent {options['latent']}, CFG batch 2, "
          f"link {args.gbps} Gb/s + {args.latency_us:.0f} us per transfer, {options['repeats']} alternating runs")
    print(f"{'schedule':<18} {'slices':>6} {'step ms':>8} {'exposed ms':>10} {'vs first':>8} {'predicted ms':>12}")
    for r in rows:
        print(f"{r['schedule']:<18} {r['slices']:>6} {1e3 * r['wall_s']:>8.1f} {1e3 * r['exposed_comm_s']:>10.1f} "
              f"{anchor['wall_s'] / r['wall_s']:>7.2f}x {1e3 * r['predicted_s']:>12.1f}")
    return {"options": options, "rows": rows, "all_ranks": results, "seconds": time.perf_counter() - start}


def machine() -> dict:
    import diffusers

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "diffusers": diffusers.__version__, "threads_per_rank": 1, "load_average": os.getloadavg(),
            "python": platform.python_version()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller latents and 3 repeats (about a minute)")
    parser.add_argument("--suite", choices=["all", *SUITES], default="all")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--gbps", type=float, default=0.5, help="emulated link, Gb/s (default 0.5)")
    parser.add_argument("--latency-us", type=float, default=200.0)
    parser.add_argument("--anchor", choices=["diffusers"], help="the grid against diffusers' context parallelism")
    parser.add_argument("--grid-ranks", default=None, help="--anchor: comma-separated rank counts (default 2,4)")
    parser.add_argument("--tokens", default=None, help="--anchor: comma-separated token counts of 2048, 8192, 32768")
    parser.add_argument("--links", default=None, help="--anchor: comma-separated links of none, 2, 0.5 (Gb/s)")
    parser.add_argument("--batch", type=int, default=2, choices=[1, 2], help="--anchor: 2 = a CFG batch (default)")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per case (default 7; --quick 3)")
    parser.add_argument("--out", default=None, help="JSON (default outputs/benchmarks/parallel[_anchor].json)")
    args = parser.parse_args()
    if args.anchor:
        from parallel_anchor import run_anchor_grid

        report = {"anchor": args.anchor, **run_anchor_grid(args), "machine": machine()}
        return write(report, args.out or "outputs/benchmarks/parallel_anchor.json")
    suites = list(SUITES) if args.suite == "all" else [args.suite]
    report = {"ranks": args.ranks, "suites": {s: run_suite(s, args) for s in suites}, "machine": machine()}
    write(report, args.out or "outputs/benchmarks/parallel.json")


def write(report: dict, out: str) -> None:
    """Atomically: a reader never sees half a file."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
