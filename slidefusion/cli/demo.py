"""`slidefusion demo`: the bundled model on a prompt, and a labelled grid of prompts (`slidefusion.demo`)."""

from slidefusion.cli import args as types
from slidefusion.cli import help_text

EXAMPLES = [
    "slidefusion demo",
    "slidefusion demo --prompt \"a blue square moving up slowly on a gray background\" --out outputs/square.mp4",
]
# The bundled model's sizes, where generate's help speaks of training sizes and diffusers folders.
SIZES = {"frames": "frames (default: the bundled model's 8)", "height": "height in pixels (default: the bundled model's 32)",
         "width": "width in pixels (default: the bundled model's 32)", "steps": "Euler sampling steps (default 30)"}


def add_parser(sub) -> None:
    from slidefusion.pipeline import DEFAULT_PROMPT

    demo = sub.add_parser("demo", help="generate with the bundled model: OUT.mp4, OUT.gif and a labelled OUT-grid.gif")
    demo.add_argument("--prompt", type=types.text, default=DEFAULT_PROMPT,
                      help=f"the text to turn into a video (default: {DEFAULT_PROMPT})")
    demo.add_argument("--out", type=types.output_file(), default="outputs/demo.mp4",
                      help="OUT.mp4, OUT.gif and OUT-grid.gif are written (default outputs/demo.mp4)")
    types.add_sampling_options(demo, SIZES)
    help_text.examples(demo, EXAMPLES)
    demo.set_defaults(func=run)


def run(args) -> None:
    from slidefusion.demo import run_demo

    run_demo(args.out, args.prompt, steps=args.steps, guidance=args.guidance, seed=args.seed, frames=args.frames,
             height=args.height, width=args.width, device=args.device, progress=not args.quiet)
