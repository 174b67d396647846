"""`slidefusion generate`: a video from a prompt, with our model (`--checkpoint`, `--init random`) or a
diffusers folder (`--pretrained`); `--parallel SCHEDULE` under `torchrun --nproc-per-node P` samples
across the ranks (`pipe.latents(..., parallel=ParallelConfig(...))`) and rank 0 writes the files.

Everything that can be checked without weights or a process group is checked first, so bad input is
one line (from rank 0 alone under torchrun) before minutes of loading.
"""

import argparse
import json
import time
from pathlib import Path

from slidefusion.cli import args as types
from slidefusion.cli import help_text
from slidefusion.core.errors import UserError

_REQUIRED = object()  # --checkpoint not given
EXAMPLES = [
    "slidefusion generate --checkpoint runs/first --prompt \"a red circle moving right\" --out video.mp4",
    "slidefusion generate --pretrained Wan2.1-I2V-14B-480P-Diffusers --image first.png --prompt \"a cat\" --frames 33 "
    "--height 480 --width 832 --out cat.mp4",
    "torchrun --nproc-per-node 4 -m slidefusion generate --pretrained Wan2.1-T2V-14B-Diffusers --prompt \"a cat\" "
    "--frames 81 --height 480 --width 832 --parallel usp --ulysses 2 --ring 2 --out cat.mp4",
]
PARALLEL_ONLY = {"slices": "--slices", "cfg_parallel": "--cfg-parallel", "trace": "--trace", "timeout": "--timeout",
                 "ulysses": "--ulysses", "ring": "--ring"}


def add_parser(sub) -> None:
    generate = sub.add_parser("generate", help="generate a video from a prompt")
    generate.add_argument("--checkpoint", default=_REQUIRED,
                          help="checkpoint folder, run folder (its latest) or 'bundled' (the demo model)")
    generate.add_argument("--pretrained", metavar="DIR", type=types.existing_folder,
                          help="a local diffusers pipeline folder (Wan, CogVideoX, HunyuanVideo, LTX-Video, Mochi, Latte), "
                               "sampled with its own scheduler")
    _add_folder_options(generate)
    generate.add_argument("--prompt", type=types.text, required=True, help="the text to turn into a video")
    generate.add_argument("--out", type=types.output_file(".mp4", ".gif"), default="outputs/video.mp4",
                          help=".mp4 (H.264) or .gif")
    generate.add_argument("--init", choices=["checkpoint", "random"], default="checkpoint",
                          help="random: an untrained --model PRESET, no checkpoint needed")
    generate.add_argument("--model", metavar="PRESET", type=types.model_preset, help="model preset for --init random")
    generate.add_argument("--save-latents", metavar="PATH", type=types.output_file(".safetensors"),
                          help="also write the final latents (a .safetensors file, key 'latents')")
    types.add_sampling_options(generate)
    _add_parallel_options(generate)
    help_text.examples(generate, EXAMPLES)
    generate.set_defaults(func=run)


def _add_folder_options(generate: argparse.ArgumentParser) -> None:
    """What `--pretrained DIR` takes beside the folder: its weights, a LoRA, a first frame."""
    generate.add_argument("--transformer", metavar="FILE", type=types.existing_file,
                          help="with --pretrained: the transformer's weights from one .safetensors file (Wan's "
                               "original layout, as the Wan repository and ComfyUI ship it, or diffusers')")
    generate.add_argument("--lora", metavar="FILE_OR_DIR", type=types.existing_path,
                          help="with --pretrained: a LoRA merged into the transformer, as `export --format diffusers` "
                               "or `--format comfyui` writes it (Wan 2.2 A14B: a file named ..._high_noise or "
                               "..._low_noise)")
    generate.add_argument("--lora-scale", metavar="S", type=types.number(-100, 100), default=1.0,
                          help="the LoRA's weight on top of its own alpha / rank (default 1)")
    generate.add_argument("--image", metavar="PATH", type=types.existing_file,
                          help="the first frame, for an image-to-video Wan folder (Wan 2.1 I2V, or Wan 2.2 TI2V's "
                               "image mode) or a fine-tune of one")


def _add_parallel_options(generate: argparse.ArgumentParser) -> None:
    from slidefusion.parallel import DEFAULT_TIMEOUT_S, SCHEDULES

    group = generate.add_argument_group("parallel inference (run under torchrun --nproc-per-node P)")
    group.add_argument("--parallel", metavar="SCHEDULE", choices=list(SCHEDULES),
                       help=f"run across the torchrun ranks: {', '.join(SCHEDULES)}")
    group.add_argument("--slices", type=types.arg_type("slices", _slices), default=None, metavar="N|auto",
                       help="slices per switch (scalefusion, scalefusion-inter; default 4) or per exchange "
                            "(ulysses, ring, usp on full-3D models; default 1 = unsliced; auto: default of --parallel auto)")
    group.add_argument("--ulysses", type=types.positive_int, default=None, metavar="U",
                       help="usp: ranks of each head all-to-all group (consecutive ranks; U x R = ranks per sequence group)")
    group.add_argument("--ring", type=types.positive_int, default=None, metavar="R",
                       help="usp: ranks of each ring (key/value blocks pass around it)")
    group.add_argument("--cfg-parallel", action="store_true",
                       help="conditional and unconditional halves on two rank groups (even rank count)")
    group.add_argument("--trace", metavar="PATH", type=types.output_file(".json"),
                       help="write a Chrome trace (compute and transfers per rank)")
    group.add_argument("--timeout", type=types.number(0, low_open=True), default=None, metavar="S",
                       help=f"seconds before a collective waiting on a dead or stuck rank fails (default {DEFAULT_TIMEOUT_S:g})")


