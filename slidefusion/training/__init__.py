"""Training: typed config, the loop, and atomic checkpoints."""

from slidefusion.io.checkpoint import load_checkpoint, save_checkpoint
from slidefusion.training.config import DataConfig, OptimConfig, ParallelTrainConfig, RunConfig, TrainConfig, load_config
from slidefusion.training.trainer import ResidentOptimizer, Trainer, TrainResult
from slidefusion.training.weights import load_matching

__all__ = ["load_checkpoint", "load_matching", "save_checkpoint", "DataConfig", "OptimConfig", "ParallelTrainConfig", "RunConfig",
           "TrainConfig", "load_config", "ResidentOptimizer", "Trainer", "TrainResult"]
