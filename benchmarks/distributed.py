"""Data-parallel training: the offload engine with host state sharded over the ranks, its collectives
on an emulated link, against FSDP2 + CPUOffloadPolicy on the same ranks and model.

Every rank builds one copy of the model per case and runs one training step of each case in turn,
after a warm-up, so load drift hits all alike (median of the repeats; the slowest rank's numbers):
  overlapped   the engine as it runs: each block's gradient reduce-scatter travels under the backward
               of the blocks before it, each update's all-gather / node barrier under the next forward
  plain        the same engine waiting on every collective as soon as it is issued
  no link      overlapped with the link's delay off: the step without communication to hide, so
               exposed communication per step = step - this step
  one copy per rank   overlapped, each rank its own host compute copy (all-gathered over every rank)
  fsdp2 cpu offload   the anchor: FSDP2 per block with CPUOffloadPolicy (parameters and AdamW on the
               host, the optimizer after backward), same model, same rows (no emulated link: FSDP2's
               collectives cannot be delayed from outside, so compare it with `no link`). On a CPU
               device FSDP2 runs without the policy (it needs an accelerator): a smoke of the code only
Every engine collective is delayed as a link of --gbps and --latency-us would (`LinkDelay`).
Reported per case: step seconds, exposed communication (step - no-link step; on GPUs, where the link
is real, `plain` - `overlapped` and the engine's own waits: compute blocked on gradient buffers still
in flight and on updates not yet published), host bytes per rank and per node. JSON with the machine facts.

    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/distributed.py --quick
    OMP_NUM_THREADS=1 nice -n 19 .venv/bin/python benchmarks/distributed.py --ranks 4 --gbps 10
    torchrun --nproc-per-node 8 benchmarks/distributed.py --device cuda    # a multi-GPU node (benchmarks/gpu/distributed.sh)
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
import torch.distributed as dist  # noqa: E402

from slidefusion.models import build_model, preset  # noqa: E402
from slidefusion.offload import OffloadEngine, OffloadPolicy  # noqa: E402
from slidefusion.offload.engine.sharded import make_rank_groups  # noqa: E402
from slidefusion.optim import OptimConfig  # noqa: E402
from slidefusion.parallel import LinkDelay, spawn  # noqa: E402

MODELS = {"quick": dict(depth=4, hidden=128, heads=4, text_dim=32), "full": dict(depth=8, hidden=384, heads=6, text_dim=64)}
LATENTS = {"quick": (4, 8, 8), "full": (8, 16, 16)}
CASES = ("overlapped", "plain", "no link", "one copy per rank", "fsdp2 cpu offload")


def model_for(options: dict, device: torch.device):
    torch.manual_seed(0)
    model = build_model(preset("dit3d-small", **options["model"]))
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model


def batch(options: dict, step: int, rank: int, device: torch.device):
    """This rank's rows of the step's global batch."""
    g = torch.Generator().manual_seed(step)
    n, per = options["batch"] * options["world"], options["batch"]
    x = torch.randn(n, 3, *options["latent"], generator=g)[rank * per:(rank + 1) * per]
    t = torch.rand(n, generator=g)[rank * per:(rank + 1) * per]
    c = torch.randn(n, 12, options["model"]["text_dim"], generator=g)[rank * per:(rank + 1) * per]
    return x.to(device), t.to(device), c.to(device)


def loss_fn(options, step, rank, device):
    x, t, c = batch(options, step, rank, device)
    return lambda m: (m(x, t, c) - 0.5 * x).pow(2).mean()


def engine_case(name: str, options: dict, device: torch.device, local_world: int):
    link = None if name == "no link" else LinkDelay(options["latency_us"], options["gbps"])
    groups = make_rank_groups(local_world, name != "one copy per rank", 600, link=link, overlap=name != "plain")
    optim = OptimConfig(lr=1e-4, max_grad_norm=1.0, warmup_steps=0, ema_decay=None)
    policy = OffloadPolicy(device=str(device), compute_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                           optim=optim)
    model = model_for(options, device)
    engine = OffloadEngine(model, model.blocks, policy, ranks=groups)
    def facts() -> dict:
        stats = engine.stats
        return {"host_bytes_rank": stats.host_bytes_rank, "host_bytes_node": stats.host_bytes_node,
                "comm_bytes_per_step": stats.comm_bytes / max(1, stats.steps),
                "waited_s_per_step": (stats.exposed_comm_s + stats.exposed_optimizer_s) / max(1, stats.steps)}
    return engine.train_step, facts


def fsdp_case(options: dict, device: torch.device):
    from slidefusion.training.dist_optim import FsdpOptimizer

    model = model_for(options, device).to(device)
    optim = OptimConfig(lr=1e-4, max_grad_norm=1.0, warmup_steps=0, ema_decay=None)
    # CPUOffloadPolicy needs an accelerator to compute on: on a CPU device FSDP2 runs without it
    fsdp = FsdpOptimizer(model, list(model.blocks), optim, options["world"], device.type == "cuda", device)
    return fsdp.train_step, lambda: {}


def job(rank: int, world: int, options: dict) -> dict:
    torch.set_num_threads(options["threads"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if options["device"] == "cuda" else torch.device("cpu")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    runners = {name: engine_case(name, options, device, local_world) for name in CASES if name != "fsdp2 cpu offload"}
    runners["fsdp2 cpu offload"] = fsdp_case(options, device)
    times = {name: [] for name in runners}
    for step in range(options["warmup"] + options["repeats"]):
        for name, (train_step, _) in runners.items():  # alternate cases
            dist.barrier()
            start = time.perf_counter()
            train_step(loss_fn(options, step, rank, device))
            if device.type == "cuda":
                torch.cuda.synchronize()
            if step >= options["warmup"]:
                times[name].append(time.perf_counter() - start)
    rows = {name: {"step_s": statistics.median(times[name]), **facts()} for name, (_, facts) in runners.items()}
    base = rows["no link"]["step_s"]
    for name in ("overlapped", "plain", "one copy per rank"):
        rows[name]["exposed_comm_s"] = max(0.0, rows[name]["step_s"] - base)
    return rows


def report(results: list[dict], options: dict) -> None:
    rows = max(results, key=lambda r: r["overlapped"]["step_s"])  # the slowest rank
    print(f"\n{options['world']} ranks ({options['device']}), dit3d-small {options['model']}, latent {options['latent']}, "
          f"{options['batch']} per rank; link {options['gbps']} Gb/s + {options['latency_us']:.0f} us; "
          f"{options['repeats']} alternating steps after {options['warmup']}")
    print(f"{'case':<20} {'step s':>8} {'exposed comm s':>15} {'host MB/rank':>13} {'host MB/node':>13}")
    for name in CASES:
        r = rows[name]
        exposed = f"{r['exposed_comm_s']:.3f} ({r['exposed_comm_s'] / r['step_s']:.0%})" if "exposed_comm_s" in r else "-"
        host = [f"{r[k] / 1e6:.2f}" if k in r else "-" for k in ("host_bytes_rank", "host_bytes_node")]
        print(f"{name:<20} {r['step_s']:>8.3f} {exposed:>15} {host[0]:>13} {host[1]:>13}")
    if options["device"] == "cpu":
        print("(on a CPU device FSDP2 runs without CPUOffloadPolicy, which needs an accelerator: a smoke of the code)")
    print(f"engine overlapped / fsdp2 cpu offload (no link each): "
          f"{rows['no link']['step_s'] / rows['fsdp2 cpu offload']['step_s']:.2f}x the anchor's step time")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a small model, 2 repeats (a smoke run, about a minute)")
    parser.add_argument("--ranks", type=int, default=2, help="gloo ranks to spawn on this machine (CPU)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: run under torchrun, one rank per GPU")
    parser.add_argument("--gbps", type=float, default=1.0, help="emulated link, Gb/s (default 1)")
    parser.add_argument("--latency-us", type=float, default=200.0)
    parser.add_argument("--batch", type=int, default=1, help="samples per rank")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--out", default="outputs/benchmarks/distributed.json")
    args = parser.parse_args()
    size = "quick" if args.quick else "full"
    launched = "WORLD_SIZE" in os.environ
    options = {"model": MODELS[size], "latent": LATENTS[size], "batch": args.batch, "gbps": args.gbps,
               "latency_us": args.latency_us, "device": args.device, "warmup": 1,
               "repeats": args.repeats or (2 if args.quick else 7), "threads": 1 if args.device == "cpu" else 8,
               "world": int(os.environ["WORLD_SIZE"]) if launched else args.ranks}
    start = time.perf_counter()
    if launched:  # torchrun: this process is one rank
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(backend)
        mine = job(dist.get_rank(), dist.get_world_size(), options)
        results = [None] * dist.get_world_size()
        dist.all_gather_object(results, mine)
        if dist.get_rank() != 0:
            return
    else:
        results = spawn(job, args.ranks, options, timeout_s=900)
    report(results, options)
    machine = {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "load_average": os.getloadavg()}
    out = {"options": options, "ranks": results, "machine": machine, "seconds": time.perf_counter() - start}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(out, indent=1))
    tmp.replace(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
