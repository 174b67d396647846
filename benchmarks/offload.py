"""Offload engine benchmark: step time offloaded vs the fastest resident run, per host-state mode and
with resident blocks; CPU AdamW kernels against their bandwidth floors.

Measurements, side by side in one run, alternating, after warm-up, medians quoted:
  step        one training step of a >= 8-block DiT3D, every runner with activation checkpointing at
              every block boundary (the resident ones through torch.utils.checkpoint hooks on the
              unchanged model). Resident anchors: torch AdamW single-tensor (the default on CPU),
              foreach=True and fused=True; the fastest of them is "the fastest resident". Offloaded:
              the engine in each host-state mode (master fp32|bf16, moments fp32|bf16|int8), with
              max_grad_norm (deferred updates), with resident blocks, and on CUDA without prefetch.
              On a CPU device the engine computes from its host buffers in place; "copy threads"
              is the engine copying through threads as it would over PCIe (the race tests' mode).
              `resident, fused AdamW + clip` is the anchor of the clipping runner. --isolate runs
              each runner in a process of its own per round (no heap shaped by another runner).
  residency   a transfer-bound configuration: the CPU copy threads throttled to --bandwidth, the
              engine with 0, half and all blocks resident.
  wan         a Wan-shaped row (offload_wan.py): a random diffusers WanTransformer3DModel, ~25 M
              parameters in 8 blocks, Wan's flow-matching loss through the adapters; the engine against
              the fastest of torch's single-tensor, foreach and fused AdamW on the resident model, and the
              same with peft LoRA (rank --lora-rank, the base frozen) on both sides.
  optimizer   one AdamW step over N parameters: our kernels in every mode against the bandwidth
              floor for their own byte count (a kernel moving the same bytes with no arithmetic),
              torch's fused and default AdamW, DeepSpeed's CPUAdam when importable; timed in CPU
              time of the calling thread, which a shared machine's waits for a core leave out.
              Each lean kernel also runs on cache-resident buffers ("in cache"): its compute alone,
              so "compute allows" is the most of the floor that its arithmetic leaves possible.
Writes a table on stdout and JSON (with the machine facts) to OUT/offload.json.

    python benchmarks/offload.py --quick            # smoke run, ~1 minute on 2 cores
    python benchmarks/offload.py                    # the CPU numbers
    python benchmarks/offload.py --device cuda --dtype bfloat16 --hidden 2048 --depth 16 ...
"""

import argparse
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slidefusion.models import build_model, preset
from slidefusion.offload import OffloadEngine, OffloadPolicy
from slidefusion.offload.optim import kernels
from slidefusion.offload.optim.adam import adamw_parallel_, run_ranges
from slidefusion.offload.optim.formats import QBLOCK, update_bytes_per_param
from slidefusion.offload.optim.lean import LeanBuffers, block_edges, lean_adamw_, prepared_kernel, seeds
from slidefusion.offload.plan.plan import parse_bytes
from slidefusion.optim import OptimConfig

import offload_wan  # noqa: E402 - benchmarks/ is the script's folder, first on sys.path

RESIDENT = {"resident": {}, "resident, foreach AdamW": {"foreach": True}, "resident, fused AdamW": {"fused": True},
            "resident, fused AdamW + clip": {"fused": True, "max_grad_norm": 1.0}}
CLIPPED = {"offloaded+clip": "resident, fused AdamW + clip"}  # clipping runners and their resident anchor
OFFLOADED = {"offloaded": {}, "offloaded, overlapped": {"overlap": True}, "offloaded+clip": {"max_grad_norm": 1.0},
             "offloaded, no prefetch": {"prefetch": 0},
             "offloaded, copy threads": {"zero_copy": False},
             "offloaded, bf16 moments": {"moments": "bf16"}, "offloaded, int8 moments": {"moments": "int8"},
             "offloaded, bf16 master": {"master": "bf16"}, "offloaded, bf16 master + int8": {"master": "bf16", "moments": "int8"},
             "offloaded, 4 resident blocks": {"resident_blocks": 4, "zero_copy": False}}
