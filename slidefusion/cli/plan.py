"""`slidefusion plan`: the memory planner on the command line. Its policy flags set the fields of the
same `OffloadPolicy` a config's `offload:` section does (`--resident-blocks auto` is
`offload.resident_blocks=auto`), checked by the policy itself. With `--gpus N` it plans a run on
several GPUs (`offload.plan.distributed`): the engine's state sharded over the ranks."""

import argparse
import dataclasses

import yaml

from slidefusion.attention import memory_models
from slidefusion.cli import args as types
from slidefusion.cli import help_text
from slidefusion.core.errors import UserError
from slidefusion.offload.policy import MASTERS, MOMENTS, ROUNDINGS, OffloadPolicy

# The policy's fields the planner takes as flags (--resident-blocks sets offload.resident_blocks, ...).
POLICY_FLAGS = {
    "compute_dtype": "the streamed copy's dtype (offload.compute_dtype; default auto: bfloat16 on a GPU)",
    "master": "master weights on the host: fp32 or bf16 (offload.master)",
    "moments": "AdamW moments on the host: fp32, bf16 or int8 (offload.moments)",
    "rounding": "bf16 master: stochastic or kahan (offload.rounding)",
    "resident_blocks": "blocks kept on the device: N or auto (offload.resident_blocks)",
    "tile": "frames of the token grid per tile inside a block: N, auto or off (offload.tile; default auto: whole "
            "blocks if they fit, else the largest tile that does)",
    "prefetch": "blocks uploading ahead (offload.prefetch; default 1)",
}
CHOICES = {"master": MASTERS, "moments": MOMENTS, "rounding": ROUNDINGS}
PLAN_DEFAULTS = {"tile": "auto"}  # the planner sizes a tile when whole blocks do not fit; the config's default is off

EXAMPLES = [
    "slidefusion plan --model wan2.1-14b --frames 81 --height 480 --width 832 --gpu-memory 24GB --host-memory 128GB "
    "--tflops 165 --pcie 25GB/s --master bf16 --moments int8",
    "slidefusion plan --model wan2.1-14b --frames 81 --height 480 --width 832 --gpus 8",
    "slidefusion plan --model dit3d-105b --frames 256 --height 1080 --width 1920 --attention slide --disk 8TB",
]
DEFAULT_PCIE, DEFAULT_TFLOPS = "55GB/s", 990.0  # an H200 on PCIe 5 x16


def add_parser(subparsers) -> None:
    plan = subparsers.add_parser("plan", help="memory plan of offloaded training: does it fit, how fast")
    plan.add_argument("--model", required=True, metavar="PRESET|DIR", type=types.text,
                      help="a preset (wan2.1-1.3b, wan2.1-14b, dit3d-105b, ...) or a diffusers transformer folder")
    plan.add_argument("--frames", type=types.positive_int, required=True, help="video frames (pixels)")
    plan.add_argument("--height", type=types.positive_int, required=True, help="video height in pixels")
    plan.add_argument("--width", type=types.positive_int, required=True, help="video width in pixels")
    plan.add_argument("--attention", choices=memory_models(),
                      help="self-attention operator (default: the model's own; Wan: flash)")
    plan.add_argument("--gpu-memory", type=types.byte_size, default="141GB",
                      help="device memory with its unit, e.g. 24GB or 24GiB (default 141GB, an H200; a bare number is refused)")
    plan.add_argument("--host-memory", type=types.byte_size, default="1.5TB", 
                      help="host memory with its unit, e.g. 128GB (default 1.5TB); with --gpus, per node")
    plan.add_argument("--pcie", type=types.bandwidth, default=DEFAULT_PCIE,
                      help=f"host<->device bandwidth with its unit, e.g. 25GB/s (default {DEFAULT_PCIE})")
    plan.add_argument("--tflops", type=types.number(0, low_open=True), default=DEFAULT_TFLOPS,
                      help=f"dense bf16 TFLOP/s of the device (default {DEFAULT_TFLOPS:g}, an H200)")
    plan.add_argument("--host-bandwidth", type=types.bandwidth, default="20GB/s",
                      help="host memory bandwidth of the optimizer threads (default 20GB/s)")
    for key, help_ in POLICY_FLAGS.items():  # each sets the OffloadPolicy field of its name, as offload.KEY=VALUE does
        default = PLAN_DEFAULTS.get(key, getattr(OffloadPolicy(), key))
        if key in CHOICES:  # a fixed list: argparse names the valid ones
            plan.add_argument("--" + key.replace("_", "-"), choices=CHOICES[key], default=default, help=help_)
        else:
            plan.add_argument("--" + key.replace("_", "-"), type=types.arg_type(key, _policy_value(key)), default=default,
                              metavar=key.upper(), help=help_)
    _add_activation_flags(plan)
    _add_cluster_flags(plan)
    plan.add_argument("--batch", type=types.positive_int, default=1,
                      help="samples per step (with --gpus: per data-parallel rank)")
    plan.add_argument("--vae-stride", type=types.int_list(3), default="4,8,8",
                      help="autoencoder stride t,h,w (default 4,8,8)")
    help_text.examples(plan, EXAMPLES)
    plan.set_defaults(func=run)


