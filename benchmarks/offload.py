"""Offload engine benchmark: step time offloaded vs resident, CPU AdamW throughput, exposure.

Three measurements, side by side in one run, alternating, after warm-up, medians quoted:
  step        one training step of a >= 8-block DiT3D: resident (torch AdamW as the trainer
              uses it, and with fused=True) vs offloaded
              (OffloadEngine), both with activation checkpointing at every block boundary, the
              resident one through torch.utils.checkpoint hooks on the unchanged model. Also the
              engine with max_grad_norm (deferred updates) and, on CUDA, without async prefetch.
  optimizer   one AdamW step over N parameters: our fast and exact kernels (bf16 / fp32 gradients
              in, compute copy out), torch's fused CPU AdamW, torch's default AdamW, DeepSpeed's
              CPUAdam when importable, and the bandwidth floor (a kernel moving the same bytes as
              ours, with no arithmetic).
  exposure    optimizer seconds the compute thread waited for, as a fraction of optimizer seconds.
Writes a table on stdout and JSON (with the machine facts) to OUT/offload.json.

    python benchmarks/offload.py --quick            # smoke run, ~1 minute on 2 cores
    python benchmarks/offload.py                    # the CPU numbers
    python benchmarks/offload.py --device cuda --dtype bfloat16 --hidden 2048 --depth 16 ...
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slidefusion.models import build_model, preset
from slidefusion.offload import OffloadEngine, OffloadPolicy, kernels
from slidefusion.offload.adam import adamw_parallel_
from slidefusion.optim import OptimConfig

RUNNERS = {"resident": None, "resident, fused AdamW": None, "offloaded": {}, "offloaded+clip": {"max_grad_norm": 1.0},
           "offloaded, no prefetch": {"prefetch": 0}}


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
    p.add_argument("--skip", nargs="*", default=[], choices=["step", "optimizer"], help="sections to leave out")
    p.add_argument("--runners", nargs="*", default=list(RUNNERS), choices=list(RUNNERS),
                   help="step-time runners (each engine holds its own host state: leave some out for big models)")
    p.add_argument("--optimizer-threads", type=int, default=1, help="threads for our kernels in the optimizer section")
    p.add_argument("--out", default="runs/benchmarks/offload", help="folder for offload.json")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.heads, args.latent, args.repeats, args.steps_per_round, args.params = 128, 4, "2x8x8", 3, 2, 2e6
    return args


def machine() -> dict:
    cpu = platform.processor()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        cpu = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    facts = {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
             "python": platform.python_version(), "c_kernels": kernels.load() is not None}
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


def _checkpoint_blocks(model) -> None:
    """The resident baseline's checkpointing: the same block boundaries, set from outside."""
    for block in model.blocks:
        block.forward = partial(checkpoint, block.forward, use_reentrant=False)


