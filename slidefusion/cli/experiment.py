"""`slidefusion experiment attention-ablation`: the reproducible experiments of `slidefusion.eval.ablation`."""

import argparse
from pathlib import Path

from slidefusion.cli import args as types
from slidefusion.cli import help_text

EXAMPLES = ["slidefusion experiment attention-ablation --budget quick",
            "slidefusion experiment attention-ablation --budget full --variants dense slide"]
ABLATION_EXAMPLES = ["slidefusion experiment attention-ablation --budget quick --out /tmp/ablation",
                     "slidefusion experiment attention-ablation --budget full --variants dense slide"]


def add_parser(sub) -> None:
    from slidefusion.eval.ablation import BUDGETS, VARIANTS

    experiment = sub.add_parser("experiment", help="reproducible experiments (attention-ablation)")
    kinds = experiment.add_subparsers(dest="experiment", required=True)
    ablation = kinds.add_parser("attention-ablation", formatter_class=argparse.RawDescriptionHelpFormatter,
                                help="dense vs Swin window vs neighbourhood vs slide, adapted to long clips",
                                description="Adapt the dense short-clip model to long clips with each attention, "
                                            "evaluate at both lengths, and write results.md, results.json and "
                                            "losses.png. Rerunning the same command resumes.")
    ablation.add_argument("--budget", choices=list(BUDGETS), default="full",
                          help="full: 32 frames, 240 steps, about 110 min on 2 cores; motion: 16 frames, 960 steps, "
                               "144 prompts, about 3 h; quick: a smoke run of every stage (under a minute)")
    ablation.add_argument("--out", type=types.output_folder, default="experiments/attention-ablation", help="output folder")
    ablation.add_argument("--variants", nargs="+", choices=list(VARIANTS), help="a subset (default: all)")
    help_text.examples(experiment, EXAMPLES)
    help_text.examples(ablation, ABLATION_EXAMPLES)
    ablation.set_defaults(func=run)


def run(args) -> None:
    from slidefusion.eval.ablation import budget_named, run_ablation

    results = run_ablation(budget_named(args.budget), args.out, variants=args.variants)
    print(Path(args.out, "results.md").read_text())
    print(f"done in {results['seconds_this_call'] / 60:.1f} min (this call)")
