"""Attention operators side by side: dense SDPA, Swin window, neighbourhood, slide (both offset modes).

For each grid and operator: median forward and forward+backward time (rounds alternate between the
operators, after a warm-up) and the transient peak memory of one forward+backward (RSS high-water
mark on CPU, `max_memory_allocated` on CUDA). Slide attention runs at every offset scale given
(offsets drawn uniformly in +-scale tokens), and "slide-joint" adds --extra-keys global keys (a
tenth of them masked) under the same softmax, as joint text+video blocks do. Everything goes
through the public ops (`slide_attention(..., backend=...)`). Writes a table on stdout, JSON with
the machine facts, and a log-log plot of time against tokens (if matplotlib is installed).
--check-joint N compares the joint op's output and gradients with the float64 reference on N
random queries (the reference is exact on any subset of queries).

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
from slidefusion.attention.reference import trilinear_sample, window_positions  # noqa: E402
from slidefusion.testing.rss import reset_peak_rss, status_kib  # noqa: E402

OPS = ("dense", "window", "neighborhood", "slide-sample", "slide-shift", "slide-joint")
SLIDE_OPS = ("slide-sample", "slide-shift", "slide-joint")  # run once per offset scale
FULL_GRIDS = ("4x16x16", "8x32x32", "16x32x32", "16x64x64")
TARGET_GRID = "16x32x32"
DENSE_MAX_TOKENS = 16384  # dense fwd+bwd past this takes minutes on 2 cores and says nothing new


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grids", nargs="+", default=None, help="TxHxW token grids (default: the full sweep)")
    p.add_argument("--ops", nargs="+", default=[op for op in OPS if op != "slide-joint"], choices=OPS)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--kernel", default="3x7x7", help="neighbourhood / slide window, TxHxW")
    p.add_argument("--window", default="2x8x8", help="Swin window, TxHxW")
    p.add_argument("--offset-scales", type=float, nargs="+", default=[0.9, 1.5],
                   help="offsets drawn in +-scale tokens, one run per scale (0.9: the module's bound)")
    p.add_argument("--extra-keys", type=int, default=226, help="global keys of slide-joint (226: CogVideoX's text)")
    p.add_argument("--check-joint", type=int, default=0, metavar="N",
                   help="also measure the joint op's error against the float64 reference on N random queries")
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


def random_offsets(q, slots, scale, seed=1):
    """Fixed offsets uniform in +-scale tokens: (B, T, H, W, heads, slots, 3)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = (torch.rand(*q.shape[:5], slots, 3, generator=g) * 2 - 1) * scale
    return x.to(q.device, q.dtype).requires_grad_()


def extra_keys(q, L, seed=2):
    """Global keys and values (B, L, heads, D) and a key mask (B, L) with every tenth key masked."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    B, heads, D = q.shape[0], q.shape[4], q.shape[5]
    k, v = (torch.randn(B, L, heads, D, generator=g).to(q.device, q.dtype).requires_grad_() for _ in range(2))
    mask = (torch.arange(L) % 10 != 9).expand(B, L).to(q.device)
    return k, v, mask


def make_op(name: str, args, inputs, scale: float | None):
    """A closure running the operator once, and the extra leaf tensors it differentiates."""
    kernel, window = triple(args.kernel), triple(args.window)
    q, k, v = inputs
    if name == "dense":
        return lambda: dense_attention(q, k, v), ()
    if name == "window":
        return lambda: window_attention(q, k, v, window), ()
    if name == "neighborhood":
        return lambda: slide_attention(q, k, v, kernel, backend=args.backend), ()
    K = kernel[0] * kernel[1] * kernel[2]
    off = random_offsets(q, 1 if name == "slide-shift" else K, scale)
    if name == "slide-joint":
        ek, ev, mask = extra_keys(q, args.extra_keys)
        run = lambda: slide_attention(q, k, v, kernel, off, extra_k=ek, extra_v=ev, extra_mask=mask,  # noqa: E731
                                      backend=args.backend)
        return run, (off, ek, ev)
    return lambda: slide_attention(q, k, v, kernel, off, backend=args.backend), (off,)


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


def transient_mib(fn, extra, inputs, device) -> float | None:
    """Peak memory one forward+backward adds on top of what was allocated before it."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run_once(fn, extra, inputs, True, device)
        return (torch.cuda.max_memory_allocated() - before) / 2**20
    if not reset_peak_rss():
        return None
    before = status_kib("VmRSS")
    run_once(fn, extra, inputs, True, device)
    return (status_kib("VmHWM") - before) / 1024


