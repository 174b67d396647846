"""The smallest text-to-layout task (issue 16, docs/results/demo-model.md): can a small DiT learn to put
the object where one word says, when that word is the only thing that varies?

Four captions that differ in one word ("a red circle moving left/right/up/down quickly on a black
background", or four colours moving right with `--vary colour`), one object, 8 frames of 32x32.
A hidden-96, 4-block dit3d is trained from scratch with plain AdamW on the flow loss, and every
100 steps the script prints the loss gap: flow loss on 32 fixed clips with each caption swapped
for its partner (left <-> right, up <-> down; red <-> blue, green <-> yellow) minus the loss with
the true caption, at fixed times and noise. A model that uses the word has a positive gap; the
ideal gap at t = 1 (pure noise) is printed first, from 400 rendered clips per caption.

    python benchmarks/demo_micro.py --steps 1000                                 # direction, "behind" starts
    python benchmarks/demo_micro.py --steps 500 --vary colour                    # the control
    python benchmarks/demo_micro.py --steps 400 --t-range 0.9 1 --times 0.98 0.995 1  # near pure noise
    python benchmarks/demo_micro.py --steps 400 --context random --t-range 0.8 1    # distinct random contexts
"""

import argparse
import time

import numpy as np
import torch

from slidefusion.data.shapes import START_MODES, ShapeObject, ShapeScene, render, with_start
from slidefusion.data.video_io import from_uint8
from slidefusion.diffusion.flow import interpolate
from slidefusion.models import build_model, preset
from slidefusion.text.encoder import MiniLMEncoder

DIRECTIONS = ("left", "right", "up", "down")
COLOURS = ("red", "blue", "green", "yellow")
PARTNER = torch.tensor([1, 0, 3, 2])  # the caption each one is swapped with


def _scene(args, k: int, rng: np.random.Generator) -> ShapeScene:
    colour, direction = (COLOURS[k], "right") if args.vary == "colour" else ("red", DIRECTIONS[k])
    obj = ShapeObject(colour, "circle", direction, "quickly", float(rng.uniform(0.08, 0.15)),
                      float(rng.uniform(0.2, 0.8)), float(rng.uniform(0.2, 0.8)))
    return ShapeScene((with_start(obj, args.start, 8, 32, 32),), "black")


def _clips(args, ks, rng) -> torch.Tensor:
    return torch.stack([from_uint8(render(_scene(args, int(k), rng), 8, 32, 32)) for k in ks])


def _contexts(args) -> tuple[torch.Tensor, torch.Tensor]:
    words = [(c, "right") for c in COLOURS] if args.vary == "colour" else [("red", d) for d in DIRECTIONS]
    states, mask = MiniLMEncoder().encode([f"a {c} circle moving {d} quickly on a black background" for c, d in words])
    if args.context == "random":  # every token of caption k is the same random vector: nothing shared
        noise = torch.randn(4, 1, states.shape[-1], generator=torch.Generator().manual_seed(5))
        states = noise.expand_as(states).contiguous()
    return states, mask


def _ideal_gap(args, rng) -> float:
    means = [_clips(args, [k] * 400, rng).mean(0) for k in range(4)]
    return float(np.mean([((means[k] - means[int(PARTNER[k])]) ** 2).mean().item() for k in range(4)]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--vary", choices=("direction", "colour"), default="direction")
    p.add_argument("--start", choices=START_MODES, default="behind")
    p.add_argument("--context", choices=("minilm", "random"), default="minilm")
    p.add_argument("--t-range", type=float, nargs=2, default=None, metavar=("LO", "HI"),
                   help="train at uniform t in [LO, HI] (default: logit-normal(0.8, 1.2), the demo recipe's)")
    p.add_argument("--times", type=float, nargs="+", default=[0.5, 0.9, 0.98, 1.0])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"ideal gap at t = 1: {_ideal_gap(args, rng):.5f}")
    states, mask = _contexts(args)
    torch.manual_seed(0)
    model = build_model(preset("dit3d-small", hidden=96, depth=4, heads=4))
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4)
    g = torch.Generator().manual_seed(0)
    eval_k = torch.randint(0, 4, (32,), generator=g)
    eval_x, eval_noise = _clips(args, eval_k, rng), torch.randn(32, 3, 8, 32, 32, generator=g)

    def loss_at(t: float, ks: torch.Tensor) -> float:
        tt = torch.full((32,), t)
        v = model(interpolate(eval_x, eval_noise, tt), tt, states[ks], mask[ks])
        return ((v - (eval_noise - eval_x)) ** 2).mean().item()

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        ks = torch.randint(0, 4, (8,), generator=g)
        x0 = _clips(args, ks, rng)
        if args.t_range:
            t = args.t_range[0] + (args.t_range[1] - args.t_range[0]) * torch.rand(8, generator=g)
        else:
            t = torch.sigmoid(0.8 + 1.2 * torch.randn(8, generator=g))
        noise = torch.randn(x0.shape, generator=g)
        loss = ((model(interpolate(x0, noise, t), t, states[ks], mask[ks]) - (noise - x0)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0:
            with torch.no_grad():
                gaps = [loss_at(t, PARTNER[eval_k]) - loss_at(t, eval_k) for t in args.times]
            cells = " ".join(f"t={t:g}: {gap:+.5f}" for t, gap in zip(args.times, gaps))
            print(f"step {step} loss {loss.item():.4f} gap {cells} ({time.perf_counter() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
