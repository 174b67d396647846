"""The `parallel:` section of a training config: how a run launched on several ranks splits its work.

Launched by torchrun (`torchrun --nproc-per-node N -m slidefusion train CONFIG ...`), the world of
ranks is `dp x sp`: `sp` ranks share each sample (sequence parallelism, Ulysses over heads) and the
`dp = world / sp` groups of them each take their own samples (data parallelism). A run on one
process ignores the section. The issue-style spelling `train.parallel.KEY=...` means `parallel.KEY`.
"""

from dataclasses import dataclass

from slidefusion import validate
from slidefusion.errors import UserError, check


@dataclass
class ParallelTrainConfig:
    """Resident runs: plain data parallelism (gradients all-reduced), or `fsdp` (FSDP2, one
    `fully_shard` per block; `cpu_offload`: its CPUOffloadPolicy). Offloaded runs (`--offload`):
    the offload engine with its host state sharded over the ranks, one host copy per node
    (`shared_host`). Either way `sp` ranks share each sample."""

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
