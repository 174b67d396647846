"""`slidefusion plan`: the memory planner on the command line (registered by slidefusion.cli)."""

import argparse

from slidefusion import cli_args as types


def add_plan_parser(subparsers) -> argparse.ArgumentParser:
    plan = subparsers.add_parser("plan", help="memory plan of offloaded training: does it fit, how fast")
    plan.add_argument("--model", required=True, metavar="PRESET", type=types.model_preset,
                      help="model preset, e.g. dit3d-105b")
    plan.add_argument("--frames", type=types.positive_int, required=True, help="video frames (pixels)")
    plan.add_argument("--height", type=types.positive_int, required=True, help="video height in pixels")
    plan.add_argument("--width", type=types.positive_int, required=True, help="video width in pixels")
    plan.add_argument("--attention", choices=["dense", "window", "slide"], required=True)
    plan.add_argument("--gpu-memory", type=types.byte_size, default="141GB", help="device memory (default 141GB, an H200)")
    plan.add_argument("--host-memory", type=types.byte_size, default="1.5TB", help="host memory (default 1.5TB)")
    plan.add_argument("--pcie", type=types.bandwidth, default="55GB/s", help="host<->device bandwidth (default 55GB/s)")
    plan.add_argument("--tflops", type=types.number(0, low_open=True), default=990.0,
                      help="dense bf16 TFLOP/s of the device (default 990)")
    plan.add_argument("--batch", type=types.positive_int, default=1)
    plan.add_argument("--prefetch", type=types.natural_int, default=1, help="blocks uploading ahead (default 1)")
    plan.add_argument("--vae-stride", type=types.int_list(3), default="4,8,8",
                      help="autoencoder stride t,h,w (default 4,8,8)")
    plan.set_defaults(func=cmd_plan)
    return plan


def cmd_plan(args) -> None:
    from slidefusion.models import preset
    from slidefusion.offload.planner import (
        Workload,
        largest_frames,
        plan_training,
        report,
        tokens_for,
    )

    stride = args.vae_stride
    config = preset(args.model)
    tokens = tokens_for(args.frames, args.height, args.width, config.patch_size, stride)
    sizes = {"gpu_memory": args.gpu_memory, "host_memory": args.host_memory,
             "pcie_bytes_s": args.pcie, "tflops": args.tflops, "prefetch": args.prefetch}
    work = Workload(args.batch, tokens, args.attention)
    plan = plan_training(config, work, **sizes)
    print(report(plan, f"{args.model}: {args.frames} frames at {args.width}x{args.height}, {args.attention} attention, "
                       f"batch {args.batch}"))
    if not plan.fits:
        frames = largest_frames(config, work, args.frames, args.height, args.width, stride, sizes)
        print(f"  largest clip that fits at {args.width}x{args.height}: "
              + (f"{frames} frames" if frames else "none (even one latent frame does not fit)"))


def add_offload_options(train: argparse.ArgumentParser) -> None:
    """`slidefusion train --offload [--device D]`: shorthands for config overrides."""
    train.add_argument("--offload", action="store_true",
                       help="train with the offload engine: weights and AdamW state in host memory (offload.enabled=true)")
    train.add_argument("--device", type=types.device, help="training device, e.g. cuda or cpu (run.device=...)")


def offload_overrides(args) -> list[str]:
    """The config overrides the flags stand for; explicit key=value overrides come first, flags win."""
    overrides = ["offload.enabled=true"] if getattr(args, "offload", False) else []
    return overrides + ([f"run.device={args.device}"] if getattr(args, "device", None) else [])