def _slices(text: str) -> int | str:
    from slidefusion.parallel import ParallelConfig
    from slidefusion.parallel.plan import parse_slices

    slices = parse_slices(text)
    ParallelConfig(slices=slices)  # the range check, in one place
    return slices


def parallel_config(args):
    """The run's `ParallelConfig` (None without --parallel, where a parallel-only flag is refused)."""
    if not args.parallel:
        given = [flag for key, flag in PARALLEL_ONLY.items() if getattr(args, key, None) not in (None, False)]
        if given:
            raise UserError(f"{given[0]} applies to parallel runs only; add --parallel SCHEDULE under torchrun, "
                            f"or drop {given[0]}")
        return None
    from slidefusion.parallel import ParallelConfig

    given = {"slices": args.slices, "cfg_parallel": args.cfg_parallel, "timeout_s": args.timeout,
             "ulysses": args.ulysses, "ring": args.ring}
    return ParallelConfig(args.parallel, **{k: v for k, v in given.items() if v is not None})


def _check_folder_options(args, parallel) -> None:
    """The folder options against each other: each needs what it applies to."""
    for flag, value, note in (("--transformer FILE", args.transformer, ""),
                              ("--lora FILE_OR_DIR", args.lora, " (a fine-tune's --checkpoint holds its LoRA already)")):
        if value and not args.pretrained:
            raise UserError(f"{flag} applies to the transformer of a --pretrained DIR (a diffusers folder); add "
                            f"--pretrained DIR{note}")
    if args.lora_scale != 1.0 and not args.lora:
        raise UserError("--lora-scale weighs a --lora FILE_OR_DIR; add --lora")
    if args.image and parallel is not None:
        raise UserError("--image does not run under --parallel yet; drop --parallel to sample on one device")


def run(args) -> None:
    """Under torchrun a mistake is reported by rank 0 alone (`cli.main`, `leave_after_rank_zero`)."""
    parallel = parallel_config(args)
    _check_folder_options(args, parallel)
    if args.pretrained:
        missing = [f"--{k}" for k in ("frames", "height", "width") if getattr(args, k) is None]
        if missing:
            raise UserError(f"--pretrained needs {', '.join(missing)}: the video size in pixels (for Wan, frames "
                            "1 + 4k and sides multiples of 16, e.g. --frames 33 --height 480 --width 832)")
    _generate(args, parallel)


def _generate(args, parallel) -> None:
    from slidefusion.data.video_io import check_video_path
    from slidefusion.core.validate import output_path

    start = time.perf_counter()
    out = Path(args.out)
    check_video_path(out)  # a bad file name must fail before minutes of sampling, not after
    output_path(out, "--out")
    folder, world = _check_folder(args, parallel) if args.pretrained else (None, None)
    image = _image(args, folder)
    if parallel is not None:
        from slidefusion.parallel.launch import pick_backend

        args.device = str(pick_backend()[1])
    pipe = _pipeline(args, folder)
    if parallel is not None and not args.pretrained:
        world = _check_models(_transformers(pipe), parallel)
    if folder is None:  # a checkpoint: a fine-tune of an image-to-video folder takes one
        image = _checkpoint_image(args, pipe)
    tracer, rank = _join(parallel, world)
    sizes = {"frames": args.frames, "height": args.height, "width": args.width}
    extra = {} if image is None else {"image": image}
    latents = pipe.latents(args.prompt, **sizes, steps=args.steps, guidance=args.guidance, seed=args.seed,
                           progress=rank == 0 and not args.quiet, parallel=parallel, tracer=tracer, **extra)
    video = pipe.decode(latents, parallel=parallel)
    if rank == 0:
        _write(args, latents, video, pipe.fps)
        print(f"{args.prompt!r}: {video.shape[1]} frames of {video.shape[2]}x{video.shape[3]}"
              + (f" on {world} ranks ({args.parallel})" if parallel else "") + f" in {time.perf_counter() - start:.1f} s")
    if parallel is not None:
        _report(args.trace, tracer)


