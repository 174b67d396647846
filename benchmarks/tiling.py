"""Long clips on the CPU: real peak memory against clip length, whole blocks vs tiled vs tiled with
checkpoints spilled to disk, the spill's cost against host checkpoints, and the disk's bandwidth.

Each (mode, clip length) runs in its own subprocess: dit3d-small with slide attention (or, with
--model wan, a small diffusers WanTransformer3DModel: dense 3D attention, query tiles) trained by
the offload engine (fp32, checkpoints at block boundaries) for a warm-up step and --steps timed
steps. The child reports its VmHWM (the kernel's high-water mark of resident memory, not an
estimate) and, separately, the VmHWM of the same process after building the model and engine
and before the first step ("idle"), so peak - idle is what the step itself needed. Modes:
  whole        every block over the whole clip at once (offload.tile=off)
  tiled        blocks run tile by tile (offload.tile=--tile frames)
  tiled+spill  tiled, and every block-boundary checkpoint written to a spill file in --spill-dir
               (offload.spill_dir, offload.spill_after=0)
  host ckpt    tiled with checkpoints in host memory: the anchor of the spill overhead (= tiled)
  tiled+spill q2  the same with the spill's disk queues two blocks deep (read ahead, write behind),
               as before they were bounded to one: the anchor of that change (not run by default)
Children run alternating (mode by mode inside each round, --rounds rounds) and medians are quoted.
The disk is measured on its own too: --disk-mb written and read back through `SpillFile`.

    nice -n 19 python benchmarks/tiling.py --quick        # ~2 minutes on 2 cores
    nice -n 19 python benchmarks/tiling.py --model wan --frames 4 16 --size 32 --depth 4
    nice -n 19 python benchmarks/tiling.py                # 8, 16, 32, 64 frames; writes OUT/tiling.json
    python benchmarks/tiling.py --plot runs/bench/tiling/tiling.json --png docs/results/img/tiling-memory.png
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slidefusion.testing.rss import reset_peak_rss, status_kib  # noqa: E402

MODES = ("whole", "tiled", "tiled+spill", "tiled+spill q2")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--frames", type=int, nargs="+", default=[8, 16, 32, 64], help="latent frames per clip")
    p.add_argument("--model", default="dit3d", choices=["dit3d", "wan"],
                   help="dit3d-small with slide attention, or a small diffusers Wan (dense attention, query tiles)")
    p.add_argument("--size", type=int, default=32, help="latent height and width (dit3d-small patches by 4, Wan by 2)")
    p.add_argument("--tile", type=int, default=4, help="frames per tile")
    p.add_argument("--depth", type=int, default=6, help="blocks (dit3d-small has 6; more blocks, more checkpoints)")
    p.add_argument("--kernel", type=int, nargs=3, default=[3, 3, 3], help="slide attention window (kt kh kw)")
    p.add_argument("--steps", type=int, default=2,
                   help="timed steps per child (after one warm-up step; 0: the warm-up step alone, timed)")
    p.add_argument("--rounds", type=int, default=1, help="alternating rounds of every (mode, length)")
    p.add_argument("--modes", nargs="+", default=list(MODES[:3]), choices=MODES)
    p.add_argument("--spill-dir", default=None, help="a folder on the disk to spill to (default: a temp folder)")
    p.add_argument("--disk-mb", type=int, default=512, help="bytes for the raw disk measurement")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="runs/bench/tiling")
    p.add_argument("--quick", action="store_true", help="8 and 16 frames, one round, one step")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--plot", help="draw OUT/tiling.json (this path) instead of measuring")
    p.add_argument("--png", default="docs/results/img/tiling-memory.png")
    args = p.parse_args(argv)
    if args.quick:
        args.frames, args.rounds, args.steps = [8, 16], 1, 1
    return args


# -- the child: one (mode, length) ----------------------------------------------------------------


def _peak(device) -> int:
    import torch

    return torch.cuda.max_memory_allocated() if device.type == "cuda" else status_kib("VmHWM") * 1024


def _ours(spec: dict, device):
    """dit3d-small with slide attention: (model, loss_fn, latents, tokens, hidden)."""
    import torch

    from slidefusion.models import build_model, preset

    torch.manual_seed(0)
    config = preset("dit3d-small", attention="slide", attention_options={"kernel_size": tuple(spec["kernel"])},
                    depth=spec["depth"])
    model = build_model(config)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, config.in_channels, spec["frames"], spec["size"], spec["size"], generator=g).to(device)
    t, text = torch.rand(1, generator=g).to(device), torch.randn(1, 8, config.text_dim, generator=g).to(device)
    tokens = int(x.shape[2] * (x.shape[3] // 4) * (x.shape[4] // 4))
    return model, lambda m: (m(x, t, text) - x).pow(2).mean(), x, tokens, config.hidden


# A small WanTransformer3DModel with Wan 2.1 14B's MLP ratio (13824 / 5120 = 2.7) and head width (128).
WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=16, out_channels=16,
           text_dim=64, freq_dim=64, ffn_dim=692, rope_max_seq_len=256)


def _wan(spec: dict, device):
    """A diffusers Wan (dense 3D self-attention, tiled through its stock processor): the same tuple."""
    import diffusers
    import torch

    from slidefusion.families import TextConditioning, adapter_for

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(**WAN, num_layers=spec["depth"]).to(device)
    adapter = adapter_for(model)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, WAN["in_channels"], spec["frames"], spec["size"], spec["size"], generator=g).to(device)
    t, text = torch.tensor([500.0], device=device), TextConditioning(torch.randn(1, 16, WAN["text_dim"], generator=g).to(device))
    hidden = WAN["num_attention_heads"] * WAN["attention_head_dim"]
    return model, lambda m: (adapter.predict(m, x, t, text) - x).pow(2).mean(), x, adapter.tokens(model, x.shape), hidden


def run_child(spec: dict) -> dict:
    """Build, reset the high-water mark, train; the peaks and the step and spill timings."""
    import torch

    from slidefusion.offload import OffloadEngine, OffloadPolicy
    from slidefusion.offload import engine_blocks
    from slidefusion.optim import OptimConfig

    device = torch.device(spec["device"])
    model, loss_fn, x, tokens, hidden = (_wan if spec.get("model") == "wan" else _ours)(spec, device)
    optim = OptimConfig(lr=1e-4, max_grad_norm=None, warmup_steps=0, ema_decay=None)
    mode = spec["mode"]
    policy = OffloadPolicy(device=spec["device"], compute_dtype=torch.float32, optim=optim,
                           tile=None if mode == "whole" else spec["tile"],
                           spill_dir=spec["spill_dir"] if mode.startswith("tiled+spill") else None, spill_after=0)
    engine = OffloadEngine(model, engine_blocks(model), policy)
    if mode.endswith(" q2"):
        engine.checkpoints.read_ahead = engine.checkpoints.write_behind = 2

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    reset = reset_peak_rss()
    idle = _peak(device)
    start = time.perf_counter()
    engine.train_step(loss_fn)  # warm-up: the allocator's and the threads' first use
    engine.synchronize()
    times = [] if spec["steps"] else [time.perf_counter() - start]  # --steps 0: the warm-up step alone
    for _ in range(spec["steps"]):
        start = time.perf_counter()
        engine.train_step(loss_fn)
        engine.synchronize()
        times.append(time.perf_counter() - start)
    result = {"peak_bytes": _peak(device), "idle_bytes": idle, "hwm_reset": reset, "step_s": times,
              "tokens": tokens, "latent_bytes": x.numel() * 4, "block_input_bytes": tokens * hidden * 4}
    store = engine.checkpoints
    if hasattr(store, "bytes_written"):
        result.update(spill_written=store.bytes_written, spill_read=store.bytes_read, spill_write_s=store.write_s,
                      spill_read_s=store.read_s, spill_exposed_s=store.exposed_s, direct=store.file.direct,
                      read_peak=store.reading.peak, write_peak=store.writing.peak)
    engine.close()
    return result


# -- the parent -----------------------------------------------------------------------------------


def _child(args, mode: str, frames: int, spill_dir: str) -> dict:
    spec = {"mode": mode, "frames": frames, "size": args.size, "tile": args.tile, "steps": args.steps, "kernel": args.kernel,
            "depth": args.depth, "model": args.model,
            "spill_dir": spill_dir, "device": args.device}
    # buffers over 64 KiB are mmapped, so a freed one goes back to the kernel at once and VmHWM is
    # the live peak, not whatever glibc's heap kept from an earlier step
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True, env=env,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"child {mode} {frames} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def disk_bandwidth(folder: str, megabytes: int) -> dict:
    """Write then read `megabytes` through a SpillFile (large aligned writes, O_DIRECT if taken): GB/s."""
    import torch

    from slidefusion.offload.tiling.spill import SpillFile

    data = torch.randint(0, 255, (megabytes << 20,), dtype=torch.uint8)
    spill = SpillFile(folder)
    try:
        spill.reserve(data.numel())
        start = time.perf_counter()
        spill.write(0, data)
        os.fsync(spill.fd)
        written = time.perf_counter() - start
        back = torch.empty_like(data)
        start = time.perf_counter()
        spill.read(0, back)
        read = time.perf_counter() - start
        assert torch.equal(back, data)
        return {"write_GBps": data.numel() / written / 1e9, "read_GBps": data.numel() / read / 1e9, "direct": spill.direct,
                "bytes": data.numel()}
    finally:
        spill.close()


def measure(args) -> dict:
    folder = args.spill_dir or tempfile.mkdtemp(prefix="slidefusion-bench-spill-")
    runs: dict[str, dict[int, list[dict]]] = {m: {f: [] for f in args.frames} for m in args.modes}
    for _ in range(args.rounds):
        for frames in args.frames:
            for mode in args.modes:  # alternating: each length's modes side by side
                runs[mode][frames].append(_child(args, mode, frames, folder))
                r = runs[mode][frames][-1]
                print(f"  {mode:<12} {frames:>3} frames: peak {r['peak_bytes'] / 2**20:8.1f} MiB, "
                      f"step {statistics.median(r['step_s']):.2f} s", flush=True)
    disk = disk_bandwidth(folder, args.disk_mb)
    if not args.spill_dir:
        os.rmdir(folder)
    return {"machine": _machine(), "args": {k: v for k, v in vars(args).items() if k not in ("child", "plot")},
            "disk": disk, "runs": {m: {str(f): v for f, v in by.items()} for m, by in runs.items()}}


def _machine() -> dict:
    import torch

    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
            "threads": int(os.environ.get("OMP_NUM_THREADS", "1")), "note": "a shared machine: timings are noisy"}


def summary(results: dict) -> dict:
    """Per mode and length: median peak - idle (MiB), median step (s); spill overhead and bandwidths."""
    rows = {}
    for mode, by in results["runs"].items():
        for frames, runs in by.items():
            rows.setdefault(frames, {})[mode] = {
                "peak_MiB": statistics.median(r["peak_bytes"] for r in runs) / 2**20,
                "step_MiB": statistics.median(r["peak_bytes"] - r["idle_bytes"] for r in runs) / 2**20,
                "step_s": statistics.median(s for r in runs for s in r["step_s"]),
                "tokens": runs[0]["tokens"], "block_input_MiB": runs[0]["block_input_bytes"] / 2**20,
                "latent_MiB": runs[0]["latent_bytes"] / 2**20}
            spilled = [r for r in runs if r.get("spill_written")]
            if spilled:
                rows[frames][mode]["spill_MiB"] = statistics.median(r["spill_written"] for r in spilled) / 2**20 / (
                    1 + results["args"]["steps"])  # per step
                io = sum(r["spill_write_s"] + r["spill_read_s"] for r in spilled)
                rows[frames][mode]["spill_GBps"] = sum(r["spill_written"] + r["spill_read"] for r in spilled) / io / 1e9
                rows[frames][mode]["exposed_s"] = statistics.median(r["spill_exposed_s"] for r in spilled)
                rows[frames][mode]["queues_MiB"] = max(max(r["read_peak"], r["write_peak"]) for r in spilled) / 2**20
    for frames, row in rows.items():
        if "tiled" in row and "tiled+spill" in row:
            row["spill_overhead"] = row["tiled+spill"]["step_s"] / row["tiled"]["step_s"] - 1
    return rows


def table(results: dict) -> str:
    rows, disk = summary(results), results["disk"]
    lines = ["frames tokens | " + " | ".join(f"{m}: peak, step-peak MiB, s/step" for m in results["runs"]) + " | spill overhead"]
    for frames, row in rows.items():
        cells = [f"{row[m]['peak_MiB']:7.0f} {row[m]['step_MiB']:7.0f} {row[m]['step_s']:6.2f}" for m in results["runs"]]
        overhead = f"{row['spill_overhead']:+.1%}" if "spill_overhead" in row else "-"
        first = next(v for k, v in row.items() if k != "spill_overhead")
        queues = " ".join(f"{m}: {row[m]['queues_MiB']:.1f}" for m in results["runs"] if "queues_MiB" in row[m])
        lines.append(f"{frames:>6} {first['tokens']:>6} | " + " | ".join(cells) + f" | {overhead}"
                     f" | one block input {first['block_input_MiB']:.1f} MiB, latents {first['latent_MiB']:.1f} MiB"
                     + (f"; disk queues at most {queues} MiB" if queues else ""))
    lines.append(f"disk: write {disk['write_GBps']:.2f} GB/s, read {disk['read_GBps']:.2f} GB/s "
                 f"({'O_DIRECT' if disk['direct'] else 'buffered'}, {disk['bytes'] >> 20} MiB)")
    return "\n".join(lines)


def plot(results: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary(results)
    frames = sorted(rows, key=int)
    fig, ax = plt.subplots(figsize=(6.4, 4))
    args = results["args"]
    for mode in results["runs"]:
        ax.plot([int(f) for f in frames], [rows[f][mode]["step_MiB"] for f in frames], marker="o", label=mode)
    wan = args.get("model") == "wan"
    side = args["size"] // (2 if wan else 4)
    ax.set_xlabel(f"clip length (latent frames, {side}x{side} tokens each)")
    ax.set_ylabel("step peak - idle RSS (MiB, VmHWM)")
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(f) for f in frames], frames)
    name = "a small diffusers Wan, dense attention" if wan else "dit3d-small, slide attention"
    ax.set_title(f"{name}, offload engine fp32; tile {args['tile']} frames")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None) -> dict | None:
    args = parse_args(argv)
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return None
    if args.plot:
        results = json.loads(Path(args.plot).read_text())
        plot(results, args.png)
        print(table(results))
        return results
    results = measure(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tiling.json").write_text(json.dumps(results, indent=1))
    print(table(results))
    return results


if __name__ == "__main__":
    main()
