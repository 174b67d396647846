"""`slidefusion evaluate`: score generated videos (or dataset clips) against their prompts (`slidefusion.eval`)."""

import time

from slidefusion.cli import args as types
from slidefusion.cli import help_text
from slidefusion.cli.args import positive_int
from slidefusion.data.shapes import COLORS

EXAMPLES = ["slidefusion evaluate --checkpoint bundled --num 24 --json eval.json",
            "slidefusion evaluate --ground-truth --num 24 --frames 32"]


def run(args) -> None:
    from slidefusion.core.errors import UserError
    from slidefusion.core.validate import SEED_MAX
    from slidefusion.eval.evaluate import (
        SamplingSettings,
        evaluate_ground_truth,
        evaluate_pipeline,
        format_table,
        held_out_prompts,
        read_prompts,
        write_json,
    )

    start = time.perf_counter()
    if args.ground_truth:
        if args.checkpoint or args.prompts:
            raise UserError("--ground-truth scores dataset clips: it takes no --checkpoint or --prompts")
        name = "ground truth"
        rows, summary = evaluate_ground_truth(args.num, args.frames or 8, args.height, args.width,
                                              max_objects=args.max_objects, progress=not args.quiet)
        source = {"ground_truth": True, "frames": args.frames or 8, "height": args.height, "width": args.width}
    else:
        from slidefusion.pipeline import VideoPipeline

        if not args.checkpoint:
            raise UserError("--checkpoint DIR|bundled is required (or --ground-truth to score dataset clips)")
        if args.seed + args.num - 1 > SEED_MAX:
            raise UserError(f"--seed={args.seed}: video i uses seed SEED + i, so SEED + --num - 1 must be <= 2**64-1")
        prompts = read_prompts(args.prompts, args.num) if args.prompts else held_out_prompts(args.num, args.max_objects)
        settings = SamplingSettings(frames=args.frames, steps=args.steps, guidance=args.guidance, seed=args.seed,
                                    batch_size=args.batch_size)
        bundled = args.checkpoint == "bundled"
        pipeline = VideoPipeline.from_checkpoint(None if bundled else args.checkpoint, device=args.device)
        name = str(args.checkpoint)
        rows, summary = evaluate_pipeline(pipeline, prompts, settings, progress=not args.quiet)
        source = {"checkpoint": str(args.checkpoint), "sampling": settings}
    print(format_table({name: summary}))
    if args.json:
        print(f"wrote {write_json(args.json, {**source, 'summary': summary, 'videos': rows})}")
    print(f"{summary['videos']} videos in {time.perf_counter() - start:.1f} s")


def add_parser(sub) -> None:
    evaluate = sub.add_parser("evaluate", help="score generated videos (or dataset clips) against their prompts",
                              description="Text alignment and subject consistency from the moving-shapes detector, "
                                          "plus temporal flickering, motion smoothness and warping error.")
    evaluate.add_argument("--checkpoint", help="checkpoint folder, run folder (its latest) or 'bundled' (the demo model)")
    evaluate.add_argument("--ground-truth", action="store_true", help="score dataset clips against their own captions")
    evaluate.add_argument("--prompts", metavar="FILE", type=types.existing_file,
                          help="one moving-shapes prompt per line (default: held-out captions)")
    evaluate.add_argument("--num", type=positive_int, default=16, help="videos to score (default 16)")
    evaluate.add_argument("--json", metavar="OUT", type=types.output_file(".json"),
                          help="write the summary and every video's scores here (.json)")
    evaluate.add_argument("--frames", type=positive_int, help="frames (default: the training length; 8 for ground truth)")
    evaluate.add_argument("--height", type=positive_int, default=32, help="ground-truth clip height (default 32)")
    evaluate.add_argument("--width", type=positive_int, default=32, help="ground-truth clip width (default 32)")
    evaluate.add_argument("--max-objects", type=types.integer(1, len(COLORS)), default=1,
                          help="objects per held-out scene (default 1)")
    evaluate.add_argument("--steps", type=types.integer(1, 10_000), default=20, help="Euler steps (default 20)")
    evaluate.add_argument("--guidance", type=types.guidance, default=4.0, help="0..100 (default 4)")
    evaluate.add_argument("--seed", type=types.seed, default=0, help="video i uses seed SEED + i")
    evaluate.add_argument("--batch-size", type=positive_int, default=8, help="videos sampled together (default 8)")
    evaluate.add_argument("--device", type=types.device, default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    evaluate.add_argument("--quiet", action="store_true", help="no progress bars")
    help_text.examples(evaluate, EXAMPLES)
    evaluate.set_defaults(func=run)
