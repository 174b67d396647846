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
    plan.add_argument("--host-memory", type=types.byte_size, default="1.5TB", help="host memory (default 1.5TB)")
    plan.add_argument("--pcie", type=types.bandwidth, default=DEFAULT_PCIE, help=f"host<->device bandwidth (default {DEFAULT_PCIE})")
    plan.add_argument("--tflops", type=types.number(0, low_open=True), default=DEFAULT_TFLOPS,
                      help=f"dense bf16 TFLOP/s of the device (default {DEFAULT_TFLOPS:g}, an H200)")
    plan.add_argument("--host-bandwidth", type=types.bandwidth, default="20GB/s",
                      help="host memory bandwidth of the optimizer threads (default 20GB/s)")
    plan.add_argument("--master", choices=["fp32", "bf16"], default="fp32", help="master weights on the host (offload.master)")
    plan.add_argument("--moments", choices=["fp32", "bf16", "int8"], default="fp32", help="AdamW moments on the host (offload.moments)")
    plan.add_argument("--resident-blocks", type=types.arg_type("resident-blocks", _resident), default="0", metavar="N|auto",
                      help="blocks kept on the device (offload.resident_blocks)")
    plan.add_argument("--batch", type=types.positive_int, default=1)
    plan.add_argument("--prefetch", type=types.natural_int, default=1, help="blocks uploading ahead (default 1)")
    plan.add_argument("--vae-stride", type=types.int_list(3), default="4,8,8",
                      help="autoencoder stride t,h,w (default 4,8,8)")
    plan.set_defaults(func=cmd_plan)
    return plan


def _resident(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit():
        raise UserError(f"--resident-blocks={text!r} must be an int >= 0 or auto")
    return int(text)


def cmd_plan(args) -> None:
    from slidefusion.offload.planner import Workload, largest_frames, model_shape, plan_training, report, tokens_for

    shape, stride = model_shape(args.model), args.vae_stride
    sizes = {"gpu_memory": args.gpu_memory, "host_memory": args.host_memory, "pcie_bytes_s": args.pcie,
             "tflops": args.tflops, "prefetch": args.prefetch, "master": args.master, "moments": args.moments,
             "resident_blocks": args.resident_blocks, "host_bytes_s": args.host_bandwidth}
    attention = args.attention or shape.attention
    work = Workload(args.batch, tokens_for(args.frames, args.height, args.width, shape.patch, stride), attention)
    plan = plan_training(shape, work, **sizes)
    print(report(plan, f"{args.model}: {args.frames} frames at {args.width}x{args.height}, {attention} attention, "
                       f"batch {args.batch}; master {args.master}, moments {args.moments}"))
    if args.tflops == DEFAULT_TFLOPS and args.pcie == types.bandwidth(DEFAULT_PCIE):
        print(f"  assumption: {DEFAULT_TFLOPS:g} TFLOP/s and {DEFAULT_PCIE} PCIe are an H200's; pass --tflops and --pcie "
              "for your GPU (an RTX 4090: about 165 dense bf16 TFLOP/s, 25 GB/s)")
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
    train.add_argument("--device", type=types.device, help="training device, e.g. cuda or cpu (run.device=...)")


def offload_overrides(args) -> list[str]:
    """The config overrides the flags stand for; explicit key=value overrides come first, flags win."""
    overrides = ["offload.enabled=true"] if getattr(args, "offload", False) else []
    return overrides + ([f"run.device={args.device}"] if getattr(args, "device", None) else [])