RUNNERS = [*RESIDENT, *OFFLOADED]
MODES = [("fp32", "fp32"), ("fp32", "bf16"), ("fp32", "int8"), ("bf16", "fp32"), ("bf16", "bf16"), ("bf16", "int8"),
         ("kahan", "bf16"), ("kahan", "int8")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes and few repeats: checks the script works")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="engine compute dtype")
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--depth", type=int, default=8, help="blocks (>= 8 for the issue's target)")
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--latent", default="4x16x16", help="latent T x H x W (3 channels, patch 1x2x2)")
    p.add_argument("--repeats", type=int, default=5, help="rounds of alternating runners (after one warm-up round)")
    p.add_argument("--steps-per-round", type=int, default=3)
    p.add_argument("--params", type=float, default=16e6, help="parameters in the optimizer benchmark")
    p.add_argument("--peak-tflops", type=float, default=None, help="device peak, for MFU (CUDA)")
    p.add_argument("--skip", nargs="*", default=[], choices=["step", "residency", "wan", "optimizer"], help="sections to leave out")
    p.add_argument("--runners", nargs="*", default=[r for r in RUNNERS if r != "offloaded, no prefetch"], choices=RUNNERS,
                   help="step-time runners (each engine holds its own host state: leave some out for big models)")
    p.add_argument("--bandwidth", default="250MB/s", help="the residency section's copy bandwidth (CPU): low enough to be transfer-bound")
    p.add_argument("--optimizer-threads", type=int, default=1, help="threads for our kernels in the optimizer section")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=False,
                   help="step section: each runner in a process of its own, alternating, one per round (no runner "
                        "then works in a heap another runner shaped)")
    p.add_argument("--out", default="runs/benchmarks/offload", help="folder for offload.json")
    offload_wan.add_arguments(p)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # an --isolate run passes them on to each runner
    if args.quick:
        args.hidden, args.heads, args.latent, args.repeats, args.steps_per_round, args.params = 128, 4, "2x8x8", 3, 2, 2e6
        offload_wan.quick(args)
    return args


def machine() -> dict:
    cpu = platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    facts = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
             "python": platform.python_version(), "c_kernels": kernels.load() is not None,
             "load_average": os.getloadavg()}
    if torch.cuda.is_available():
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


# -- step time ---------------------------------------------------------------------------------


def _model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    config = preset("dit3d-tiny", hidden=args.hidden, depth=args.depth, heads=args.heads, text_dim=64)
    model = build_model(config)
    with torch.no_grad():  # adaLN-Zero: make every block do real work from step one
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model


def _batch(args, device):
    t, h, w = (int(s) for s in args.latent.split("x"))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 3, t, h, w, generator=g)
    return [v.to(device) for v in (x, torch.rand(args.batch, generator=g), torch.randn(args.batch, 8, 64, generator=g))]


def _loss(model, batch):
    x, t, context = batch
    return (model(x, t, context) - x).pow(2).mean()


class Resident:
    """The unchanged model on the device, checkpointed at the same block boundaries from outside."""

    def __init__(self, model, device, dtype, max_grad_norm: float | None = None, **adamw):
        self.model, self.dtype, self.device = model.to(device), dtype, torch.device(device)
        self.max_grad_norm = max_grad_norm
        for block in model.blocks:
            block.forward = partial(checkpoint, block.forward, use_reentrant=False)
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        self.optimizer = torch.optim.AdamW(trainable, lr=1e-4, **adamw)

    def train_step(self, loss_fn) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            loss = loss_fn(self.model)
        loss.backward()
        if self.max_grad_norm is not None:  # the fastest clipping: foreach over every gradient
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm, foreach=True)
        self.optimizer.step()
        return loss.item()


