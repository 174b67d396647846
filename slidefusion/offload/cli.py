"""`slidefusion plan`: the memory planner on the command line (registered by slidefusion.cli)."""

import argparse

from slidefusion import cli_args as types
from slidefusion.errors import UserError

DEFAULT_PCIE, DEFAULT_TFLOPS = "55GB/s", 990.0  # an H200 on PCIe 5 x16


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    plan = subparsers.add_parser("plan", help="memory plan of offloaded training: does it fit, how fast")
    plan.add_argument("--model", required=True, metavar="PRESET|DIR", type=types.text,
                      help="a preset (wan2.1-1.3b, wan2.1-14b, dit3d-105b, ...) or a diffusers transformer folder")
    plan.add_argument("--frames", type=types.positive_int, required=True, help="video frames (pixels)")
    plan.add_argument("--height", type=types.positive_int, required=True, help="video height in pixels")
    plan.add_argument("--width", type=types.positive_int, required=True, help="video width in pixels")
    plan.add_argument("--attention", choices=["dense", "flash", "window", "slide"],
                      help="self-attention operator (default: the model's own; Wan: flash)")
    plan.add_argument("--gpu-memory", type=types.byte_size, default="141GB", help="device memory (default 141GB, an H200)")
    plan.add_argument("--host-memory", type=types.byte_size, default="1.5TB",
                      help="host memory (default 1.5TB); with --gpus, per node")
    plan.add_argument("--pcie", type=types.bandwidth, default=DEFAULT_PCIE, help=f"host<->device bandwidth (default {DEFAULT_PCIE})")
    plan.add_argument("--tflops", type=types.number(0, low_open=True), default=DEFAULT_TFLOPS,
                      help=f"dense bf16 TFLOP/s of the device (default {DEFAULT_TFLOPS:g}, an H200)")
    plan.add_argument("--host-bandwidth", type=types.bandwidth, default="20GB/s",
                      help="host memory bandwidth of the optimizer threads (default 20GB/s)")
    plan.add_argument("--master", choices=["fp32", "bf16"], default="fp32", help="master weights on the host (offload.master)")
    plan.add_argument("--moments", choices=["fp32", "bf16", "int8"], default="fp32", help="AdamW moments on the host (offload.moments)")
    plan.add_argument("--resident-blocks", type=types.arg_type("resident-blocks", _resident), default="0", metavar="N|auto",
                      help="blocks kept on the device (offload.resident_blocks)")
    _add_activation_flags(plan)
    _add_cluster_flags(plan)
    plan.add_argument("--batch", type=types.positive_int, default=1, help="samples per step (with --gpus: per data-parallel rank)")
    plan.add_argument("--prefetch", type=types.natural_int, default=1, help="blocks uploading ahead (default 1)")
    plan.add_argument("--vae-stride", type=types.int_list(3), default="4,8,8",
                      help="autoencoder stride t,h,w (default 4,8,8)")
    plan.set_defaults(func=cmd_plan)
    return plan


def _add_activation_flags(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--tile", type=types.arg_type("tile", _tile), default="auto", metavar="N|auto|off",
                      help="frames of the token grid per tile inside a block (offload.tile; default auto: "
                           "whole blocks if they fit, else the largest tile that does)")
    plan.add_argument("--disk", type=types.byte_size, help="free disk for spilled checkpoints (offload.spill_dir); default: none")
    plan.add_argument("--disk-bandwidth", type=types.bandwidth, default="3GB/s",
                      help="read/write bandwidth of that disk (default 3GB/s, one NVMe drive)")


def _add_cluster_flags(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--gpus", type=types.positive_int, help="GPUs per node (torchrun --nproc-per-node): plan a "
                      "data-parallel run with the offload engine's state sharded over the ranks")
    plan.add_argument("--nodes", type=types.positive_int, default=1, help="nodes (torchrun --nnodes; default 1)")
    plan.add_argument("--interconnect", type=types.number(0, low_open=True), metavar="GBPS",
                      help="collective bandwidth per GPU in Gbit/s (default: 3600, NVLink, on one node; 400 across nodes)")
    plan.add_argument("--sp", type=types.positive_int, default=1, help="ranks per sample (parallel.sp; default 1)")
    plan.add_argument("--one-host-copy-per-rank", action="store_true",
                      help="each rank its own host compute copy (parallel.shared_host=false)")


def _tile(text: str) -> int | str | None:
    if text in ("auto", "off"):
        return None if text == "off" else text
    if not text.isdigit() or int(text) < 1:
        raise UserError(f"--tile={text!r} must be a number of frames >= 1, auto or off")
    return int(text)


