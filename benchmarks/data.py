"""The fine-tune data path: is the loader ever the bottleneck, and how much picture do buckets keep?

Two sections, both written to OUT/data.json with the machine's facts:

  loader   A tiny random Wan pipeline folder and a generated folder of mixed clips (videos of several
           lengths and aspect ratios, images) are scanned and cached (`slidefusion cache`), then a
           run alternates, after one warm-up round: the loader alone (a step's batch read from the
           latent and text caches, noise and timesteps drawn: `FolderTask.loss_fn`) and a whole
           training step (the same, plus forward, backward and AdamW). Medians per step and their
           ratio (step / loader: how many times over the loader keeps up with training) are quoted.
           Timings mean something only on a quiet machine.
  packing  The share of each clip's picture that survives to training: aspect buckets of the target
           area (`data.resolution`, resize to cover the nearest bucket, centre crop) against the one
           fixed size the trainer used before (centre crop to --width x --height). Deterministic:
           computed on a list of common aspect ratios and on the generated folder's files.

    python benchmarks/data.py --quick          # a smoke run (seconds)
    nice -n 19 python benchmarks/data.py       # writes runs/bench/data/data.json
"""

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from slidefusion.data.buckets import aspect_buckets, nearest_bucket, pixels_kept, target_area  # noqa: E402

# (name, height, width): what a mixed data folder holds
ASPECTS = [("1080p landscape 16:9", 1080, 1920), ("phone portrait 9:16", 1920, 1080), ("4:3", 480, 640),
           ("3:4 portrait", 640, 480), ("square 1:1", 1080, 1080), ("cinema 2.39:1", 804, 1920),
           ("photo 3:2", 4000, 6000), ("photo 2:3", 6000, 4000), ("Wan 832x480", 480, 832), ("Wan 480x832", 832, 480)]
# the generated folder: name, frames, height, width (small sizes, the same aspect mix)
FOLDER = [("land.mp4", 17, 54, 96), ("portrait.mov", 17, 96, 54), ("four3.mkv", 9, 48, 64), ("three4.webm", 9, 64, 48),
          ("square.avi", 13, 64, 64), ("cinema.mp4", 17, 34, 80), ("photo.jpg", 1, 64, 96), ("tall.png", 1, 96, 64),
          ("anim.gif", 5, 48, 48)]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=832, help="the fixed size (and area) to compare with")
    p.add_argument("--height", type=int, default=480)
    p.add_argument("--stride", type=int, default=16, help="bucket sides in steps of (VAE x patch)")
    p.add_argument("--copies", type=int, default=4, help="copies of the generated folder's files (loader section)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per runner per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--sections", nargs="+", default=["packing", "loader"], choices=["packing", "loader"])
    p.add_argument("--out", default="runs/bench/data")
    p.add_argument("--quick", action="store_true", help="one copy, two steps, one round")
    args = p.parse_args(argv)
    if args.quick:
        args.copies, args.steps, args.rounds = 1, 2, 1
    return args


def packing(args) -> dict:
    """Mean share of pixels kept: aspect buckets vs the fixed centre crop."""
    buckets = aspect_buckets(target_area([args.width, args.height], args.stride, "--width/--height"), args.stride)
    rows = []
    for name, h, w in ASPECTS:
        bucket = nearest_bucket(h, w, buckets)
        rows.append({"clip": name, "height": h, "width": w, "bucket": list(bucket),
                     "kept_buckets": round(pixels_kept(h, w, *bucket), 4),
                     "kept_centre_crop": round(pixels_kept(h, w, args.height, args.width), 4)})
    small = aspect_buckets(80 * 48, args.stride)  # the generated folder's own scale
    files = [{"clip": name, "kept_buckets": round(pixels_kept(h, w, *nearest_bucket(h, w, small)), 4),
              "kept_centre_crop": round(pixels_kept(h, w, 48, 80), 4)} for name, _, h, w in FOLDER]

    def mean(table, key):
        return round(statistics.mean(r[key] for r in table), 4)

    return {"aspects": rows, "folder": files,
            "mean_kept": {"aspects": {"buckets": mean(rows, "kept_buckets"), "centre_crop": mean(rows, "kept_centre_crop")},
                          "folder": {"buckets": mean(files, "kept_buckets"), "centre_crop": mean(files, "kept_centre_crop")}}}


def _trainer(work: Path, args):
    from slidefusion.testing.media import make_folder
    from slidefusion.testing.tiny import save_tiny_wan_pipeline
    from slidefusion.training import Trainer, load_config
    from slidefusion.training.trainer import cache_only

    folder = save_tiny_wan_pipeline(work / "wan")
    files = [(f"{k}-{name}", f, h, w) for k in range(args.copies) for name, f, h, w in FOLDER]
    data = make_folder(work / "data", files)
    config = load_config(ROOT / "configs" / "wan-finetune.yaml", [
        f"model.pretrained={folder}", f"data.root={data}", "data.resolution=[80, 48]", "data.frame_buckets=[1, 5, 9, 17]",
        "run.device=cpu", f"run.batch_size={args.batch}", f"run.output_dir={work / 'runs'}", "optim.warmup_steps=0",
        "offload.compute_dtype=float32"])
    trainer = Trainer(config, quiet=True)
    cache_only(trainer)
    with trainer.lock():
        trainer.prepare()
    return trainer


def loader(args) -> dict:
    """Median seconds per step of the loader alone and of a whole step, alternating."""
    from slidefusion.training.trainer import step_generator

    with tempfile.TemporaryDirectory() as tmp:
        trainer = _trainer(Path(tmp), args)
        task, seed = trainer.task, trainer.config.run.seed
        times = {"loader": [], "step": []}
        for round_ in range(args.rounds + 1):  # round 0 warms up
            for runner in ("loader", "step"):
                start = time.perf_counter()
                for step in range(args.steps):
                    fns = task.loss_fn(step_generator(seed, step), step)
                    if runner == "step":
                        trainer.optimizer.train_step(fns)
                if round_:
                    times[runner].append((time.perf_counter() - start) / args.steps)
        per_step = {k: statistics.median(v) for k, v in times.items()}
        return {"clips": len(task.dataset), "steps_per_epoch": task.steps_per_epoch, "batch": args.batch,
                "median_s_per_step": per_step, "step_over_loader": per_step["step"] / per_step["loader"]}


def machine() -> dict:
    return {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
            "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    results = {"machine": machine(), "args": vars(args)}
    if "packing" in args.sections:
        results["packing"] = packing(args)
        kept = results["packing"]["mean_kept"]
        print(f"pixels kept (mean): aspect buckets {kept['aspects']['buckets']:.1%} vs centre crop "
              f"{kept['aspects']['centre_crop']:.1%} on {len(ASPECTS)} common aspect ratios; "
              f"{kept['folder']['buckets']:.1%} vs {kept['folder']['centre_crop']:.1%} on the generated folder")
    if "loader" in args.sections:
        results["loader"] = loader(args)
        row = results["loader"]
        print(f"loader {row['median_s_per_step']['loader'] * 1e3:.2f} ms/step, training step "
              f"{row['median_s_per_step']['step'] * 1e3:.2f} ms/step: the step takes {row['step_over_loader']:.1f}x the "
              f"loader ({row['clips']} clips, batch {row['batch']})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.json").write_text(json.dumps(results, indent=1))
    print(f"wrote {out / 'data.json'}")
    return results


if __name__ == "__main__":
    main()