def _add_activation_flags(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--disk", type=types.byte_size,
                      help="free disk for spilled checkpoints (offload.spill_dir) with its unit, e.g. 2TB; default: none")
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


def _policy_value(key: str):
    """The flag's text read as a config value (YAML, as offload.KEY=VALUE), checked by `OffloadPolicy` itself."""

    def parse(text: str):
        if not text.strip():
            raise UserError(f"{text!r} is empty; give a value (as offload.{key} takes)")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        try:
            OffloadPolicy(**{key: value})  # the config's own check of the value
        except UserError as error:  # named as the flag the user typed
            raise UserError(str(error).replace(f"offload.{key}=", f"--{key.replace('_', '-')}=")) from None
        return value

    return parse


def _policy(args) -> OffloadPolicy:
    return OffloadPolicy(**{key: getattr(args, key) for key in POLICY_FLAGS})


def run(args) -> None:
    from slidefusion.offload.plan.model_shape import model_shape
    from slidefusion.offload.plan.planner import Machine, grid_for, plan_policy, report, valid_frames
    from slidefusion.offload.tiling.activations import Workload

    _check_folder(args.model)
    shape, stride, policy = model_shape(args.model, _folder_config(args.model)), args.vae_stride, _policy(args)
    machine = Machine(args.gpu_memory, args.host_memory, args.pcie, args.tflops, host_bytes_s=args.host_bandwidth,
                      disk=args.disk, disk_bytes_s=args.disk_bandwidth)
    attention = args.attention or shape.attention
    grid = grid_for(args.frames, args.height, args.width, shape.patch, stride)
    work = Workload(args.batch, grid[0] * grid[1] * grid[2], attention, frames=grid[0])
    if args.gpus is not None:
        return _plan_cluster(args, shape, work, grid, policy, machine)
    if args.nodes != 1 or args.sp != 1 or args.interconnect is not None or args.one_host_copy_per_rank:
        raise UserError("--nodes, --sp, --interconnect and --one-host-copy-per-rank plan a multi-GPU run: add --gpus N")
    plan = plan_policy(shape, work, policy, machine)
    print(report(plan, f"{args.model}: {args.frames} frames at {args.width}x{args.height} ({grid[0]}x{grid[1]}x{grid[2]} "
                       f"tokens), {attention} attention, batch {args.batch}; master {policy.master}, moments {policy.moments}"))
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
        _suggest(args, shape, work, policy, machine)


def _folder_config(model: str) -> dict | None:
    """A transformer folder's config.json (a pipeline folder's transformer/), or None for a name."""
    from pathlib import Path

    from slidefusion.io.diffusers import read_json

    folder = Path(model)
    if not folder.is_dir():
        return None
    path = next((p for p in (folder / "config.json", folder / "transformer" / "config.json") if p.is_file()), None)
    if path is None:
        raise UserError(f"--model={model!r} has no config.json (nor transformer/config.json)")
    return read_json(path, "--model: the transformer config")


