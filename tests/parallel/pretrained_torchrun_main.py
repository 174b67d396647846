"""Stand-in for `slidefusion generate --pretrained DIR --parallel ...` until the CLI has --pretrained
(issue 10 phase B): the same namespace the CLI will pass to `generate_pretrained_parallel`, under
torchrun, with the CLI's one-line exit 2 for a UserError."""

import argparse
import sys

from slidefusion.errors import UserError
from slidefusion.parallel.cli import generate_pretrained_parallel

if __name__ == "__main__":
    folder, out, schedule, slices = sys.argv[1:5]
    args = argparse.Namespace(pretrained=folder, prompt="a red circle moving left", out=f"{out}/v.gif",
                              save_latents=f"{out}/l.safetensors", frames=5, height=48, width=80, steps=2,
                              guidance=4.0, seed=3, parallel=schedule, slices=int(slices), cfg_parallel=False,
                              trace=None, timeout=120, quiet=True)
    try:
        generate_pretrained_parallel(args)
    except UserError as error:
        print(f"slidefusion: error: {error}", file=sys.stderr)
        sys.exit(2)