def _engine(args, options: dict, bandwidth: float | None = None) -> OffloadEngine:
    options = dict(options)
    optim = OptimConfig(lr=1e-4, max_grad_norm=options.pop("max_grad_norm", None), warmup_steps=0, ema_decay=None)
    if options.get("master") == "kahan":
        options.update(master="bf16", rounding="kahan")
    model = _model(args)
    engine = OffloadEngine(model, model.blocks, OffloadPolicy(device=args.device, compute_dtype=getattr(torch, args.dtype),
                                                               optim=optim, **options))
    for copier in (engine.h2d, engine.d2h):
        if bandwidth and hasattr(copier, "set_bandwidth"):
            copier.set_bandwidth(bandwidth)
    return engine


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _alternate(runners: dict, args, batch, loss=_loss, samples: dict | None = None) -> tuple[dict, dict]:
    """Median seconds per step of each runner, in alternating rounds after one warm-up round (each
    round's seconds per step into `samples`, if given)."""
    times, peak = {name: [] for name in runners}, {name: 0 for name in runners}
    if samples is not None:
        samples.update(times)
    cpu = {name: [] for name in runners}  # process CPU seconds (every thread): the work, less a shared machine's waits
    cuda = torch.device(args.device).type == "cuda"
    for repeat in range(args.repeats + 1):
        for name, runner in runners.items():
            _sync(args.device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(args.steps_per_round):  # consecutive steps: the engine's deferred updates
                runner.train_step(lambda m: loss(m, batch))  # overlap its own next step, as in training
            if isinstance(runner, OffloadEngine):
                runner.synchronize()  # ... and none leaks into the next runner's time
            _sync(args.device)
            if repeat >= 1:
                times[name].append((time.perf_counter() - start) / args.steps_per_round)
                cpu[name].append((time.process_time() - start_cpu) / args.steps_per_round)
            if cuda:
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated())
    peak["cpu_s"] = {name: statistics.median(t) for name, t in cpu.items()}
    return {name: statistics.median(t) for name, t in times.items()}, peak


def _engine_facts(engine: OffloadEngine) -> dict:
    s = engine.stats
    return {"optimizer_s_per_step": s.optimizer_s / s.steps, "exposed_optimizer_s_per_step": s.exposed_optimizer_s / s.steps,
            "exposed_fraction": s.exposed_optimizer_s / max(s.optimizer_s, 1e-12),
            "exposed_transfer_s_per_step": s.exposed_transfer_s / s.steps, "h2d_bytes_per_step": s.h2d_bytes / s.steps,
            "d2h_bytes_per_step": s.d2h_bytes / s.steps, "peak_device_param_bytes": s.peak_device_param_bytes,
            "host_bytes_per_param": s.host_bytes_per_param, "host_state_bytes": s.host_state_bytes,
            # CPU copy threads: seconds a step keeps them busy, on the cores the compute also needs
            "copy_thread_s_per_step": sum(c.worker.busy_s for c in (engine.h2d, engine.d2h) if hasattr(c, "worker")) / s.steps}


def _step_runners(args) -> list[str]:
    """The runners the step section times on this device."""
    cuda = torch.device(args.device).type == "cuda"  # on CPU copies and compute share the cores: prefetch always
    return [name for name in args.runners if name != "offloaded, no prefetch" or cuda]


def _in_process(args) -> dict:
    """Every runner in this process, alternating: the step section's `median_s` and the rest."""
    dtype = getattr(torch, args.dtype)
    runners = {name: Resident(_model(args), args.device, dtype, **RESIDENT[name]) if name in RESIDENT
               else _engine(args, OFFLOADED[name]) for name in _step_runners(args)}
    medians, peak = _alternate(runners, args, _batch(args, args.device))
    result = {"params": sum(p.numel() for p in next(iter(runners.values())).model.parameters()), "median_s": medians,
              "median_process_cpu_s": peak.pop("cpu_s"), "peak": peak,
              "engine": {n: _engine_facts(r) for n, r in runners.items() if isinstance(r, OffloadEngine)}}
    for runner in runners.values():
        if isinstance(runner, OffloadEngine):
            runner.close()
    return result


