"""Parallel plans and schedules as data; `engine.parallelize` is the one function that reads them.

A *plan* says, per block kind of an architecture, which layout the block needs (frames or
positions) and where its self-attention lives (for head-parallel Ulysses). A *schedule* says how
many compute slices each kind of layer runs in and whether switches are overlapped. The switch
between two layers is cut into (producer slices x consumer slices) chunks, see `layout`.
"""

from dataclasses import dataclass

from slidefusion.adapters import adapter_for
from slidefusion.errors import UserError, check
from slidefusion.parallel.comm import LinkDelay
from slidefusion.parallel.layout import FRAMES, POSITIONS


@dataclass(frozen=True)
class BlockRule:
    """How one kind of block is parallelised.

    layout: the sharded axis under sequence parallelism (FRAMES: whole frames per rank; POSITIONS:
    whole time lines per rank), None if the block needs every token (then only Ulysses applies).
    attention: the attribute path to its `GridAttention`; grid: how that attention sees the tokens
    ("frame": each frame alone, "time": each position alone, "grid": the whole (T, H, W) grid).
    """

    layout: int | None
    attention: str
    grid: str


PLANS: dict[str, dict[str, BlockRule]] = {
    "stdit": {
        "spatial": BlockRule(FRAMES, "attn.inner", "frame"),
        "temporal": BlockRule(POSITIONS, "attn.inner", "time"),
    },
    "dit3d": {"full": BlockRule(None, "attn", "grid")},
}


@dataclass(frozen=True)
class Schedule:
    """slices: compute slices per layer layout (FRAMES / POSITIONS), as a function of --slices N;
    overlap: switches are asynchronous (waited per chunk) instead of blocking; heads: Ulysses."""

    name: str
    frame_slices: str = "1"  # "1" or "N"
    position_slices: str = "1"
    overlap: bool = False
    heads: bool = False
    doc: str = ""

    def slices(self, layout: int, n: int) -> int:
        return n if (self.frame_slices if layout == FRAMES else self.position_slices) == "N" else 1


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("dsp", doc="blocking all-to-all switches frames <-> positions around each spatial block (the baseline)"),
    Schedule("ulysses", heads=True,
             doc="tokens stay sharded by positions; blocking head all-to-all around each attention that spans positions"),
    Schedule("scalefusion", frame_slices="N", overlap=True,
             doc="spatial layers run in N frame slices; slice k+1 arrives and slice k-1 leaves under slice k's compute"),
    Schedule("scalefusion-inter", frame_slices="N", position_slices="N", overlap=True,
             doc="also temporal layers run in N position slices, so each switch starts per slice as soon as "
                 "the producing layer finished it, under the rest of that layer (N x N chunks per switch)"),
)}


@dataclass(frozen=True)
class ParallelConfig:
    """What a user asks for. `slices` is an int >= 1 or "auto"; `link_delay` is for benchmarks only."""

    schedule: str = "scalefusion"
    slices: int | str = 4
    cfg_parallel: bool = False
    timeout_s: float = 300.0
    link_delay: LinkDelay | None = None

    def __post_init__(self):
        check(self.schedule in SCHEDULES,
              f"parallel schedule {self.schedule!r} is unknown; valid: {', '.join(SCHEDULES)}")
        ok = self.slices == "auto" or (isinstance(self.slices, int) and not isinstance(self.slices, bool)
                                       and 1 <= self.slices <= 64)
        check(ok, f"slices={self.slices!r} must be an int in 1..64 or 'auto'")
        check(self.timeout_s > 0, f"timeout_s={self.timeout_s} must be > 0")


def plan_for(model, schedule: Schedule) -> dict[str, BlockRule]:
    """The plan of `model`'s architecture, or a UserError if the schedule cannot run it."""
    adapter = adapter_for(model)
    arch = adapter.family
    if arch not in PLANS:
        raise UserError(f"model arch {arch!r} has no parallel plan; valid: {', '.join(PLANS)}")
    plan = PLANS[arch]
    if not schedule.heads and any(rule.layout is None for rule in plan.values()):
        raise UserError(f"parallel schedule {schedule.name!r} needs spatial/temporal blocks (stdit); "
                        f"{arch} attends over the whole grid; valid for {arch}: ulysses")
    kinds = set(adapter.block_kinds(model))
    unknown = kinds - set(plan)
    check(not unknown, f"blocks of kind {sorted(unknown)} have no rule in the {arch} plan; known: {sorted(plan)}")
    return plan


def parse_slices(text: str) -> int | str:
    """--slices N|auto."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--slices={text!r} must be an integer >= 1 or 'auto'") from None
