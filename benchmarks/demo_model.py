"""How well the bundled demo model follows its prompts: colour, background and direction.

    OMP_NUM_THREADS=2 python benchmarks/demo_model.py [--checkpoint DIR] [--seeds 2] [--json out.json]

For every direction x seed it samples "a <colour> circle moving <direction> quickly on a black
background", finds the pixels nearest the prompted colour, and checks that their centroid moved
along the prompted direction (projection > 1 px from the first to the last frame) and that the
prompted colour is the most common palette colour. A rough detector, not issue 6's evaluator.
"""

import argparse
import json
import time

import torch

from slidefusion.data.shapes import COLORS, DIRECTIONS
from slidefusion.eval import centroid_track, dominant_colour
from slidefusion.pipeline import VideoPipeline


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="default: the bundled model")
    parser.add_argument("--seeds", type=int, default=2)
    parser.add_argument("--colours", nargs="+", default=["red", "blue", "green", "yellow"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    pipe = VideoPipeline.from_checkpoint(args.checkpoint)
    rows, seconds = [], []
    for i, (direction, (dy, dx)) in enumerate(DIRECTIONS.items()):
        for seed in range(args.seeds):
            colour = args.colours[(i + seed) % len(args.colours)]
            start = time.perf_counter()
            video = pipe(f"a {colour} circle moving {direction} quickly on a black background", seed=seed, progress=False)
            seconds.append(time.perf_counter() - start)
            track = centroid_track(video, COLORS[colour])
            along = float((track[-1] - track[0]) @ torch.tensor([dy, dx]))
            rows.append({"direction": direction, "colour": colour, "seed": seed, "moved_px": round(along, 2),
                         "direction_ok": along > 1.0, "colour_ok": dominant_colour(video) == colour})
            print(f"{direction:>10} {colour:>6} seed {seed}: moved {along:+6.2f} px along, colour "
                  f"{'ok' if rows[-1]['colour_ok'] else 'wrong'}")
    summary = {"direction_accuracy": sum(r["direction_ok"] for r in rows) / len(rows),
               "colour_accuracy": sum(r["colour_ok"] for r in rows) / len(rows),
               "median_sample_s": sorted(seconds)[len(seconds) // 2], "threads": torch.get_num_threads()}
    print(json.dumps(summary))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"summary": summary, "rows": rows}, handle, indent=1)


if __name__ == "__main__":
    main()
