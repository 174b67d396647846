"""`slidefusion plan`: the memory planner on the command line (registered by slidefusion.cli)."""

import argparse

from slidefusion.errors import UserError


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    plan = subparsers.add_parser("plan", help="memory plan of offloaded training: does it fit, how fast")
    plan.add_argument("--model", required=True, metavar="PRESET|DIR",
                      help="a preset (wan2.1-1.3b, wan2.1-14b, dit3d-105b, ...) or a diffusers transformer folder")
    plan.add_argument("--frames", type=int, required=True, help="video frames (pixels)")
    plan.add_argument("--height", type=int, required=True, help="video height in pixels")
    plan.add_argument("--width", type=int, required=True, help="video width in pixels")
    plan.add_argument("--attention", choices=["dense", "flash", "window", "slide"],
                      help="self-attention operator (default: the model's own; Wan: flash)")
    plan.add_argument("--gpu-memory", default="141GB", help="device memory (default 141GB, an H200)")
    plan.add_argument("--host-memory", default="1.5TB", help="host memory (default 1.5TB)")
    plan.add_argument("--pcie", default="55GB/s", help="host<->device bandwidth (default 55GB/s)")
    plan.add_argument("--tflops", type=float, default=990.0, help="dense bf16 TFLOP/s of the device (default 990, an H200)")
    plan.add_argument("--host-bandwidth", default="20GB/s", help="host memory bandwidth of the optimizer threads (default 20GB/s)")
    plan.add_argument("--master", choices=["fp32", "bf16"], default="fp32", help="master weights on the host (offload.master)")
    plan.add_argument("--moments", choices=["fp32", "bf16", "int8"], default="fp32", help="AdamW moments on the host (offload.moments)")
    plan.add_argument("--resident-blocks", default="0", metavar="N|auto", help="blocks kept on the device (offload.resident_blocks)")
    plan.add_argument("--batch", type=int, default=1)
    plan.add_argument("--prefetch", type=int, default=1)
    plan.add_argument("--vae-stride", default="4,8,8", help="autoencoder stride t,h,w (default 4,8,8)")
    plan.set_defaults(func=cmd_plan)
    return plan


def _plan_inputs(args):
    """(model shape, VAE stride, the sizes plan_training takes) from the flags, or a UserError."""
    from slidefusion.offload.planner import model_shape, parse_bytes

    for name in ("frames", "height", "width", "batch"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name}={getattr(args, name)} must be >= 1")
    try:
        stride = tuple(int(s) for s in args.vae_stride.split(","))
    except ValueError:
        stride = ()
    if len(stride) != 3 or min(stride) < 1:
        raise UserError(f"--vae-stride={args.vae_stride!r} must be three ints >= 1, e.g. 4,8,8")
    resident = args.resident_blocks
    if resident != "auto" and not (resident.isdigit()):
        raise UserError(f"--resident-blocks={resident!r} must be an int >= 0 or auto")
    sizes = {"gpu_memory": parse_bytes(args.gpu_memory, "--gpu-memory"), "host_memory": parse_bytes(args.host_memory, "--host-memory"),
             "pcie_bytes_s": parse_bytes(args.pcie, "--pcie"), "tflops": args.tflops, "prefetch": args.prefetch,
             "master": args.master, "moments": args.moments, "resident_blocks": resident if resident == "auto" else int(resident),
             "host_bytes_s": parse_bytes(args.host_bandwidth, "--host-bandwidth")}
    return model_shape(args.model), stride, sizes


def cmd_plan(args) -> None:
    from slidefusion.offload.planner import Workload, largest_frames, plan_training, report, tokens_for

    shape, stride, sizes = _plan_inputs(args)
    attention = args.attention or shape.attention
    work = Workload(args.batch, tokens_for(args.frames, args.height, args.width, shape.patch, stride), attention)
    plan = plan_training(shape, work, **sizes)
    print(report(plan, f"{args.model}: {args.frames} frames at {args.width}x{args.height}, {attention} attention, "
                       f"batch {args.batch}; master {args.master}, moments {args.moments}"))
    if args.tflops == 990.0 and args.pcie == "55GB/s":
        print("  assumption: 990 TFLOP/s and 55 GB/s PCIe are an H200's; pass --tflops and --pcie for your GPU "
              "(an RTX 4090: about 165 dense bf16 TFLOP/s, 25 GB/s)")
    if not plan.fits:
        lean = plan_training(shape, work, **{**sizes, "master": "bf16", "moments": "int8"})
        if lean.fits and (args.master, args.moments) != ("bf16", "int8"):
            print("  with --master bf16 --moments int8 it fits (host state ~4 B/param)")
        frames = largest_frames(shape, work, args.frames, args.height, args.width, stride, sizes)
        print(f"  largest clip that fits at {args.width}x{args.height}: "
              + (f"{frames} frames" if frames else "none (even one latent frame does not fit)"))


def add_offload_options(train: argparse.ArgumentParser) -> None:
    """`slidefusion train --offload [--device D]`: shorthands for config overrides."""
    train.add_argument("--offload", action="store_true",
                       help="train with the offload engine: weights and AdamW state in host memory (offload.enabled=true)")
    train.add_argument("--device", help="training device, e.g. cuda or cpu (run.device=...)")


def offload_overrides(args) -> list[str]:
    """The config overrides the flags stand for; explicit key=value overrides come first, flags win."""
    overrides = ["offload.enabled=true"] if getattr(args, "offload", False) else []
    return overrides + ([f"run.device={args.device}"] if getattr(args, "device", None) else [])