def _check_folder(model: str) -> None:
    """A diffusers transformer folder's sizes, and its layer count against its weights, before the
    planner builds it (a million layers) or plans a model other than the weights'."""
    from pathlib import Path

    if Path(model).is_dir():
        from slidefusion.pretrained.config_check import check_transformer_folder

        check_transformer_folder(model, "--model")


LEAN = {"master": "bf16", "moments": "int8"}
ANY_DISK = 10**18  # bytes: "a disk as large as needed", to learn how much of one a plan uses


def _options(policy: OffloadPolicy, machine) -> list[tuple[str, OffloadPolicy, object]]:
    """The ways to more room the user has not taken yet, as (words, policy, machine): lean host
    state, a disk, then both."""
    lean = ("--master bf16 --moments int8", dataclasses.replace(policy, **LEAN), machine)
    disk = ("checkpoints spilled to a disk (--disk, offload.spill_dir)", policy, dataclasses.replace(machine, disk=ANY_DISK))
    is_lean, has_disk = (policy.master, policy.moments) == ("bf16", "int8"), machine.disk is not None
    options = ([] if is_lean else [lean]) + ([] if has_disk else [disk])
    if len(options) == 2:
        options.append((f"{lean[0]} and {disk[0]}", lean[1], disk[2]))
    return options


def _suggest(args, shape, work, policy: OffloadPolicy, machine) -> None:
    """What would fit when the plan does not: lean host state, a disk for the checkpoints, or both
    (only when neither alone does); and the largest clip (a length the VAE accepts) that fits as
    asked, or else with the first of those options that gives one."""
    from slidefusion.offload.plan.plan import human
    from slidefusion.offload.plan.planner import largest_frames, plan_policy

    options, one_fits = _options(policy, machine), False
    for index, (words, option, room) in enumerate(options):
        if index == 2 and one_fits:
            break  # the combination is worth saying only when neither alone fits
        trial = plan_policy(shape, work, option, room)
        one_fits = one_fits or trial.fits
        if trial.fits:
            spilled = sum(trial.disk.values())
            print(f"  with {words}" + (f" of {human(spilled)} or more" if spilled else "") + " it fits"
                  + (" (host state ~4 B/param)" if "--master" in words else ""))
    line = f"  largest clip that fits at {args.width}x{args.height}: "
    pixels = (args.frames, args.height, args.width)
    frames = largest_frames(shape, work, policy, machine, pixels, args.vae_stride)
    if frames:
        print(line + f"{frames} frames")
        return
    for words, option, room in options:
        frames = largest_frames(shape, work, option, room, pixels, args.vae_stride)
        if frames:
            print(line + f"none as asked (even one latent frame does not fit); with {words}: {frames} frames")
            return
    print(line + "none, even with lean host state and a disk (one latent frame does not fit); "
                 "lower --height/--width, or use a machine with more memory")


def _plan_cluster(args, shape, work, grid, policy, machine) -> None:
    from slidefusion.offload.plan.distributed import Cluster, plan_cluster, report_cluster

    if args.sp > shape.heads:
        raise UserError(f"--sp {args.sp} is more than the {shape.heads} attention heads of {args.model} "
                        "(Ulysses splits heads over the ranks of a sample)")
    cluster = Cluster(args.gpus, args.nodes, args.sp, None if args.interconnect is None else args.interconnect * 1e9 / 8,
                      shared=not args.one_host_copy_per_rank)
    plan = plan_cluster(shape, work, cluster, policy, machine)
    print(report_cluster(plan, f"{args.model}: {args.frames} frames at {args.width}x{args.height} ({grid[0]}x{grid[1]}x"
                               f"{grid[2]} tokens), {work.attention} attention, {args.batch} per data-parallel rank; "
                               f"master {policy.master}, moments {policy.moments}, offload engine"))
