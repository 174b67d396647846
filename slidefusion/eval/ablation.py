"""`slidefusion experiment attention-ablation`: MegaSlide's attention comparison, in small.

The paper pretrains with dense attention on short clips, then adapts to long clips with each
attention and compares quality. Here:

1. **Pretrain** a dense-attention DiT on short moving-shapes clips. The full budget reuses the
   bundled demo model (dit3d-small, 8 frames of 32x32; `configs/shapes-small.yaml` and
   `docs/results/demo-model.md` for its training chain), so its cost is not counted again; the quick
   budget pretrains a tiny model from scratch.
2. **Adapt** (`--init-from` semantics: every weight whose name and shape match loads, the slide
   offset network starts at zero, i.e. as neighbourhood attention) to clips `long_frames` long with
   each variant, on the same data, steps, batch and seed.
3. **Evaluate** every adapted model at the short and at the long length on the same held-out
   prompts and seeds, next to the pretrained model and the ground-truth clips.
4. Compare slide with each other row video by video (`paired_differences`): the same prompts and
   seeds, so what a prompt or a seed does to both cancels, and the standard error is the
   difference's, smaller than either row's.
5. Write `results.json`, `results.md` (the tables) and `losses.png` (the adaptation loss curves).

Every stage is resumable: a finished training run or evaluation is found on disk and skipped, an
interrupted one continues from its newest checkpoint, so rerunning the same command finishes it.
"""

import json
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from slidefusion.core.errors import check, choose, unknown_value
from slidefusion.eval.evaluate import (
    SamplingSettings,
    evaluate_ground_truth,
    evaluate_videos,
    format_table,
    generate_videos,
    held_out_prompts,
    write_json,
)
from slidefusion.models import preset
from slidefusion.io.checkpoint import checkpoint_steps, load_checkpoint
from slidefusion.training.config import DataConfig, OptimConfig, RunConfig, TrainConfig, build

# Every local attention sees the same number of keys per query (3 x 5 x 5 = 75 tokens) at the
# long length's 32 x 8 x 8 token grid, so the comparison is about *which* keys, not how many.
VARIANTS: dict[str, tuple[str, dict]] = {
    "dense": ("dense", {}),
    "window": ("window", {"window_size": [3, 5, 5]}),  # Swin: shifted by half a window on odd blocks
    "neighborhood": ("neighborhood", {"kernel_size": [3, 5, 5]}),  # slide with offsets fixed at zero
    "slide": ("slide", {"kernel_size": [3, 5, 5], "offsets": "sample"}),  # the paper's per-sample offsets
    "slide-shift": ("slide", {"kernel_size": [3, 5, 5], "offsets": "shift"}),  # one window shift per head
}


REFERENCE = "slide"  # the paper's comparisons: slide against dense, Swin windows, and its offsets at zero
PAIRED = ("aligned", "consistency")


@dataclass
class Budget:
    """Sizes and steps of one ablation run."""

    name: str
    pretrain_steps: int | None  # None: reuse the bundled demo model as the pretrained model
    short_frames: int
    long_frames: int
    height: int
    width: int
    adapt_steps: int
    batch_size: int
    lr: float
    eval_videos: int
    sampling: SamplingSettings
    pretrain_model: str = "dit3d-small"
    attention_options: dict = field(default_factory=dict)  # variant -> options override (small grids)

    def __post_init__(self):
        for key in ("short_frames", "long_frames", "height", "width", "adapt_steps", "batch_size", "eval_videos"):
            check(getattr(self, key) >= 1, f"{key}={getattr(self, key)} must be >= 1")
        check(self.long_frames > self.short_frames, f"long_frames={self.long_frames} must exceed short_frames={self.short_frames}")


