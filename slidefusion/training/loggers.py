"""Where a run's numbers and sample videos go: RUN/metrics.jsonl always, TensorBoard with
`run.tensorboard=true`, Weights & Biases with `run.wandb=PROJECT`.

    log = RunLog(run_dir, config)          # opens what the config asks for (a missing package: one line)
    log.scalars(step, {"loss": 0.1, "lr": 1e-4})
    log.video("validate/0", video, step, fps=16)
    log.close()

W&B runs offline with WANDB_MODE=offline (nothing leaves the machine; `wandb sync` uploads later).
A resumed run continues the same W&B run: its id is derived from the run folder's path.
"""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np

from slidefusion.core.errors import UserError


def tensorboard_writer(run_dir: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError("run.tensorboard=true needs the tensorboard package: pip install 'slidefusion[tensorboard]'") from None
    return SummaryWriter(str(run_dir / "tensorboard"))


def wandb_run(run_dir: Path, config):
    """A W&B run in `run.wandb`'s project, resumed when the run folder is (same id)."""
    try:
        import wandb
    except ImportError:
        raise UserError(f"run.wandb={config.run.wandb} needs the wandb package: pip install 'slidefusion[wandb]' "
                        "(set WANDB_MODE=offline to log without a network)") from None
    run_id = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return wandb.init(project=config.run.wandb, name=config.run.name, id=run_id, resume="allow",
                      dir=str(run_dir), config=config.to_dict())


def _gif_bytes(frames: np.ndarray, fps: float) -> bytes:
    """uint8 (T, H, W, 3) as an animated GIF: what TensorBoard shows as a video."""
    from PIL import Image

    from slidefusion.data.video_io import gif_frame_ms

    images = [Image.fromarray(f) for f in frames]
    out = io.BytesIO()
    images[0].save(out, format="GIF", save_all=True, append_images=images[1:], duration=gif_frame_ms(fps), loop=0)
    return out.getvalue()


def add_tensorboard_video(writer, tag: str, frames: np.ndarray, step: int, fps: float) -> None:
    """A video summary from our own GIF encoder (torch's `add_video` needs moviepy)."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    t, h, w, c = frames.shape
    image = Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=_gif_bytes(frames, fps))
    writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=tag, image=image)]), step)


class RunLog:
    """metrics.jsonl (appended, one record per logged step), and TensorBoard / W&B as configured."""

    def __init__(self, run_dir: Path, config):
        self.run_dir = Path(run_dir)
        self.writer = tensorboard_writer(self.run_dir) if config.run.tensorboard else None
        self.wandb = wandb_run(self.run_dir, config) if config.run.wandb else None
        self.file = open(self.run_dir / "metrics.jsonl", "a")

    def scalars(self, step: int, values: dict, prefix: str = "train") -> None:
        """One metrics.jsonl record {"step": step, **values}; numbers go to TensorBoard / W&B as prefix/name."""
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        numbers = {k: v for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.writer is not None:
            for name, value in numbers.items():
                self.writer.add_scalar(f"{prefix}/{name}", value, step)
        if self.wandb is not None:
            self.wandb.log({f"{prefix}/{k}": v for k, v in numbers.items()}, step=step)

    def video(self, tag: str, frames: np.ndarray, step: int, fps: float, path: Path) -> None:
        """A sample video: uint8 frames (T, H, W, 3) to TensorBoard, its mp4 file `path` to W&B
        (a file needs no moviepy there)."""
        if self.writer is not None:
            add_tensorboard_video(self.writer, tag, frames, step, fps)
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Video(str(path), format="mp4")}, step=step)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()