def _resident(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit():
        raise UserError(f"--resident-blocks={text!r} must be an int >= 0 or auto")
    return int(text)


def cmd_plan(args) -> None:
    from slidefusion.offload.planner import Workload, grid_for, human, largest_frames, model_shape, plan_training, report

    shape, stride = model_shape(args.model), args.vae_stride
    sizes = {"gpu_memory": args.gpu_memory, "host_memory": args.host_memory, "pcie_bytes_s": args.pcie,
             "tflops": args.tflops, "prefetch": args.prefetch, "master": args.master, "moments": args.moments,
             "resident_blocks": args.resident_blocks, "host_bytes_s": args.host_bandwidth, "tile": args.tile,
             "disk": args.disk, "disk_bytes_s": args.disk_bandwidth}
    attention = args.attention or shape.attention
    grid = grid_for(args.frames, args.height, args.width, shape.patch, stride)
    work = Workload(args.batch, grid[0] * grid[1] * grid[2], attention, frames=grid[0])
    if args.gpus is not None:
        return _plan_cluster(args, shape, work, grid, sizes)
    if args.nodes != 1 or args.sp != 1 or args.interconnect is not None or args.one_host_copy_per_rank:
        raise UserError("--nodes, --sp, --interconnect and --one-host-copy-per-rank plan a multi-GPU run: add --gpus N")
    plan = plan_training(shape, work, **sizes)
    print(report(plan, f"{args.model}: {args.frames} frames at {args.width}x{args.height} ({grid[0]}x{grid[1]}x{grid[2]} "
                       f"tokens), {attention} attention, batch {args.batch}; master {args.master}, moments {args.moments}"))
    print(f"  at 100% of {args.tflops:g} TFLOP/s the step's {plan.flops:.3g} FLOP take {plan.flops / (args.tflops * 1e12):.3g} s; "
          f"a step in 1 s would need {plan.flops / 1e15:.3g} PFLOP/s")
    if args.tflops == DEFAULT_TFLOPS and args.pcie == types.bandwidth(DEFAULT_PCIE):
        print(f"  assumption: {DEFAULT_TFLOPS:g} TFLOP/s and {DEFAULT_PCIE} PCIe are an H200's; pass --tflops and --pcie "
              "for your GPU (an RTX 4090: about 165 dense bf16 TFLOP/s, 25 GB/s)")
    if not plan.fits:
        lean = plan_training(shape, work, **{**sizes, "master": "bf16", "moments": "int8"})
        if lean.fits and (args.master, args.moments) != ("bf16", "int8"):
            print("  with --master bf16 --moments int8 it fits (host state ~4 B/param)")
        spilled = plan_training(shape, work, **{**sizes, "disk": 10**18})
        if args.disk is None and spilled.fits:
            print(f"  with checkpoints spilled to a disk (--disk, offload.spill_dir) of {human(sum(spilled.disk.values()))} "
                  "or more it fits")
        frames = largest_frames(shape, work, args.frames, args.height, args.width, stride, sizes)
        print(f"  largest clip that fits at {args.width}x{args.height}: "
              + (f"{frames} frames" if frames else "none (even one latent frame does not fit)"))


def _plan_cluster(args, shape, work, grid, sizes: dict) -> None:
    from slidefusion.offload.plan_distributed import Cluster, plan_cluster, report_cluster

    if args.sp > shape.heads:
        raise UserError(f"--sp {args.sp} is more than the {shape.heads} attention heads of {args.model} "
                        "(Ulysses splits heads over the ranks of a sample)")
    cluster = Cluster(args.gpus, args.nodes, args.sp, None if args.interconnect is None else args.interconnect * 1e9 / 8,
                      shared=not args.one_host_copy_per_rank)
    host = sizes.pop("host_memory")
    plan = plan_cluster(shape, work, cluster, host, **sizes)
    print(report_cluster(plan, f"{args.model}: {args.frames} frames at {args.width}x{args.height} ({grid[0]}x{grid[1]}x"
                               f"{grid[2]} tokens), {work.attention} attention, {args.batch} per data-parallel rank; "
                               f"master {args.master}, moments {args.moments}, offload engine"))


def add_offload_options(train: argparse.ArgumentParser) -> None:
    """`slidefusion train --offload [--device D]`: shorthands for config overrides."""
    train.add_argument("--offload", action="store_true",
                       help="train with the offload engine: weights and AdamW state in host memory (offload.enabled=true)")
    train.add_argument("--device", type=types.device, help="training device, e.g. cuda or cpu (run.device=...)")


def offload_overrides(args) -> list[str]:
    """The config overrides the flags stand for; explicit key=value overrides come first, flags win."""
    overrides = ["offload.enabled=true"] if getattr(args, "offload", False) else []
    return overrides + ([f"run.device={args.device}"] if getattr(args, "device", None) else [])