BUDGETS: dict[str, Budget] = {
    # About 110 minutes on 2 cores (measured: 50 min for 5 x 240 adaptation steps of batch 4 at 32
    # frames, 57 min to sample and score 6 models x 2 lengths x 48 videos; README).
    "full": Budget("full", pretrain_steps=None, short_frames=8, long_frames=32, height=32, width=32,
                   adapt_steps=240, batch_size=4, lr=2e-4, eval_videos=48,
                   sampling=SamplingSettings(steps=20, guidance=4.0, seed=0, batch_size=8)),
    # Half the length ratio, four times the steps: long enough an adaptation for the motion to come
    # back, so that text alignment can separate the variants (docs/results/demo-model.md: the 16-frame
    # pilots). Scored on 144 prompts, three times `full`'s, so that the binomial standard error of
    # alignment (0.02-0.04) can separate neighbouring variants. About 3 h on 2 cores: 960 steps at
    # 0.7-1.8 s (neighbourhood and window the fastest, dense and slide the slowest), 10-20 min of
    # sampling and scoring per variant.
    "motion": Budget("motion", pretrain_steps=None, short_frames=8, long_frames=16, height=32, width=32,
                     adapt_steps=960, batch_size=4, lr=2e-4, eval_videos=144,
                     sampling=SamplingSettings(steps=20, guidance=4.0, seed=0, batch_size=8)),
    # A smoke run of every stage (about a minute): a tiny model, a few steps, two videos.
    "quick": Budget("quick", pretrain_steps=30, short_frames=4, long_frames=8, height=16, width=16,
                    adapt_steps=4, batch_size=2, lr=1e-3, eval_videos=2, pretrain_model="dit3d-tiny",
                    sampling=SamplingSettings(steps=2, guidance=4.0, seed=0, batch_size=2),
                    attention_options={"window": {"window_size": [3, 3, 3]}, "neighborhood": {"kernel_size": [3, 3, 3]},
                                       "slide": {"kernel_size": [3, 3, 3]}, "slide-shift": {"kernel_size": [3, 3, 3]}}),
}