def _isolated(args) -> dict:
    """`--isolate`: per round, each runner in a fresh process (one warm-up round and one timed round
    there), in turn; medians over the rounds. In one process a runner that frees its gradients after
    each step works in a heap the other runners reshaped meanwhile, and pays page faults for it."""
    rounds: list[dict] = []
    names = _step_runners(args)
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeats):
            for name in names:
                out = Path(folder) / "run"
                argv = [*args.argv, "--no-isolate", "--runners", name, "--repeats", "1", "--skip", "residency", "wan",
                        "optimizer", "--out", str(out)]
                subprocess.run([sys.executable, __file__, *argv], check=True, stdout=subprocess.DEVNULL)
                rounds.append(json.loads((out / "offload.json").read_text())["step"])
    merged = {"params": rounds[0]["params"], "engine": {}, "peak": {}}
    for key in ("median_s", "median_process_cpu_s"):
        merged[key] = {name: statistics.median(r[key][name] for r in rounds if name in r[key]) for name in names}
    for r in rounds:  # the last round's engine facts and peaks
        merged["engine"].update(r["engine"])
        merged["peak"].update(r.get("peak_device_bytes", {}))
    return merged


def bench_step(args) -> dict:
    cuda = torch.device(args.device).type == "cuda"
    measured = _isolated(args) if args.isolate else _in_process(args)
    medians, cpu_s, peak, params = measured["median_s"], measured["median_process_cpu_s"], measured["peak"], measured["params"]
    t, h, w = (int(s) for s in args.latent.split("x"))
    per_sample = t * (h // 2) * (w // 2)
    result = {"params": params, "blocks": args.depth, "tokens": args.batch * per_sample, "dtype": args.dtype,
              "device": args.device, "checkpointing": "every block boundary, all runners", "median_s": medians,
              "median_process_cpu_s": cpu_s, "engine": measured["engine"],
              "runners_in": "a process each, per round" if args.isolate else "one process, alternating"}
    resident = {n: s for n, s in medians.items() if n in RESIDENT and n not in CLIPPED.values()}
    clipped = {n: medians[n] / medians[a] for n, a in CLIPPED.items() if n in medians and a in medians}
    if clipped:  # the fastest resident does not clip; a clipping runner also against one that does
        result["ratio_to_resident_clipping"] = clipped
    if resident:
        result["fastest_resident"] = min(resident, key=resident.get)
        result["ratio_to_fastest_resident"] = {n: s / resident[result["fastest_resident"]] for n, s in medians.items()}
    if "offloaded, copy threads" in medians:
        # On a CPU device "offloaded" computes in place (nothing to copy, so nothing residency could
        # save); resident blocks need the copying engine, so that is their comparison.
        copying = "offloaded, copy threads"
        result["ratio_to_copy_threads"] = {n: medians[n] / medians[copying] for n in medians if "resident blocks" in n}
        result["cpu_ratio_to_copy_threads"] = {n: cpu_s[n] / cpu_s[copying] for n in result["ratio_to_copy_threads"]}
    # Model FLOPs (recompute not counted, as MFU does): 6 per parameter and token, plus dense self-
    # attention's 4 N^2 C per block forward, x3 for forward + backward.
    flops = 6 * params * result["tokens"] + 12 * args.depth * args.batch * per_sample ** 2 * args.hidden
    result["flops_per_step"] = flops
    if cuda:
        result["peak_device_bytes"] = peak
    if args.peak_tflops:
        result["mfu"] = {name: flops / s / (args.peak_tflops * 1e12) for name, s in medians.items()}
    return result


def bench_residency(args) -> dict:
    """Transfer-bound on a CPU: copies throttled to --bandwidth; 0, half and all blocks resident."""
    bandwidth = parse_bytes(args.bandwidth, "--bandwidth")
    counts = sorted({0, args.depth // 2, args.depth})
    runners = {f"resident_blocks={n}": _engine(args, {"resident_blocks": n, "zero_copy": False}, bandwidth) for n in counts}
    medians, peak = _alternate(runners, args, _batch(args, args.device))
    peak.pop("cpu_s")
    facts = {name: _engine_facts(r) for name, r in runners.items()}
    for runner in runners.values():
        runner.close()
    base = medians["resident_blocks=0"]
    return {"bandwidth_bytes_s": bandwidth, "median_s": medians, "speedup": {n: base / s for n, s in medians.items()},
            "engine": facts}


def bench_wan(args) -> dict:
    """The Wan-shaped rows (see offload_wan.py): full and LoRA, offloaded vs the fastest resident."""
    runners = offload_wan.runners(args, Resident)
    batch = offload_wan.wan_batch(args, args.batch, args.device)
    samples = {}
    medians, peak = _alternate(runners, args, batch, offload_wan.wan_loss, samples)
    models = {n: r.model for n, r in runners.items()}
    t, h, w = (int(s) for s in args.wan_latent.split("x"))
    result = {"blocks": args.wan_depth, "tokens": args.batch * t * (h // 2) * (w // 2), "dtype": args.dtype,
              "device": args.device, "checkpointing": "every block boundary, all runners",
              "groups": offload_wan.summarize(medians, models, samples), "samples_s": samples,
              "engine": {n: _engine_facts(r) for n, r in runners.items() if isinstance(r, OffloadEngine)}}
    if torch.device(args.device).type == "cuda":
        result["peak_device_bytes"] = peak
    if args.peak_tflops and "wan" in result["groups"]:  # the full fine-tune's model FLOPs, as bench_step counts
        per_sample, params = result["tokens"] // args.batch, result["groups"]["wan"]["params"]
        flops = 6 * params * result["tokens"] + 12 * args.wan_depth * args.batch * per_sample ** 2 * args.wan_dim
        result["groups"]["wan"]["mfu"] = {n: flops / s / (args.peak_tflops * 1e12)
                                          for n, s in result["groups"]["wan"]["median_s"].items()}
    for runner in runners.values():
        if isinstance(runner, OffloadEngine):
            runner.close()
    return result


# -- optimizer throughput -------------------------------------------------------------------------


def _alternating(fns: dict, repeats: int) -> tuple[dict, dict]:
    """Median wall and calling-thread CPU seconds of each callable, timed in alternating rounds after
    one warm-up call each. On a shared machine the CPU time is the figure to compare: it leaves out
    the time the thread waited for a core (but not other processes' use of the memory bus)."""
    for fn in fns.values():
        fn()  # page in, build kernels
    wall, cpu = {name: [] for name in fns}, {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start, start_cpu = time.perf_counter(), time.thread_time()
            fn()
            cpu[name].append(time.thread_time() - start_cpu)
            wall[name].append(time.perf_counter() - start)
    return ({name: statistics.median(s) for name, s in wall.items()}, {name: statistics.median(s) for name, s in cpu.items()})


def _in_cache(cfg, master: str, moments: str, n: int = 32 * QBLOCK, calls: int = 100):
    """The kernel's compute-bound time: `calls` updates of n cache-resident parameters (n * 10-20 B
    of state fits L2), seconds per call of the n parameters."""
    call = prepared_kernel(_lean_buffers(n, master, moments), 1, 1e-4, cfg, 1.0, seeds(0, 1, 0))

    def run():
        for _ in range(calls):
            call()
    return lambda: run() and None, n * calls


def _lean_buffers(n: int, master: str, moments: str) -> LeanBuffers:
    mdtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}[moments]
    blocks = -(-n // QBLOCK)
    return LeanBuffers(torch.randn(n).to(torch.float32 if master == "fp32" else torch.bfloat16),
                       torch.zeros(n, dtype=torch.bfloat16) if master == "kahan" else None,
                       torch.zeros(n, dtype=mdtype), torch.zeros(n, dtype=mdtype), torch.zeros(blocks), torch.zeros(blocks),
                       torch.arange(0, n + QBLOCK, QBLOCK).clamp(max=n) if moments == "int8" else None,
                       torch.randn(n).bfloat16(), torch.empty(n, dtype=torch.bfloat16) if master == "fp32" else None)


def _split(n: int, threads: int, run_range: Callable[[int, int], None]) -> Callable[[], None]:
    """`run_range(a, z)` over [0, n) in `threads` ranges of whole blocks at once, on the optimizer's
    own thread pool, as our kernels split their work: a floor at the kernels' thread count."""
    edges = [min(n, e * QBLOCK) for e in block_edges(-(-n // QBLOCK), threads)]
    if len(edges) == 2:
        return lambda: run_range(0, n)
    return lambda: run_ranges(run_range, edges, threads)


def _floor(lib, b: LeanBuffers, threads: int):
    """A kernel over the same streams as the update of `b` (read, read-write, write-only), no math."""
    streams = [(b.grad, 0), *[(t, 1) for t in (b.master, b.comp, b.exp_avg, b.exp_avg_sq) if t is not None]]
    streams += [(b.out, 2)] if b.out is not None else []
    own = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8) for t, _ in streams]
    widths = [t.element_size() for t, _ in streams]
    modes = (ctypes.c_int32 * len(own))(*[m for _, m in streams])
    widths_c = (ctypes.c_int32 * len(own))(*widths)

    def run_range(a: int, z: int):
        ptrs = (ctypes.c_void_p * len(own))(*[t.data_ptr() + a * w for t, w in zip(own, widths)])
        lib.lean_floor(ptrs, widths_c, modes, len(own), z - a)
    run = _split(b.numel, threads, run_range)
    return lambda: run() or own


def bench_optimizer(args) -> dict:
    n = int(args.params) // QBLOCK * QBLOCK
    cfg = OptimConfig(lr=1e-4, weight_decay=0.01)
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g16, c16, g32 = torch.randn(n).bfloat16(), torch.empty(n, dtype=torch.bfloat16), torch.randn(n)
    fns, moved, floors = {}, {}, {}  # name -> callable, bytes moved per parameter, the floor's name
    cached = {}  # "in cache, <kernel>" -> parameters updated per call
    ours = partial(adamw_parallel_, step=1, lr=1e-4, cfg=cfg, threads=args.optimizer_threads)
    fns["fp32/fp32 (bf16 grad -> bf16 copy)"] = lambda: ours(p, g16, m, v, c16)
    fns["fp32/fp32 (fp32 grad, the master is the copy: the fp32-compute default)"] = lambda: ours(p, g32, m, v, None)
    moved.update({name: 28 for name in fns})  # 2 + 24 + 2, or 4 + 24
    lib, keep = kernels.load(), []  # the anchors' parameters must outlive the timing
    if lib is not None:
        scratch = [torch.zeros(n), g16, torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)]
        # its own buffers: it adds g to v, which may go negative
        touch = _split(n, args.optimizer_threads, lambda a, z: lib.touch(*[t[a:].data_ptr() for t in scratch], z - a))
        fns["floor, 28 B/param"], moved["floor, 28 B/param"] = touch, 28
        floors.update({name: "floor, 28 B/param" for name in list(fns) if name.startswith("fp32/fp32")})
        for master, moments in MODES[1:]:
            b, name = _lean_buffers(n, master, moments), f"{master}/{moments} (bf16 grad)"
            dtype_master = "bf16" if master == "kahan" else master
            fns[name] = partial(lean_adamw_, b, 1, 1e-4, cfg, 1.0, seeds(0, 1, 0), args.optimizer_threads)
            moved[name] = update_bytes_per_param(torch.bfloat16, dtype_master, moments, "kahan" if master == "kahan" else "stochastic")
            fns[f"floor, {name}"], moved[f"floor, {name}"], floors[name] = _floor(lib, b, args.optimizer_threads), moved[name], f"floor, {name}"
            fns[f"in cache, {name}"], cached[f"in cache, {name}"] = _in_cache(cfg, master, moments)
            keep.append(b)
    for name, options in (("torch AdamW fused=True (fp32, no copy)", {"fused": True}),
                          ("torch AdamW default (fp32, no copy)", {})):
        param = torch.nn.Parameter(torch.randn(n))
        param.grad = torch.randn(n)
        keep.append(param)
        fns[name], moved[name] = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, **options).step, 28
        floors[name] = "floor, 28 B/param" if lib is not None else None
    deepspeed = _deepspeed_cpu_adam(n)
    if callable(deepspeed):
        name = "DeepSpeed CPUAdam (fp32, no copy)"
        fns[name], moved[name], floors[name] = deepspeed, 28, "floor, 28 B/param" if lib is not None else None
    wall, cpu = _alternating(fns, args.repeats)
    # Another thread's work shows in wall time only: with threads > 1 everything runs elsewhere (our
    # kernels and the floors on the pool, torch's intra-op threads), so time it all in wall time.
    elsewhere = set(fns) if args.optimizer_threads > 1 else set()
    result = {"params": n, "threads": torch.get_num_threads(), "our_threads": args.optimizer_threads, "kernels": {},
              "timing": "median CPU time of the calling thread (wall time where the work runs on other threads)"}
    seconds = {name: wall[name] if name in elsewhere else cpu[name] for name in fns}
    for name, t in seconds.items():
        if name in cached:
            continue
        floor = seconds.get(floors.get(name) or "", None)
        fraction = floor * moved[name] / moved[floors[name]] / t if floor else None
        result["kernels"][name] = {"seconds": t, "wall_seconds": wall[name], "ns_per_param": t / n * 1e9,
                                   "bytes_per_param": moved[name], "gb_per_s": moved[name] * n / t / 1e9,
                                   "fraction_of_floor": fraction}
        if f"in cache, {name}" in cached:  # compute alone: the most of the floor this arithmetic allows on one core
            compute = seconds[f"in cache, {name}"] / cached[f"in cache, {name}"]
            result["kernels"][name].update(in_cache_ns_per_param=compute * 1e9, compute_allows=min(1.0, floor / n / compute))
    result["deepspeed"] = "measured" if callable(deepspeed) else deepspeed
    return result


def _deepspeed_cpu_adam(n: int):
    """DeepSpeed CPUAdam's step over n fp32 parameters, or why it is not available."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        param = torch.nn.Parameter(torch.randn(n))
        param.grad = torch.randn(n)
        optimizer = DeepSpeedCPUAdam([param], lr=1e-4, weight_decay=0.01, adamw_mode=True)
        return lambda: optimizer.step() and param  # the closure keeps the parameter alive
    except Exception as error:  # noqa: BLE001 - not installed, or its C++ op cannot build here
        return f"not available: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"


# -- report ---------------------------------------------------------------------------------------


def table(results: dict) -> str:
    lines = []
    if "step" in results:
        s = results["step"]
        lines.append(f"step time, {s['blocks']}-block DiT3D, {s['params'] / 1e6:.1f} M params, {s['tokens']} tokens, "
                     f"{s['dtype']} on {s['device']} (medians; runners in {s.get('runners_in', 'one process, alternating')}); fastest resident: "
                     f"{s.get('fastest_resident')}")
        for name, seconds in s["median_s"].items():
            ratio = f"x{s['ratio_to_fastest_resident'][name]:.3f} of the fastest resident" if "ratio_to_fastest_resident" in s else ""
            mfu = f"MFU {s['mfu'][name]:.1%}" if "mfu" in s else ""
            peak = f"peak {s['peak_device_bytes'][name] / 2**30:.1f} GiB" if "peak_device_bytes" in s else ""
            host = f"host {s['engine'][name]['host_bytes_per_param']:.2f} B/param" if name in s["engine"] else ""
            cpu = f"process CPU {s['median_process_cpu_s'][name] * 1e3:.0f} ms" if "median_process_cpu_s" in s else ""
            lines.append(f"  {name:<32} {seconds * 1e3:9.1f} ms   {ratio} {cpu} {host} {mfu} {peak}")
        for name, ratio in s.get("ratio_to_resident_clipping", {}).items():
            lines.append(f"  {name:<32} x{ratio:.3f} of {CLIPPED[name]}")
        for name, ratio in s.get("ratio_to_copy_threads", {}).items():
            lines.append(f"  {name:<32} x{ratio:.3f} of the copying engine (process CPU x{s['cpu_ratio_to_copy_threads'][name]:.3f})")
        for name, e in s["engine"].items():
            lines.append(f"  {name:<32} optimizer {e['optimizer_s_per_step'] * 1e3:.1f} ms/step, exposed "
                         f"{e['exposed_optimizer_s_per_step'] * 1e3:.2f} ms ({e['exposed_fraction']:.1%}); "
                         f"transfer wait {e['exposed_transfer_s_per_step'] * 1e3:.2f} ms; copy threads busy "
                         f"{e['copy_thread_s_per_step'] * 1e3:.1f} ms")
    if "residency" in results:
        r = results["residency"]
        lines.append(f"transfer-bound: copies at {r['bandwidth_bytes_s'] / 1e9:.3g} GB/s")
        for name, seconds in r["median_s"].items():
            e = r["engine"][name]
            lines.append(f"  {name:<32} {seconds * 1e3:9.1f} ms   x{r['speedup'][name]:.2f} faster, "
                         f"{e['h2d_bytes_per_step'] / 1e6:.1f} MB up per step, transfer wait {e['exposed_transfer_s_per_step'] * 1e3:.1f} ms")
    if "wan" in results:
        lines += offload_wan.table(results["wan"])
    if "optimizer" in results:
        o = results["optimizer"]
        lines.append(f"AdamW step over {o['params'] / 1e6:.0f} M parameters, torch {o['threads']} thread(s), ours "
                     f"{o['our_threads']}; {o['timing']}")
        for name, k in o["kernels"].items():
            floor = f"{k['fraction_of_floor']:.0%} of its floor" if k["fraction_of_floor"] else ""
            if "in_cache_ns_per_param" in k:
                floor += f"; in cache {k['in_cache_ns_per_param']:.3f} ns/param: compute allows {k['compute_allows']:.0%}"
            lines.append(f"  {name:<44} {k['seconds'] * 1e3:8.2f} ms {k['ns_per_param']:6.3f} ns/param "
                         f"{k['bytes_per_param']:5.1f} B {k['gb_per_s']:6.1f} GB/s  {floor}")
        if o["deepspeed"] != "measured":
            lines.append(f"  DeepSpeed CPUAdam: {o['deepspeed']}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = {"machine": machine(), "args": vars(args)}
    if "step" not in args.skip:
        results["step"] = bench_step(args)
    if "residency" not in args.skip and torch.device(args.device).type == "cpu":
        results["residency"] = bench_residency(args)
    if "wan" not in args.skip:
        results["wan"] = bench_wan(args)
    if "optimizer" not in args.skip:
        results["optimizer"] = bench_optimizer(args)
    print(table(results))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "offload.json").write_text(json.dumps(results, indent=2))
    print(f"wrote {out / 'offload.json'}")
    return results


if __name__ == "__main__":
    main()
