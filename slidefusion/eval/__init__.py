"""Offline measures of generated videos, and the experiments that use them.

- `video_metrics`: temporal flickering (VBench's formula), motion smoothness and warping error from
  Farneback optical flow; no learned model.
- `shapes_detector`: text alignment and subject consistency for the moving-shapes domain.
- `evaluate`: both applied to generated videos or dataset clips (`slidefusion evaluate`).
- `ablation`: `slidefusion experiment attention-ablation`.
"""

from slidefusion.eval.evaluate import evaluate_ground_truth, evaluate_pipeline, evaluate_videos, score_video
from slidefusion.eval.shapes_detector import detect, score, summarize
from slidefusion.eval.video_metrics import motion_smoothness, temporal_flickering, video_metrics, warping_error

__all__ = [
    "detect", "evaluate_ground_truth", "evaluate_pipeline", "evaluate_videos",
    "motion_smoothness", "score", "score_video", "summarize", "temporal_flickering", "video_metrics", "warping_error",
]
