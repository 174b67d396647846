"""Score videos against their prompts: the moving-shapes detector plus the model-free video metrics.

One video gives one row: the detector's verdicts (`shapes_detector.score`: colour, shape, direction,
speed, aligned, consistency) and the three video metrics (`video_metrics`: temporal flickering,
motion smoothness, warping error). A set of rows gives one summary: the rate of each verdict and
the mean of each metric. The same code scores generated videos and dataset clips (the ground
truth), so the two summaries are directly comparable.
"""

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from slidefusion.data.shapes import MovingShapes, parse_caption
from slidefusion.core.errors import UserError, check
from slidefusion.eval.shapes_detector import score, summarize
from slidefusion.eval.video_metrics import video_metrics

PROMPT_SEED = 10_000  # held-out prompts: the training data uses small seeds (configs use 0)
METRICS = ("temporal_flickering", "motion_smoothness", "warping_error")
# Columns of the printed table: (summary key, header, format); means carry their standard error.
COLUMNS = (
    ("aligned", "text alignment", "{:.3f}"),
    ("color_ok", "colour", "{:.2f}"),
    ("shape_ok", "shape", "{:.2f}"),
    ("direction_ok", "direction", "{:.2f}"),
    ("heading_ok", "heading", "{:.2f}"),
    ("background_ok", "background", "{:.2f}"),
    ("consistency", "subject consistency", "{:.3f}"),
    ("temporal_flickering", "temporal flickering", "{:.4f}"),
    ("motion_smoothness", "motion smoothness", "{:.4f}"),
    ("warping_error", "warping error", "{:.4f}"),
)


@dataclass
class SamplingSettings:
    """How videos are generated for evaluation; video i uses seed `seed + i`."""

    frames: int | None = None  # None: the length the model was trained on
    steps: int = 20
    guidance: float = 4.0
    seed: int = 0
    batch_size: int = 8

    def __post_init__(self):
        check(self.frames is None or self.frames >= 1, f"frames={self.frames} must be >= 1")
        check(self.steps >= 1, f"steps={self.steps} must be >= 1")
        check(self.guidance >= 0, f"guidance={self.guidance} must be >= 0")
        check(self.batch_size >= 1, f"batch_size={self.batch_size} must be >= 1")


def held_out_prompts(num: int, max_objects: int = 1, seed: int = PROMPT_SEED) -> list[str]:
    """`num` captions of scenes the training data (seed 0) does not contain as such."""
    check(num >= 1, f"num={num} must be >= 1")
    data = MovingShapes(num, frames=1, height=8, width=8, seed=seed, max_objects=max_objects)
    return [data[i]["caption"] for i in range(num)]


def read_prompts(path: str | Path, num: int) -> list[str]:
    """One prompt per line (blank lines and lines starting with # skipped), cycled to `num`."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"--prompts {path}: no such file; give a text file with one prompt per line")
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]
    if not prompts:
        raise UserError(f"--prompts {path}: the file holds no prompt")
    for prompt in prompts:
        parse_caption(prompt)  # the detector needs the moving-shapes grammar; fail before sampling
    return [prompts[i % len(prompts)] for i in range(num)]


def score_video(video, prompt: str) -> dict:
    """One row: the detector's verdicts for `prompt` and the video metrics."""
    return {"prompt": prompt, **score(video, prompt), **video_metrics(video)}


def summarize_rows(rows: list[dict]) -> dict[str, float]:
    """Rates of the detector's verdicts and means of the video metrics over `rows`."""
    summary = dict(summarize(rows))
    for name in ("consistency", *METRICS):
        values = [row[name] for row in rows if math.isfinite(row[name])]
        summary[name] = float(np.mean(values)) if values else float("nan")
        summary[f"{name}_se"] = float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else float("nan")
    summary["videos"] = int(summary.pop("count"))
    return summary


def evaluate_ground_truth(num: int, frames: int, height: int, width: int, max_objects: int = 1,
                          seed: int = PROMPT_SEED, progress: bool = True) -> tuple[list[dict], dict]:
    """Score `num` dataset clips against their own captions: the ceiling a model can reach."""
    data = MovingShapes(num, frames=frames, height=height, width=width, seed=seed, max_objects=max_objects)
    items = [data[i] for i in tqdm(range(num), desc="ground truth", disable=not progress, leave=False)]
    return evaluate_videos([item["video"] for item in items], [item["caption"] for item in items])


def generate_videos(pipeline, prompts: list[str], settings: SamplingSettings, progress: bool = True):
    """Decoded videos (3, T, H, W) in [-1, 1], sampled `batch_size` prompts at a time."""
    videos = []
    batches = range(0, len(prompts), settings.batch_size)
    for start in tqdm(batches, desc="sampling", disable=not progress, leave=False):
        chunk = prompts[start:start + settings.batch_size]
        seeds = [settings.seed + start + i for i in range(len(chunk))]
        latents = pipeline.latents_batch(chunk, seeds, frames=settings.frames, steps=settings.steps,
                                         guidance=settings.guidance)
        videos += list(pipeline.decode_batch(latents))
    return videos


def evaluate_videos(videos, prompts: list[str]) -> tuple[list[dict], dict]:
    """Score video i against prompt i: (rows, summary)."""
    check(len(videos) == len(prompts), f"{len(videos)} videos but {len(prompts)} prompts")
    rows = [score_video(video, prompt) for video, prompt in zip(videos, prompts)]
    return rows, summarize_rows(rows)


def evaluate_pipeline(pipeline, prompts: list[str], settings: SamplingSettings,
                      progress: bool = True) -> tuple[list[dict], dict]:
    """Generate one video per prompt and score it; the summary also records sampling time."""
    start = time.perf_counter()
    with torch.inference_mode():
        videos = generate_videos(pipeline, prompts, settings, progress)
    seconds = time.perf_counter() - start
    rows, summary = evaluate_videos(videos, prompts)
    summary["sampling_s_per_video"] = seconds / len(prompts)
    return rows, summary


def format_table(summaries: dict[str, dict]) -> str:
    """A markdown table, one row per named summary."""
    header = "| | " + " | ".join(title for _, title, _ in COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(COLUMNS) + 1)]
    for name, summary in summaries.items():
        cells = [_cell(summary, key, fmt) for key, _, fmt in COLUMNS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(summary: dict, key: str, fmt: str) -> str:
    """The value, with its standard error over videos when the summary has one."""
    if key not in summary:
        return "-"
    se = summary.get(f"{key}_se")
    return fmt.format(summary[key]) + ("" if se is None or not math.isfinite(se) else " ± " + fmt.format(se))


def write_json(path: str | Path, payload: dict) -> Path:
    """Write JSON atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=_jsonable))
    tmp.replace(path)
    return path


def _jsonable(value):
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    raise TypeError(f"{type(value).__name__} is not JSON serialisable")