def variants(args) -> list[tuple[str, str, float | None]]:
    """(label, op, offset scale): each slide op once per scale, labelled op@scale."""
    out = []
    for op in args.ops:
        scales = args.offset_scales if op in SLIDE_OPS else [None]
        out += [(op if s is None else f"{op}@{s:g}", op, s) for s in scales]
    return out


def bench_grid(args, grid, dtype) -> list[dict]:
    B, heads, D = 1, args.heads, args.head_dim
    N = grid[0] * grid[1] * grid[2]
    gen = torch.Generator(device="cpu").manual_seed(0)
    inputs = [torch.randn(B, *grid, heads, D, generator=gen).to(args.device, dtype).requires_grad_() for _ in range(3)]
    cpu_dense_too_big = N > DENSE_MAX_TOKENS and not args.device.startswith("cuda")
    todo = [v for v in variants(args) if not (v[1] == "dense" and cpu_dense_too_big)]
    runs = {label: make_op(op, args, inputs, scale) for label, op, scale in todo}
    times = {(label, bwd): [] for label in runs for bwd in (False, True)}
    for label in runs:  # warm-up (and first-call costs such as Triton compilation)
        run_once(*runs[label], inputs, False, args.device)
        run_once(*runs[label], inputs, True, args.device)
    for _ in range(args.repeats):  # rounds alternate between operators, so load drifts hit all alike
        for label in runs:
            for bwd in (False, True):
                times[(label, bwd)].append(run_once(*runs[label], inputs, bwd, args.device))
    rows = []
    for label, op, scale in todo:
        rows.append(
            dict(
                op=label, kind=op, offset_scale=scale, grid=list(grid), tokens=N,
                fwd_s=statistics.median(times[(label, False)]),
                fwd_bwd_s=statistics.median(times[(label, True)]),
                transient_mib=transient_mib(*runs[label], inputs, args.device),
            )
        )
    return rows


def joint_reference_on(queries, q, k, v, kernel, offsets, ek, ev, mask):
    """Float64 joint slide attention of the chosen query tokens only: (B, n, heads, D).

    The same gather-then-softmax as `reference.slide_attention_reference`, restricted to `queries`
    (flat token indices): a query's output depends on its own row, the keys and the extra keys only.
    """
    B, T, H, W, heads, D = q.shape
    q, k, v, ek, ev = (x.double() for x in (q, k, v, ek, ev))
    limit = torch.tensor([T - 1, H - 1, W - 1], device=q.device, dtype=torch.float64)
    points = window_positions((T, H, W), kernel).to(q.device)[queries].double()[None, :, None]  # (1, n, 1, K, 3)
    points = points + offsets.double().reshape(B, T * H * W, heads, -1, 3)[:, queries]
    points = torch.minimum(points.clamp(min=0), limit)
    keys, values = trilinear_sample(k, points), trilinear_sample(v, points)  # (B, n, heads, K, D)
    qs = q.reshape(B, T * H * W, heads, D)[:, queries]
    scores = torch.einsum("bnhd,bnhkd->bnhk", qs, keys) * D**-0.5
    extra = torch.einsum("bnhd,blhd->bnhl", qs, ek).masked_fill(~mask[:, None, None, :], float("-inf")) * D**-0.5
    p = torch.cat([scores, extra], dim=-1).softmax(dim=-1)
    K = scores.shape[-1]
    return torch.einsum("bnhk,bnhkd->bnhd", p[..., :K], values) + torch.einsum("bnhl,blhd->bnhd", p[..., K:], ev)


