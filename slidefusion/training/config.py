"""Training configuration: typed dataclasses, filled from YAML and `section.key=value` overrides.

Every key is checked (`slidefusion.io.config.build`): an unknown one, or a value of the wrong type,
is a `UserError` that names the dotted key and what would be valid.
"""

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from slidefusion.core import validate
from slidefusion.core.errors import UserError, check
from slidefusion.data.config import DataConfig  # noqa: F401  (re-exported: a config section)
from slidefusion.diffusion.flow import FlowConfig
from slidefusion.io.config import build, read_yaml
from slidefusion.offload.policy import AUTO, OffloadPolicy
from slidefusion.optim import OptimConfig  # noqa: F401  (re-exported: a config section)
from slidefusion.run_config import SamplingConfig
from slidefusion.training.validation_config import ValidateConfig

RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a plain folder name: no path, not . or ..
RUN_SEED_MAX = 2**32 - 1  # step seeds are seed * 1_000_003 + step, which must stay below 2**64
AUTO_DEVICE = "auto"  # run.device: the GPU when there is one, else the CPU


@dataclass
class RunConfig:
    """Length of the run, batch, logging and checkpoints (runs/NAME/checkpoint-STEP/)."""

    name: str = "run"
    output_dir: str = "runs"
    steps: int = 1000
    batch_size: int = 8
    seed: int = 0
    log_every: int = 10
    save_every: int = 500
    keep_last: int | None = 3  # older checkpoints are deleted; null keeps all
    device: str = "cpu"  # cpu, cuda, cuda:N, or auto (the GPU when there is one)
    tensorboard: bool = False
    grad_accum: int = 1  # micro-batches per optimizer step: a batch of batch_size x grad_accum
    epochs: int | None = None  # the run's length in epochs instead of run.steps (fine-tunes of folders)
    wandb: str | None = None  # a Weights & Biases project to log to (WANDB_MODE=offline works)

    def __post_init__(self):
        for name in ("steps", "batch_size", "log_every", "save_every", "grad_accum"):
            value = getattr(self, name)
            check(value >= 1, f"run.{name}={value} must be >= 1")
        check(self.keep_last is None or self.keep_last >= 1, f"run.keep_last={self.keep_last} must be >= 1 or null")
        check(isinstance(self.name, str) and RUN_NAME.match(self.name) is not None and len(self.name) <= 200,
              f"run.name={self.name!r} must be a plain folder name: letters, digits, '.', '_' or '-', "
              "starting with a letter or digit")
        check(bool(str(self.output_dir).strip()), f"run.output_dir={self.output_dir!r} must name a folder")
        check(bool(str(self.device).strip()), f"run.device={self.device!r} must name a device, e.g. cpu or cuda")
        validate.integer(self.seed, "run.seed", 0, RUN_SEED_MAX)
        check(self.steps <= 2**62, f"run.steps={self.steps} must be <= 2**62")
        check(self.epochs is None or 1 <= self.epochs <= 2**31, f"run.epochs={self.epochs} must be >= 1 or null")
        check(self.wandb is None or (isinstance(self.wandb, str) and self.wandb.strip() != "" and "/" not in self.wandb),
              f"run.wandb={self.wandb!r} must name a W&B project (e.g. my-finetunes) or be null")

    @property
    def auto_device(self) -> bool:
        return str(self.device).strip().lower() == AUTO_DEVICE

    def resolved_device(self) -> str:
        """`device`, with `auto` read as cuda when CUDA has a device here, else cpu."""
        if not self.auto_device:
            return self.device
        return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class ParallelTrainConfig:
    """The `parallel:` section: how a run launched on several ranks (`torchrun --nproc-per-node N -m
    slidefusion train CONFIG ...`) splits its work; a run on one process ignores it. The world of
    ranks is `dp x sp`: `sp` ranks share each sample (sequence parallelism, Ulysses over heads) and
    the `dp = world / sp` groups of them each take their own samples (data parallelism).

    Resident runs: plain data parallelism (gradients all-reduced), or `fsdp` (FSDP2, one
    `fully_shard` per block; `cpu_offload`: its CPUOffloadPolicy). Offloaded runs (`--offload`):
    the offload engine with its host state sharded over the ranks, one host copy per node
    (`shared_host`). The spelling other trainers document, `train.parallel.KEY`, means `parallel.KEY`."""

    fsdp: bool = False  # resident only: FSDP2 per block with a bf16/fp32 mixed precision policy
    cpu_offload: bool = False  # with fsdp: FSDP2's CPUOffloadPolicy (parameters and optimizer on the host)
    sp: int = 1  # ranks per sample (Ulysses over attention heads); must divide the world and be <= the heads
    shared_host: bool = True  # offload: the node's ranks share one host compute copy in /dev/shm
    timeout_s: float = 300.0  # every collective's limit: a dead or stuck rank ends the others after this

    def __post_init__(self):
        validate.integer(self.sp, "parallel.sp", 1, 1 << 16)
        validate.finite(self.timeout_s, "parallel.timeout_s", 0, 86_400, low_open=True)
        check(self.fsdp or not self.cpu_offload, "parallel.cpu_offload=true needs parallel.fsdp=true (it is FSDP2's "
                                                 "CPUOffloadPolicy; the offload engine is --offload)")


@dataclass
class TrainConfig(SamplingConfig):
    """A training run: what it trains (`SamplingConfig`'s sections: the model, LoRA, the video, text
    encoder and autoencoder) and how (the objective, the optimizer, the run, the offload engine,
    validation during training)."""

    diffusion: FlowConfig = field(default_factory=FlowConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    offload: OffloadPolicy = field(default_factory=OffloadPolicy)  # `enabled` (--offload) trains with the engine
    validate: ValidateConfig = field(default_factory=ValidateConfig)  # samples and a held-out loss (folders)
    parallel: ParallelTrainConfig = field(default_factory=ParallelTrainConfig)  # under torchrun: dp x sp ranks

    def __post_init__(self):
        super().__post_init__()
        check(self.parallel.sp == 1 or self.offload.tile in (None, AUTO),
              f"parallel.sp={self.parallel.sp} with offload.tile={self.offload.tile}: tiles inside a sequence-parallel "
              "block are not supported; use offload.tile=off (each rank already holds 1/sp of the tokens)")
        check(not self.parallel.cpu_offload or str(self.run.device).startswith("cuda"),
              f"parallel.cpu_offload=true keeps FSDP2's parameters on the host for a GPU to compute with; "
              f"run.device={self.run.device} has none (use run.device=cuda, or parallel.cpu_offload=false)")
        check(not (self.parallel.fsdp and self.offload.enabled),
              "parallel.fsdp=true shards resident training; --offload (offload.enabled) shards the offload engine's "
              "host state instead: choose one")


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML config (or the defaults when `path` is None), apply overrides, validate."""
    data = read_yaml(path, overrides)
    merge_train_alias(data)
    return build(TrainConfig, data)


def merge_train_alias(data: dict) -> None:
    """Accept `train.parallel.KEY` (the spelling other trainers document) as `parallel.KEY`, in place."""
    train = data.pop("train", None)
    if train is None:
        return
    if not isinstance(train, dict) or set(train) != {"parallel"} or not isinstance(train["parallel"], dict):
        raise UserError(f"config key train={train!r} is unknown; only train.parallel.KEY is accepted (the same as "
                        "parallel.KEY, e.g. train.parallel.fsdp=true)")
    section = data.setdefault("parallel", {})
    check(isinstance(section, dict), f"parallel={section!r} must be a section (a mapping), e.g. parallel.sp=2")
    section.update(train["parallel"])
