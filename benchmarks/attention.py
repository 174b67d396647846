"""Attention operators side by side: dense SDPA, Swin window, neighbourhood, slide (both offset modes).

For each grid and operator: median forward and forward+backward time (rounds alternate between the
operators, after a warm-up) and the transient peak memory of one forward+backward (RSS high-water
mark on CPU, `max_memory_allocated` on CUDA). Writes a table on stdout, JSON with the machine facts,
and a log-log plot of time against tokens (if matplotlib is installed).

    OMP_NUM_THREADS=2 python benchmarks/attention.py                     # full sweep, 4x16x16 .. 16x64x64
    OMP_NUM_THREADS=2 python benchmarks/attention.py --grids 16x32x32    # the issue's target shape
    python benchmarks/attention.py --quick                               # smoke run, seconds
"""

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slidefusion.attention import backends, dense_attention, slide_attention, window_attention  # noqa: E402

OPS = ("dense", "window", "neighborhood", "slide-sample", "slide-shift")
FULL_GRIDS = ("4x16x16", "8x32x32", "16x32x32", "16x64x64")
TARGET_GRID = "16x32x32"
DENSE_MAX_TOKENS = 16384  # dense fwd+bwd past this takes minutes on 2 cores and says nothing new


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grids", nargs="+", default=None, help="TxHxW token grids (default: the full sweep)")
    p.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--kernel", default="3x7x7", help="neighbourhood / slide window, TxHxW")
    p.add_argument("--window", default="2x8x8", help="Swin window, TxHxW")
    p.add_argument("--max-offset", type=float, default=0.9, help="offset bound in tokens (the module's default)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    p.add_argument("--device", default="cpu")
    p.add_argument("--backend", default="auto", choices=backends.BACKENDS,
                   help="neighbourhood / slide backend (auto: compiled C++ on CPU, Triton on CUDA)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", default="runs/benchmarks/attention", help="folder for attention.json / .png")
    p.add_argument("--quick", action="store_true", help="tiny grids, one repeat: checks that everything runs")
    return p.parse_args(argv)


def triple(text: str) -> tuple[int, int, int]:
    return tuple(int(x) for x in text.lower().split("x"))


def make_op(name: str, args, grid, inputs):
    """A closure running the operator once; offsets are fixed random tensors within the bound."""
    kernel, window = triple(args.kernel), triple(args.window)
    q, k, v = inputs
    g = torch.Generator(device="cpu").manual_seed(1)

    def offsets(slots):
        x = (torch.rand(*q.shape[:5], slots, 3, generator=g) * 2 - 1) * args.max_offset
        return x.to(q.device, q.dtype).requires_grad_()

    if name == "dense":
        return lambda: dense_attention(q, k, v), ()
    if name == "window":
        return lambda: window_attention(q, k, v, window), ()
    def slide(off=None):
        if args.backend == "auto":
            return slide_attention(q, k, v, kernel, off)
        return backends.slide(q, k, v, kernel, off, None, backend=args.backend)  # shapes as checked above

    if name == "neighborhood":
        return lambda: slide(), ()
    off = offsets(kernel[0] * kernel[1] * kernel[2] if name == "slide-sample" else 1)
    return lambda: slide(off), (off,)


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_once(fn, extra, inputs, backward: bool, device: str) -> float:
    for x in (*inputs, *extra):
        x.grad = None
    sync(device)
    start = time.perf_counter()
    if backward:
        fn().sum().backward()
    else:
        with torch.no_grad():
            fn()
    sync(device)
    return time.perf_counter() - start


def rss_peak_reset() -> bool:
    """Reset the process's RSS high-water mark (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise RuntimeError(field)


def transient_mib(fn, extra, inputs, device) -> float | None:
    """Peak memory one forward+backward adds on top of what was allocated before it."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run_once(fn, extra, inputs, True, device)
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    if not rss_peak_reset():
        return None
    before = rss_kib("VmRSS")
    run_once(fn, extra, inputs, True, device)
    return (rss_kib("VmHWM") - before) / 1024


def bench_grid(args, grid, dtype) -> list[dict]:
    B, heads, D = 1, args.heads, args.head_dim
    N = grid[0] * grid[1] * grid[2]
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = [torch.randn(B, *grid, heads, D, generator=gen).to(args.device, dtype).requires_grad_() for _ in range(3)]
    ops = [op for op in args.ops if not (op == "dense" and N > DENSE_MAX_TOKENS and not args.device.startswith("cuda"))]
    runs = {op: make_op(op, args, grid, inputs) for op in ops}
    times = {(op, bwd): [] for op in ops for bwd in (False, True)}
    for op in ops:  # warm-up (and first-call costs such as Triton compilation)
        run_once(*runs[op], inputs, False, args.device)
        run_once(*runs[op], inputs, True, args.device)
    for _ in range(args.repeats):  # rounds alternate between operators, so load drifts hit all alike
        for op in ops:
            for bwd in (False, True):
                times[(op, bwd)].append(run_once(*runs[op], inputs, bwd, args.device))
    rows = []
    for op in ops:
        mem = transient_mib(*runs[op], inputs, args.device)
        rows.append(
            dict(
                op=op, grid=list(grid), tokens=N,
                fwd_s=statistics.median(times[(op, False)]),
                fwd_bwd_s=statistics.median(times[(op, True)]),
                transient_mib=mem,
            )
        )
    return rows


def slope(rows, op, key) -> float | None:
    """Least-squares slope of log(time) against log(tokens)."""
    pts = [(math.log(r["tokens"]), math.log(r[key])) for r in rows if r["op"] == op]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def targets(rows, grid_name) -> dict:
    """The issue's targets at the target shape; None where a needed measurement is missing."""
    at = {r["op"]: r for r in rows if "x".join(map(str, r["grid"])) == grid_name}
    out = {}

    def ratio(a, b, ka="fwd_s", kb="fwd_s"):
        return at[a][ka] / at[b][kb] if a in at and b in at else None

    checks = {
        "neighborhood_fwd_over_dense_fwd": (ratio("neighborhood", "dense"), 0.15),
        "slide_sample_fwd_over_dense_fwd": (ratio("slide-sample", "dense"), 0.4),
        "slide_shift_fwd_over_dense_fwd": (ratio("slide-shift", "dense"), 0.4),
        "neighborhood_fwdbwd_over_fwd": (ratio("neighborhood", "neighborhood", "fwd_bwd_s"), 3.0),
        "slide_sample_fwdbwd_over_fwd": (ratio("slide-sample", "slide-sample", "fwd_bwd_s"), 3.0),
        "slide_shift_fwdbwd_over_fwd": (ratio("slide-shift", "slide-shift", "fwd_bwd_s"), 3.0),
    }
    for op in ("neighborhood", "slide-sample", "slide-shift"):
        if op in at and at[op]["transient_mib"] is not None:
            checks[f"{op}_transient_mib"] = (at[op]["transient_mib"], 100.0)
        checks[f"{op}_fwd_loglog_slope"] = (slope(rows, op, "fwd_s"), 1.1)
    for name, (value, limit) in checks.items():
        out[name] = dict(value=value, limit=limit, holds=None if value is None else value <= limit)
    return out


def machine(args) -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    facts = dict(cpu=cpu, cores=os.cpu_count(), threads=torch.get_num_threads(), torch=torch.__version__,
                 python=platform.python_version(), device=args.device, dtype=args.dtype,
                 load_average=os.getloadavg() if hasattr(os, "getloadavg") else None)
    if args.device.startswith("cuda"):
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


def plot(rows, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: skipped the PNG (pip install matplotlib)"
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, key, title in zip(axes, ("fwd_s", "fwd_bwd_s"), ("forward", "forward + backward")):
        for op in OPS:
            pts = sorted((r["tokens"], r[key]) for r in rows if r["op"] == op)
            if pts:
                ax.loglog(*zip(*pts), marker="o", label=op)
        ax.set_xlabel("tokens (T*H*W)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("median seconds")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return f"wrote {path}"


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if args.quick:
        args.grids = args.grids or ["2x8x8", "4x8x16"]
        args.repeats = 1
        args.kernel, args.window = "1x3x3", "2x4x4"
    grids = args.grids or list(FULL_GRIDS)
    rows = []
    print(f"{'grid':>10} {'op':>13} {'fwd ms':>9} {'fwd+bwd ms':>11} {'MiB':>7}")
    for name in grids:
        for r in bench_grid(args, triple(name), dtype):
            rows.append(r)
            mem = "n/a" if r["transient_mib"] is None else f"{r['transient_mib']:.0f}"
            print(f"{name:>10} {r['op']:>13} {1e3 * r['fwd_s']:9.1f} {1e3 * r['fwd_bwd_s']:11.1f} {mem:>7}", flush=True)
    result = dict(machine=machine(args), config=vars(args), results=rows, targets=targets(rows, TARGET_GRID))
    print("\ntargets at", TARGET_GRID, "(B=1, heads=%d, D=%d, window %s)" % (args.heads, args.head_dim, args.kernel))
    for name, t in result["targets"].items():
        value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        verdict = {True: "holds", False: "MISSED", None: "not measured"}[t["holds"]]
        print(f"  {name:38s} {value:>8} <= {t['limit']:<6} {verdict}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention.json").write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out / 'attention.json'}")
    print(plot(rows, out / "attention.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
