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
    plan.add_argument("--gpu-memory", type=types.byte_size, default="141GB", help="device memory with its unit, e.g. 24GB or 24GiB (default 141GB, an H200; a bare number is refused)")
    plan.add_argument("--host-memory", type=types.byte_size, default="1.5TB", help="host memory with its unit, e.g. 128GB (default 1.5TB)")
    plan.add_argument("--pcie", type=types.bandwidth, default=DEFAULT_PCIE, help=f"host<->device bandwidth with its unit, e.g. 25GB/s (default {DEFAULT_PCIE})")
    plan.add_argument("--tflops", type=types.number(0, low_open=True), default=DEFAULT_TFLOPS,
                      help=f"dense bf16 TFLOP/s of the device (default {DEFAULT_TFLOPS:g}, an H200)")
    plan.add_argument("--host-bandwidth", type=types.bandwidth, default="20GB/s",
                      help="host memory bandwidth of the optimizer threads (default 20GB/s)")
    plan.add_argument("--master", choices=["fp32", "bf16"], default="fp32", help="master weights on the host (offload.master)")
    plan.add_argument("--moments", choices=["fp32", "bf16", "int8"], default="fp32", help="AdamW moments on the host (offload.moments)")
    plan.add_argument("--resident-blocks", type=types.arg_type("resident-blocks", _resident), default="0", metavar="N|auto",
                      help="blocks kept on the device (offload.resident_blocks)")
    _add_activation_flags(plan)
    plan.add_argument("--batch", type=types.positive_int, default=1)
    plan.add_argument("--prefetch", type=types.natural_int, default=1, help="blocks uploading ahead (default 1)")
    plan.add_argument("--vae-stride", type=types.int_list(3), default="4,8,8",
                      help="autoencoder stride t,h,w (default 4,8,8)")
    plan.set_defaults(func=cmd_plan)
    return plan


def _add_activation_flags(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--tile", type=types.arg_type("tile", _tile), default="auto", metavar="N|auto|off",
                      help="frames of the token grid per tile inside a block (offload.tile; default auto: "
                           "whole blocks if they fit, else the largest tile that does)")
    plan.add_argument("--disk", type=types.byte_size, help="free disk for spilled checkpoints (offload.spill_dir) with its unit, e.g. 2TB; default: none")
    plan.add_argument("--disk-bandwidth", type=types.bandwidth, default="3GB/s",
                      help="read/write bandwidth of that disk (default 3GB/s, one NVMe drive)")


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
    from slidefusion.offload.planner import Workload, grid_for, model_shape, plan_training, report, valid_frames

    shape, stride = model_shape(args.model), args.vae_stride
    sizes = {"gpu_memory": args.gpu_memory, "host_memory": args.host_memory, "pcie_bytes_s": args.pcie,
             "tflops": args.tflops, "prefetch": args.prefetch, "master": args.master, "moments": args.moments,
             "resident_blocks": args.resident_blocks, "host_bytes_s": args.host_bandwidth, "tile": args.tile,
             "disk": args.disk, "disk_bytes_s": args.disk_bandwidth}
    attention = args.attention or shape.attention
    grid = grid_for(args.frames, args.height, args.width, shape.patch, stride)
    work = Workload(args.batch, grid[0] * grid[1] * grid[2], attention, frames=grid[0])
    plan = plan_training(shape, work, **sizes)
    print(report(plan, f"{args.model}: {args.frames} frames at {args.width}x{args.height} ({grid[0]}x{grid[1]}x{grid[2]} "
                       f"tokens), {attention} attention, batch {args.batch}; master {args.master}, moments {args.moments}"))
    print(f"  at 100% of {args.tflops:g} TFLOP/s the step's {plan.flops:.3g} FLOP take {plan.flops / (args.tflops * 1e12):.3g} s; "
          f"a step in 1 s would need {plan.flops / 1e15:.3g} PFLOP/s")
    if args.tflops == DEFAULT_TFLOPS and args.pcie == types.bandwidth(DEFAULT_PCIE):
        print(f"  assumption: {DEFAULT_TFLOPS:g} TFLOP/s and {DEFAULT_PCIE} PCIe are an H200's; pass --tflops and --pcie "
              "for your GPU (an RTX 4090: about 165 dense bf16 TFLOP/s, 25 GB/s)")
    if (args.frames - 1) % stride[0]:
        below = valid_frames((args.frames - 1) // stride[0] + 1, stride)
        print(f"  note: --frames {args.frames} is not 1 + {stride[0]}k: a causal video VAE of temporal stride "
              f"{stride[0]} (Wan, CogVideoX, ours) takes {below} or {below + stride[0]}")
    if not plan.fits:
        _suggest(args, shape, work, sizes, stride)


LEAN = {"master": "bf16", "moments": "int8"}
ANY_DISK = 10**18  # bytes: "a disk as large as needed", to learn how much of one a plan uses


def _options(args, sizes: dict) -> list[tuple[str, dict]]:
    """The ways to more room the user has not taken yet: lean host state, a disk, then both."""
    lean = ("--master bf16 --moments int8", {**sizes, **LEAN})
    disk = ("checkpoints spilled to a disk (--disk, offload.spill_dir)", {**sizes, "disk": ANY_DISK})
    is_lean, has_disk = (args.master, args.moments) == ("bf16", "int8"), args.disk is not None
    options = ([] if is_lean else [lean]) + ([] if has_disk else [disk])
    if len(options) == 2:
        options.append((f"{lean[0]} and {disk[0]}", {**sizes, **LEAN, "disk": ANY_DISK}))
    return options


def _suggest(args, shape, work, sizes: dict, stride) -> None:
    """What would fit when the plan does not: lean host state, a disk for the checkpoints, or both
    (only when neither alone does); and the largest clip (a length the VAE accepts) that fits as
    asked, or else with the first of those options that gives one."""
    from slidefusion.offload.planner import human, largest_frames, plan_training

    options, one_fits = _options(args, sizes), False
    for index, (words, option) in enumerate(options):
        if index == 2 and one_fits:
            break  # the combination is worth saying only when neither alone fits
        trial = plan_training(shape, work, **option)
        one_fits = one_fits or trial.fits
        if trial.fits:
            spilled = sum(trial.disk.values())
            print(f"  with {words}" + (f" of {human(spilled)} or more" if spilled else "") + " it fits"
                  + (" (host state ~4 B/param)" if "--master" in words else ""))
    line = f"  largest clip that fits at {args.width}x{args.height}: "
    frames = largest_frames(shape, work, args.frames, args.height, args.width, stride, sizes)
    if frames:
        print(line + f"{frames} frames")
        return
    for words, option in options:
        frames = largest_frames(shape, work, args.frames, args.height, args.width, stride, option)
        if frames:
            print(line + f"none as asked (even one latent frame does not fit); with {words}: {frames} frames")
            return
    print(line + "none, even with lean host state and a disk (one latent frame does not fit); "
                 "lower --height/--width, or use a machine with more memory")


def add_offload_options(train: argparse.ArgumentParser) -> None:
    """`slidefusion train --offload [--device D]`: shorthands for config overrides."""
    train.add_argument("--offload", action="store_true",
                       help="train with the offload engine: weights and AdamW state in host memory (offload.enabled=true)")
    train.add_argument("--device", type=types.device, help="training device, e.g. cuda or cpu (run.device=...)")


def offload_overrides(args) -> list[str]:
    """The config overrides the flags stand for; explicit key=value overrides come first, flags win."""
    overrides = ["offload.enabled=true"] if getattr(args, "offload", False) else []
    return overrides + ([f"run.device={args.device}"] if getattr(args, "device", None) else [])