def _check_folder(args, parallel):
    """(the opened folder, the world size or None): the folder with its --transformer file, the sizes,
    a --lora (its layout, names and shapes against the folder's config) and the schedule on every
    transformer under --parallel, before any weight."""
    from slidefusion.pretrained import check_generation
    from slidefusion.pretrained.source import open_folder_with

    if args.checkpoint is not _REQUIRED or args.init == "random" or args.model:
        raise UserError("--pretrained brings its own model: drop --checkpoint, --init random and --model")
    folder = open_folder_with(args.pretrained, args.transformer, what="--transformer")
    check_generation(folder, args.frames, args.height, args.width)
    if args.lora:
        from slidefusion.pretrained.lora_merge import lora_for

        lora_for(folder, args.lora)
    if parallel is None:
        return folder, None
    from slidefusion.parallel import launcher_world
    from slidefusion.pipeline.parallel import check_folder

    world = launcher_world()
    check_folder(folder, parallel, world, args.frames, args.height, args.width)
    return folder, world


def _image(args, folder):
    """The --image of an image-to-video folder, read and checked against it before any weight loads."""
    if folder is None:
        return None
    from slidefusion.pretrained.image import check_image_use, open_image

    check_image_use(folder, bool(args.image))
    return open_image(args.image) if args.image else None


def _checkpoint_image(args, pipe):
    """The --image of a checkpoint: a fine-tune of an image-to-video folder takes one, ours none."""
    from slidefusion.pipeline import FolderPipeline

    if isinstance(pipe, FolderPipeline):
        return _image(args, pipe.parts.folder)
    if args.image:
        raise UserError("--image applies to image-to-video Wan folders (--pretrained DIR) and fine-tunes of them "
                        "(--checkpoint RUN); this checkpoint is one of our own text-to-video models")
    return None


def _check_models(models, parallel) -> int:
    """The schedule against the model, then against the launcher's rank count."""
    from slidefusion.parallel import launcher_world
    from slidefusion.pipeline.parallel import check_models

    check_models(models, parallel, None)
    world = launcher_world()
    check_models(models, parallel, world)
    return world


def _transformers(pipe) -> list:
    """The models `--parallel` runs across the ranks: ours, or each transformer of a diffusers folder
    (a checkpoint of a fine-tune of one samples as that folder, a `FolderPipeline`)."""
    parts = getattr(pipe, "parts", None)
    return [model for model, _ in parts.experts] if parts is not None else [pipe.model]


def _join(parallel, world):
    """(tracer, rank): the process group joined under --parallel, or (None, 0) for one process."""
    if parallel is None:
        return None, 0
    import torch.distributed as dist

    from slidefusion.parallel import Tracer, init_distributed

    init_distributed(parallel.timeout_s)
    return Tracer(rank=dist.get_rank(), enabled=True), dist.get_rank()


def _pipeline(args, folder):
    from slidefusion.pipeline import FolderPipeline, VideoPipeline

    if folder is not None:  # the opened folder (with its --transformer file); a --lora merged before the plans
        pipe = FolderPipeline.from_pretrained(folder)
        if args.lora:
            from slidefusion.pretrained.lora_merge import apply_lora

            apply_lora(pipe.parts, args.lora, args.lora_scale)
        return pipe.to(args.device)
    if args.init == "random":
        if not args.model:
            raise UserError("--init random needs --model PRESET (e.g. stdit-tiny)")
        if args.checkpoint is not _REQUIRED:
            raise UserError("--checkpoint and --init random exclude each other: random weights need no checkpoint")
        return VideoPipeline.from_preset(args.model, seed=args.seed, device=args.device)
    if args.model:
        raise UserError("--model is only for --init random; a checkpoint brings its own model")
    if args.checkpoint is _REQUIRED:
        raise UserError("--checkpoint DIR is required unless --pretrained DIR or --init random --model PRESET is given")
    return VideoPipeline.from_checkpoint(None if args.checkpoint == "bundled" else args.checkpoint, device=args.device)


def _write(args, latents, video, fps: int) -> None:
    from slidefusion.data.video_io import write_video
    from slidefusion.pipeline import save_latents

    if args.save_latents:
        print(f"wrote {save_latents(args.save_latents, latents)}")
    write_video(Path(args.out), video, fps=fps)
    print(f"wrote {args.out}")


def _report(trace_path, tracer) -> None:
    """Every rank's trace to rank 0, which prints the steps and writes the Chrome trace; then the group ends."""
    import torch.distributed as dist

    from slidefusion.io.files import write_text
    from slidefusion.parallel import chrome_trace
    from slidefusion.parallel.trace import step_table

    tracers = [None] * dist.get_world_size()
    dist.all_gather_object(tracers, tracer)
    if dist.get_rank() == 0:
        for row in step_table(tracers):
            print(f"step {row['step']}: {1e3 * row['wall_s']:.1f} ms, exposed communication "
                  f"{1e3 * row['exposed_comm_s']:.1f} ms")
        if trace_path:
            print(f"wrote {write_text(Path(trace_path), json.dumps(chrome_trace(tracers)))}")
    dist.barrier()
    dist.destroy_process_group()