def check_joint(args, grid, dtype, n_queries: int, scale: float) -> dict:
    """Max errors of the joint op's output and gradients (loss on n random queries) vs the float64 reference."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    B, heads, D, N = 1, args.heads, args.head_dim, grid[0] * grid[1] * grid[2]
    kernel = triple(args.kernel)
    q, k, v = (torch.randn(B, *grid, heads, D, generator=gen).to(args.device, dtype).requires_grad_() for _ in range(3))
    off = random_offsets(q, kernel[0] * kernel[1] * kernel[2], scale)
    ek, ev, mask = extra_keys(q, args.extra_keys)
    queries = torch.randperm(N, generator=gen)[:n_queries].to(args.device)
    leaves = (q, k, v, off, ek, ev)
    grad = torch.randn(B, len(queries), heads, D, generator=gen).to(args.device)
    out = slide_attention(q, k, v, kernel, off, extra_k=ek, extra_v=ev, extra_mask=mask, backend=args.backend)
    fast_out = out.reshape(B, N, heads, D)[:, queries].double()
    fast = torch.autograd.grad((fast_out * grad).sum(), leaves)
    ref_out = joint_reference_on(queries, q, k, v, kernel, off, ek, ev, mask)
    ref = torch.autograd.grad((ref_out * grad.double()).sum(), leaves)

    def rel(a, b):
        return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()

    names = ("dq", "dk", "dv", "doffsets", "dextra_k", "dextra_v")
    errors = {"out": rel(fast_out, ref_out), **{n: rel(a, b) for n, a, b in zip(names, fast, ref)}}
    return dict(grid=list(grid), queries=len(queries), offset_scale=scale, extra_keys=args.extra_keys,
                dtype=args.dtype, max_error_relative_to_max=errors)


def slope(rows, op, key) -> float | None:
    """Least-squares slope of log(time) against log(tokens)."""
    pts = [(math.log(r["tokens"]), math.log(r[key])) for r in rows if r["op"] == op]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(p[0] for p in pts), statistics.fmean(p[1] for p in pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


def targets(rows, grid_name, scales) -> dict:
    """The issue's targets at the target shape; None where a needed measurement is missing."""
    at = {r["op"]: r for r in rows if "x".join(map(str, r["grid"])) == grid_name}

    def ratio(a, b, ka="fwd_s", kb="fwd_s"):
        return at[a][ka] / at[b][kb] if a in at and b in at else None

    checks = {
        "neighborhood_fwd_over_dense_fwd": (ratio("neighborhood", "dense"), 0.15),
        "neighborhood_fwdbwd_over_fwd": (ratio("neighborhood", "neighborhood", "fwd_bwd_s"), 3.0),
    }
    labels = ["neighborhood"]
    for s in scales:
        for op in ("slide-sample", "slide-shift"):
            label, key = f"{op}@{s:g}", f"{op.replace('-', '_')}_{s:g}"
            checks[f"{key}_fwd_over_dense_fwd"] = (ratio(label, "dense"), 0.4)
            checks[f"{key}_fwdbwd_over_fwd"] = (ratio(label, label, "fwd_bwd_s"), 3.0)
            labels.append(label)
    for label in labels:
        if label in at and at[label]["transient_mib"] is not None:
            checks[f"{label}_transient_mib"] = (at[label]["transient_mib"], 100.0)
        checks[f"{label}_fwd_loglog_slope"] = (slope(rows, label, "fwd_s"), 1.1)
    return {name: dict(value=value, limit=limit, holds=None if value is None else value <= limit)
            for name, (value, limit) in checks.items()}


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
        for label in dict.fromkeys(r["op"] for r in rows):
            pts = sorted((r["tokens"], r[key]) for r in rows if r["op"] == label)
            ax.loglog(*zip(*pts), marker="o", label=label)
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
    print(f"{'grid':>10} {'op':>18} {'fwd ms':>9} {'fwd+bwd ms':>11} {'MiB':>7}")
    for name in grids:
        for r in bench_grid(args, triple(name), dtype):
            rows.append(r)
            mem = "n/a" if r["transient_mib"] is None else f"{r['transient_mib']:.0f}"
            print(f"{name:>10} {r['op']:>18} {1e3 * r['fwd_s']:9.1f} {1e3 * r['fwd_bwd_s']:11.1f} {mem:>7}", flush=True)
    result = dict(machine=machine(args), config=vars(args), results=rows,
                  targets=targets(rows, TARGET_GRID, args.offset_scales))
    print("\ntargets at", TARGET_GRID, "(B=1, heads=%d, D=%d, window %s)" % (args.heads, args.head_dim, args.kernel))
    for name, t in result["targets"].items():
        value = "n/a" if t["value"] is None else f"{t['value']:.3f}"
        verdict = {True: "holds", False: "MISSED", None: "not measured"}[t["holds"]]
        print(f"  {name:42s} {value:>8} <= {t['limit']:<6} {verdict}")
    if args.check_joint:
        result["joint_error"] = [check_joint(args, triple(g), dtype, args.check_joint, args.offset_scales[-1]) for g in grids]
        for e in result["joint_error"]:
            errs = ", ".join(f"{k} {v:.1e}" for k, v in e["max_error_relative_to_max"].items())
            print(f"\njoint vs float64 reference, {e['queries']} queries of {e['grid']}: {errs}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "attention.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    tmp.replace(out / "attention.json")
    print(f"\nwrote {out / 'attention.json'}")
    print(plot(rows, out / "attention.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