class Resident:
    def __init__(self, model, device, dtype, fused=None):
        self.model, self.dtype, self.device = model.to(device), dtype, torch.device(device)
        _checkpoint_blocks(model)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)

    def train_step(self, loss_fn) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            loss = loss_fn(self.model)
        loss.backward()
        self.optimizer.step()
        return loss.item()


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def bench_step(args) -> dict:
    dtype = getattr(torch, args.dtype)
    batch = _batch(args, args.device)
    runners = {}
    for name in args.runners:
        if name.startswith("resident"):
            runners[name] = Resident(_model(args), args.device, dtype, fused=True if "fused" in name else None)
        elif not name.endswith("no prefetch") or torch.device(args.device).type == "cuda":
            model = _model(args)  # (on CPU "no prefetch" shows nothing: copies and compute share cores)
            options = dict(RUNNERS[name])
            optim = OptimConfig(lr=1e-4, max_grad_norm=options.pop("max_grad_norm", None), warmup_steps=0, ema_decay=None)
            policy = OffloadPolicy(device=args.device, compute_dtype=dtype, optim=optim, **options)
            runners[name] = OffloadEngine(model, model.blocks, policy)
    times, peak = {name: [] for name in runners}, {name: 0 for name in runners}
    cuda = torch.device(args.device).type == "cuda"
    for repeat in range(args.repeats + 1):  # alternate the runners; the first round warms up
        for name, runner in runners.items():
            _sync(args.device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            start = time.perf_counter()
            for _ in range(args.steps_per_round):  # consecutive steps: the engine's deferred updates
                runner.train_step(lambda m: _loss(m, batch))  # overlap its own next step, as in training
            if isinstance(runner, OffloadEngine):
                runner.synchronize()  # ... and none leaks into the next runner's time
            _sync(args.device)
            if repeat >= 1:
                times[name].append((time.perf_counter() - start) / args.steps_per_round)
            if cuda:
                peak[name] = max(peak[name], torch.cuda.max_memory_allocated())
    params = sum(p.numel() for p in next(iter(runners.values())).model.parameters())
    t, h, w = (int(s) for s in args.latent.split("x"))
    per_sample = t * (h // 2) * (w // 2)
    tokens = args.batch * per_sample
    result = {"params": params, "blocks": args.depth, "tokens": tokens, "dtype": args.dtype, "device": args.device,
              "checkpointing": "every block boundary, both", "median_s": {}, "engine": {}}
    for name, samples in times.items():
        result["median_s"][name] = statistics.median(samples)
    for name, runner in runners.items():
        if isinstance(runner, OffloadEngine):
            stats = runner.stats
            result["engine"][name] = {
                "optimizer_s_per_step": stats.optimizer_s / stats.steps,
                "exposed_optimizer_s_per_step": stats.exposed_optimizer_s / stats.steps,
                "exposed_fraction": stats.exposed_optimizer_s / max(stats.optimizer_s, 1e-12),
                "exposed_transfer_s_per_step": stats.exposed_transfer_s / stats.steps,
                "h2d_bytes_per_step": stats.h2d_bytes / stats.steps, "d2h_bytes_per_step": stats.d2h_bytes / stats.steps,
                "peak_device_param_bytes": stats.peak_device_param_bytes}
            runner.close()
    base = result["median_s"].get("resident")
    result["ratio_to_resident"] = {name: s / base for name, s in result["median_s"].items()} if base else {}
    fused = result["median_s"].get("resident, fused AdamW")
    result["ratio_to_resident_fused"] = {name: s / fused for name, s in result["median_s"].items()} if fused else {}
    # Model FLOPs (recompute not counted, as MFU does): 6 per parameter and token, plus dense self-
    # attention's 4 N^2 C per block forward, x3 for forward + backward.
    flops = 6 * params * tokens + 12 * args.depth * args.batch * per_sample ** 2 * args.hidden
    result["flops_per_step"] = flops
    if cuda:
        result["peak_device_bytes"] = peak
    if args.peak_tflops:
        result["mfu"] = {name: flops / s / (args.peak_tflops * 1e12) for name, s in result["median_s"].items()}
    return result


# -- optimizer throughput -------------------------------------------------------------------------


def _alternating(fns: dict, repeats: int) -> dict:
    """Median seconds of each callable, timed in alternating rounds after one warm-up call each."""
    for fn in fns.values():
        fn()  # page in, build kernels
    samples = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}


def bench_optimizer(args) -> dict:
    n = int(args.params)
    cfg = OptimConfig(lr=1e-4, weight_decay=0.01)
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    g16, c16, g32, c32 = torch.randn(n).bfloat16(), torch.empty(n, dtype=torch.bfloat16), torch.randn(n), torch.empty(n)
    fns, moved = {}, {}  # name -> callable, bytes moved per parameter
    ours = partial(adamw_parallel_, step=1, lr=1e-4, cfg=cfg, threads=args.optimizer_threads)
    fns["ours fast (bf16 grad -> bf16 copy)"] = lambda: ours(p, g16, m, v, c16, exact=False)
    fns["ours exact (fp32 grad -> fp32 copy)"] = lambda: ours(p, g32, m, v, c32, exact=True)
    fns["ours fast (fp32 grad -> fp32 copy)"] = lambda: ours(p, g32, m, v, c32, exact=False)
    moved.update({name: 28 if "bf16" in name else 32 for name in fns})
    keep = []  # the anchors' parameters must outlive the timing
    for name, options in (("torch AdamW fused=True (fp32, no copy)", {"fused": True}),
                          ("torch AdamW default (fp32, no copy)", {})):
        param = torch.nn.Parameter(torch.randn(n))
        param.grad = torch.randn(n)
        keep.append(param)
        fns[name], moved[name] = torch.optim.AdamW([param], lr=1e-4, weight_decay=0.01, **options).step, 28
    deepspeed = _deepspeed_cpu_adam(n)
    if callable(deepspeed):
        fns["DeepSpeed CPUAdam (fp32, no copy)"], moved["DeepSpeed CPUAdam (fp32, no copy)"] = deepspeed, 28
    lib = kernels.load()
    floor_name = "bandwidth floor (same 28 B/param, no math)"
    if lib is not None:
        scratch = [torch.zeros(n), g16, torch.zeros(n), torch.zeros(n), torch.empty(n, dtype=torch.bfloat16)]
        ptrs = [t.data_ptr() for t in scratch]  # its own buffers: it adds g to v, which may go negative
        fns[floor_name], moved[floor_name] = (lambda: lib.touch(*ptrs, n)), 28
    seconds = _alternating(fns, args.repeats)
    floor = seconds.get(floor_name)
    result = {"params": n, "threads": torch.get_num_threads(), "our_threads": args.optimizer_threads, "kernels": {}}
    for name, t in seconds.items():
        result["kernels"][name] = {"seconds": t, "ns_per_param": t / n * 1e9, "bytes_per_param": moved[name],
                                   "gb_per_s": moved[name] * n / t / 1e9,
                                   "fraction_of_floor": (floor * moved[name] / 28 / t) if floor else None}
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
                     f"{s['dtype']} on {s['device']} (median of the alternating runs)")
        for name, seconds in s["median_s"].items():
            ratio = f"x{s['ratio_to_resident'][name]:.3f} of resident" if s["ratio_to_resident"] else ""
            if s["ratio_to_resident_fused"]:
                ratio += f", x{s['ratio_to_resident_fused'][name]:.3f} of fused"
            mfu = f"MFU {s['mfu'][name]:.1%}" if "mfu" in s else ""
            peak = f"peak {s['peak_device_bytes'][name] / 2**30:.1f} GiB" if "peak_device_bytes" in s else ""
            lines.append(f"  {name:<28} {seconds * 1e3:9.1f} ms   {ratio} {mfu} {peak}")
        for name, e in s["engine"].items():
            lines.append(f"  {name:<28} optimizer {e['optimizer_s_per_step'] * 1e3:.1f} ms/step, exposed "
                         f"{e['exposed_optimizer_s_per_step'] * 1e3:.2f} ms ({e['exposed_fraction']:.1%}); "
                         f"transfer wait {e['exposed_transfer_s_per_step'] * 1e3:.2f} ms")
    if "optimizer" in results:
        o = results["optimizer"]
        lines.append(f"AdamW step over {o['params'] / 1e6:.0f} M parameters, torch {o['threads']} thread(s), ours {o['our_threads']}")
        for name, k in o["kernels"].items():
            floor = f"{k['fraction_of_floor']:.0%} of floor" if k["fraction_of_floor"] else ""
            lines.append(f"  {name:<44} {k['seconds'] * 1e3:8.2f} ms {k['ns_per_param']:6.3f} ns/param "
                         f"{k['gb_per_s']:6.1f} GB/s  {floor}")
        if o["deepspeed"] != "measured":
            lines.append(f"  DeepSpeed CPUAdam: {o['deepspeed']}")
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = {"machine": machine(), "args": vars(args)}
    if "step" not in args.skip:
        results["step"] = bench_step(args)
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