def _quiet_config(config: TrainConfig, name: str, out: Path, steps: int, batch_size: int) -> TrainConfig:
    """`config` as run NAME under out/runs: `steps` of `batch_size`, three checkpoints, the last kept."""
    run = RunConfig(name=name, output_dir=str(out / "runs"), steps=steps, batch_size=batch_size,
                    seed=config.run.seed, log_every=max(1, min(10, steps // 4)), save_every=max(1, steps // 3), keep_last=1)
    return replace(config, run=run)


def _train(config: TrainConfig, init_from: Path | None, log) -> tuple[Path, float]:
    """Train (or finish training) one run; returns its final checkpoint and seconds per step."""
    from slidefusion.training import Trainer

    run_dir = Path(config.run.output_dir) / config.run.name
    done = checkpoint_steps(run_dir).get(config.run.steps)
    if done is not None:
        log(f"{config.run.name}: already trained ({done})")
        return done, _seconds_per_step(run_dir)
    trainer = Trainer(config, quiet=True)
    if checkpoint_steps(run_dir):
        trainer.resume("latest")
        log(f"{config.run.name}: resuming at step {trainer.step}")
    elif init_from is not None:
        loaded, skipped = trainer.init_from(init_from)
        log(f"{config.run.name}: initialised {len(loaded)} tensors from {init_from}; new: "
            + (", ".join(sorted({s.split(' ')[0].rsplit('.', 1)[0] for s in skipped})) or "none"))
    result = trainer.train()
    log(f"{config.run.name}: {len(result.losses)} steps in {result.seconds:.0f} s, final loss {result.losses[-1]:.4f}")
    return result.last_checkpoint, _seconds_per_step(run_dir)


def _losses(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _seconds_per_step(run_dir: Path) -> float:
    """Median wall time per step over the logged intervals (robust to a resumed segment)."""
    records, rates = _losses(run_dir), []
    for before, after in zip(records, records[1:]):
        if after["step"] > before["step"] and after["elapsed_s"] > before["elapsed_s"]:
            rates.append((after["elapsed_s"] - before["elapsed_s"]) / (after["step"] - before["step"]))
    return float(torch.tensor(rates).median()) if rates else float("nan")


def _variant_config(base: TrainConfig, budget: Budget, variant: str) -> TrainConfig:
    kind, options = VARIANTS[variant]
    options = {**options, **budget.attention_options.get(variant, {})}
    model = replace(base.model, attention=kind, attention_options=options)
    data = replace(base.data, frames=budget.long_frames, height=budget.height, width=budget.width)
    optim = OptimConfig(lr=budget.lr, warmup_steps=max(1, budget.adapt_steps // 15), max_grad_norm=1.0, ema_decay=0.999)
    return replace(base, model=model, data=data, optim=optim)


def _pretrained(budget: Budget, out: Path, log) -> tuple[Path, TrainConfig]:
    """The dense short-clip model every variant starts from, and its training config."""
    if budget.pretrain_steps is None:
        from slidefusion.pipeline import bundled_checkpoint

        path = bundled_checkpoint()
        config = build(TrainConfig, load_checkpoint(path).config)
        check(config.data.frames == budget.short_frames and config.model.attention == "dense",
              f"the bundled model ({config.data.frames} frames, {config.model.attention}) does not fit budget {budget.name}")
        log(f"pretrained: the bundled demo model {path}")
        return path, config
    config = TrainConfig(model=preset(budget.pretrain_model),
                         data=DataConfig(frames=budget.short_frames, height=budget.height, width=budget.width),
                         optim=OptimConfig(lr=budget.lr, warmup_steps=5))
    config = _quiet_config(config, "pretrain", out, budget.pretrain_steps, budget.batch_size)
    path, _ = _train(config, None, log)
    return path, config


def _evaluate(name: str, checkpoint: Path, frames: int, prompts: list[str], budget: Budget, out: Path,
              log) -> tuple[dict, list[dict]]:
    """Evaluate one checkpoint at one length. The sampled videos are kept (out/eval/NAME-Ff.npz,
    uint8): a rerun re-scores them and samples only prompts the file does not hold yet (video i
    always uses seed `sampling.seed + i`), so scores and the table always come from the current code."""
    from slidefusion.data.video_io import to_uint8
    from slidefusion.pipeline import VideoPipeline

    cache = out / "eval" / f"{name}-{frames}f.npz"
    videos, seconds = [], 0.0  # seconds of sampling in all, for the videos held
    if cache.is_file():
        saved = np.load(cache)
        held = saved["prompts"].tolist()[:len(prompts)]
        check(held == prompts[:len(held)], f"{cache} holds other prompts; delete it to resample")
        videos = list(saved["videos"][:len(held)])
        seconds = float(saved["sampling_s_per_video"]) * len(held)
    if len(videos) < len(prompts):
        start = time.perf_counter()
        settings = replace(budget.sampling, frames=frames, seed=budget.sampling.seed + len(videos))
        with torch.inference_mode():
            pipeline = VideoPipeline.from_checkpoint(checkpoint)
            videos += [to_uint8(v) for v in generate_videos(pipeline, prompts[len(videos):], settings, progress=False)]
        seconds += time.perf_counter() - start
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f".{cache.stem}.tmp.npz")
        np.savez_compressed(tmp, videos=np.stack(videos), prompts=np.array(prompts),
                            sampling_s_per_video=seconds / len(prompts))
        tmp.replace(cache)
    seconds /= len(prompts)
    rows, summary = evaluate_videos(videos, prompts)
    summary["sampling_s_per_video"] = seconds
    write_json(cache.with_suffix(".json"), {"checkpoint": str(checkpoint), "frames": frames, "summary": summary,
                                            "videos": rows})
    log(f"{name} at {frames} frames: alignment {summary['aligned']:.3f}, consistency {summary['consistency']:.3f}, "
        f"sampled at {seconds:.1f} s/video")
    return summary, rows


def paired_differences(rows: list[dict], others: list[dict]) -> dict[str, float]:
    """Mean and standard error of `rows` minus `others` video by video (the same prompt and seed),
    for alignment and subject consistency; pairs where either value is not finite are left out."""
    result = {}
    for key in PAIRED:
        pairs = [(float(a[key]), float(b[key])) for a, b in zip(rows, others, strict=True)]
        d = np.array([a - b for a, b in pairs if math.isfinite(a) and math.isfinite(b)])
        result[key] = float(d.mean()) if len(d) else math.nan
        result[f"{key}_se"] = float(d.std(ddof=1) / math.sqrt(len(d))) if len(d) > 1 else math.nan
        result[f"{key}_pairs"] = len(d)
    return result


def run_ablation(budget: Budget, out: str | Path, variants: list[str] | None = None, log=print) -> dict:
    """Run (or finish) the whole ablation into `out`; returns the results written to results.json."""
    variants = list(VARIANTS) if variants is None else variants
    for variant in variants:
        choose(variant, VARIANTS, "variant")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    pretrained, base = _pretrained(budget, out, log)
    runs = {}
    for variant in variants:
        config = _quiet_config(_variant_config(base, budget, variant), variant, out, budget.adapt_steps,
                               budget.batch_size)
        checkpoint, step_s = _train(config, pretrained, log)
        losses = _losses(out / "runs" / variant)
        tail = [r["loss"] for r in losses[-max(1, len(losses) // 5):]]
        runs[variant] = {"checkpoint": str(checkpoint), "train_s_per_step": step_s, "losses": losses,
                         "final_loss": sum(tail) / len(tail), "attention": config.model.attention,
                         "attention_options": config.model.attention_options}
    prompts = held_out_prompts(budget.eval_videos)
    lengths = {"short": budget.short_frames, "long": budget.long_frames}
    table, paired = {length: {} for length in lengths}, {length: {} for length in lengths}
    for length, frames in lengths.items():
        _, table[length]["ground truth"] = evaluate_ground_truth(budget.eval_videos, frames, budget.height, budget.width,
                                                                 progress=False)
        checkpoints = {"pretrained (dense, short clips)": ("pretrained", pretrained),
                       **{variant: (variant, runs[variant]["checkpoint"]) for variant in variants}}
        rows = {}
        for row, (name, checkpoint) in checkpoints.items():
            table[length][row], rows[row] = _evaluate(name, checkpoint, frames, prompts, budget, out, log)
        if REFERENCE in rows:
            paired[length] = {row: paired_differences(rows[REFERENCE], rows[row]) for row in rows if row != REFERENCE}
    results = {"budget": asdict(budget), "prompts": prompts, "pretrained": str(pretrained), "runs": runs,
               "table": table, "paired": paired, "seconds_this_call": time.perf_counter() - start}
    write_json(out / "results.json", results)
    (out / "results.md").write_text(results_markdown(results))
    plot_losses(runs, out / "losses.png")
    log(f"wrote {out / 'results.md'}, {out / 'results.json'}, {out / 'losses.png'}")
    return results


def results_markdown(results: dict) -> str:
    """The tables of one ablation: quality per length, then training cost per variant."""
    budget = results["budget"]
    parts = []
    for length, rows in results["table"].items():
        frames = budget[f"{length}_frames"]
        parts += [f"### {length} clips: {frames} frames of {budget['height']}x{budget['width']}, "
                  f"{budget['eval_videos']} held-out prompts", "", format_table(rows), ""]
    for length, rows in results.get("paired", {}).items():
        if rows:
            parts += [f"### {REFERENCE} minus each row at {budget[f'{length}_frames']} frames, video by video (same prompts and seeds)", "",
                      "| against | text alignment | subject consistency |", "|---|---|---|"]
            parts += [f"| {row} | {d['aligned']:+.3f} ± {d['aligned_se']:.3f} | "
                      f"{d['consistency']:+.3f} ± {d['consistency_se']:.3f} |" for row, d in rows.items()]
            parts.append("")
    parts += ["### adaptation (same data, steps, batch and seed)", "",
              "| variant | attention options | s/step | final loss (mean of last 20%) | sampling s/video (long) |",
              "|---|---|---|---|---|"]
    long_rows = results["table"]["long"]
    for variant, run in results["runs"].items():
        options = ", ".join(f"{k}={v}" for k, v in run["attention_options"].items()) or "-"
        sampling = long_rows.get(variant, {}).get("sampling_s_per_video", math.nan)
        parts.append(f"| {variant} | {options} | {run['train_s_per_step']:.2f} | {run['final_loss']:.4f} | {sampling:.2f} |")
    return "\n".join(parts) + "\n"


def plot_losses(runs: dict, path: Path) -> Path:
    """Adaptation loss against step, one line per variant (a running mean over 5 log points)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4.2))
    for variant, run in runs.items():
        steps = [r["step"] for r in run["losses"]]
        losses = torch.tensor([r["loss"] for r in run["losses"]])
        if len(losses) >= 5:
            losses = torch.nn.functional.avg_pool1d(losses[None, None], 5, 1, 2, count_include_pad=False)[0, 0]
        axis.plot(steps, losses.tolist(), label=variant)
    axis.set_xlabel("adaptation step")
    axis.set_ylabel("flow-matching loss (running mean)")
    axis.set_title("adapting the dense short-clip model to long clips")
    axis.legend()
    axis.grid(alpha=0.3)
    figure.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    figure.savefig(tmp, dpi=120)
    plt.close(figure)
    tmp.replace(path)
    return path


def budget_named(name: str) -> Budget:
    if name not in BUDGETS:
        raise unknown_value("--budget", name, BUDGETS)
    return BUDGETS[name]
