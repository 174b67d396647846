"""Slide attention swapped into diffusers models (`use_slide_attention`): equality and speed.

1. Equality: for a tiny random model of every covered family, the largest |swapped - stock| of
   `adapter.predict` in fp32 with a window covering the token grid (zero offsets), relative to
   the largest |stock|; and with a (1, 3, 3) window, to show the swapped path runs.
2. Speed (--timing): forward of a Wan-shaped transformer (--layers, --heads x 128) at --grid
   tokens, stock (SDPA) against swapped (slide, --kernel, offsets="sample"/"shift"/None),
   alternating rounds after a warm-up, medians. Shared machines: quote ratios, and prefer
   `--clock cpu` with one thread (the process's CPU time, which other jobs' load leaves far less
   noisy than wall time; with several threads it would count OpenMP's spinning too).

    OMP_NUM_THREADS=2 python benchmarks/slide_swap.py                       # equality table, ~1 min
    OMP_NUM_THREADS=2 python benchmarks/slide_swap.py --timing --grid 8x32x32
    OMP_NUM_THREADS=1 python benchmarks/slide_swap.py --timing --grid 8x32x32 --clock cpu
"""

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slidefusion import restore_attention, use_slide_attention  # noqa: E402
from slidefusion.families import adapter_for  # noqa: E402
from slidefusion.testing.tiny import family_latent_thw, tiny_latents, tiny_model, tiny_text  # noqa: E402

FAMILIES = ("wan", "cogvideox", "cogvideox1.5", "hunyuanvideo", "mochi", "ltx", "latte", "dit3d", "stdit")


def equality() -> None:
    print(f"{'family':<14}{'sites':>6}{'whole window':>16}{'window 1x3x3':>16}")
    for family in FAMILIES:
        model = tiny_model(family)
        adapter = adapter_for(model)
        x = tiny_latents(model, 2, family_latent_thw(family))
        t, text = torch.tensor([0.7, 0.3]) * adapter.objective.scale, tiny_text(model, 2, 8, lengths=[5, 8])
        rows = []
        with torch.no_grad():
            stock = adapter.predict(model, x, t, text)
            for kernel in (11, (1, 3, 3)):  # 11 covers every tiny grid
                handle = use_slide_attention(model, kernel_size=kernel, temporal="slide")
                rows.append(float((adapter.predict(model, x, t, text) - stock).abs().max() / stock.abs().max()))
                handle.remove()
        print(f"{family:<14}{len(handle.paths):>6}{rows[0]:>16.2e}{rows[1]:>16.2e}")


def timing(args) -> None:
    import diffusers

    torch.manual_seed(0)
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=args.heads, attention_head_dim=128, in_channels=16,
        out_channels=16, text_dim=64, freq_dim=64, ffn_dim=4 * 128 * args.heads, num_layers=args.layers).eval()
    adapter = adapter_for(model)
    t, h, w = (int(n) for n in args.grid.split("x"))
    x = torch.randn(1, 16, t, 2 * h, 2 * w)
    text = tiny_text(model, 1, 16)
    step = torch.tensor([500.0])

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    def run():
        start = clock()
        with torch.no_grad():
            adapter.predict(model, x, step, text)
        return clock() - start

    variants = {"stock": None, **{f"slide-{o or 'none'}": o for o in ("sample", "shift", None)}}
    times = {name: [] for name in variants}
    for round_ in range(args.repeats + 1):
        for name, offsets in variants.items():
            handle = None if name == "stock" else use_slide_attention(model, kernel_size=args.kernel, offsets=offsets)
            elapsed = run()
            if handle is not None:
                restore_attention(model)
            if round_:  # round 0 warms up
                times[name].append(elapsed)
    stock = statistics.median(times["stock"])
    print(f"Wan-shaped, {args.layers} layers, {args.heads}x128 heads, grid {args.grid} ({t * h * w} tokens), "
          f"window {args.kernel}, {torch.get_num_threads()} threads, {args.clock} time, median of {args.repeats}")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"  {name:<14}{median * 1e3:>10.1f} ms   {median / stock:>6.2f}x stock")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timing", action="store_true")
    parser.add_argument("--grid", default="8x32x32", help="token grid TxHxW for --timing")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kernel", type=int, nargs=3, default=(3, 7, 7))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: perf_counter; cpu: the process's CPU time (use with OMP_NUM_THREADS=1)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="In CPU autocast")
    if args.timing:
        timing(args)
    else:
        equality()


if __name__ == "__main__":
    main()
