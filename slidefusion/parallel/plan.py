"""Parallel schedules and plans as data; `engine.parallelize` is the one function that reads them.

A *schedule* says which layers run in how many slices, whether the switches between layouts are
overlapped, and whether attention is head-parallel (Ulysses). A *plan* is what a schedule needs
from one model: its blocks in call order, each block's kind and the layout that kind needs, and
the self-attention sites. The model facts come from `records.record_for` (the model's adapter) and
`records.model_access` (what the adapter contract does not say), never from a branch on a class here.
"""

from dataclasses import dataclass

from slidefusion.core.errors import UserError, check, choose
from slidefusion.parallel.comm import LinkDelay
from slidefusion.parallel.layout import FRAMES, POSITIONS
from slidefusion.parallel.records import AttentionSite, ModelAccess, access_for, model_access, record_for

# The sharded axis each block kind needs under sequence parallelism (whole frames for a spatial
# block, whole time lines for a temporal one). A "full" block attends over every token: only the
# head-parallel schedule can run it.
KIND_LAYOUT: dict[str, int | None] = {"spatial": FRAMES, "temporal": POSITIONS, "full": None}


@dataclass(frozen=True)
class Schedule:
    """slice_frames / slice_positions: layers of that layout run in N slices (--slices N);
    overlap: switches are asynchronous (waited per chunk) instead of blocking; heads: Ulysses;
    slice_exchange: each Ulysses all-to-all is cut into N token chunks (full-3D attention)."""

    name: str
    slice_frames: bool = False
    slice_positions: bool = False
    overlap: bool = False
    heads: bool = False
    slice_exchange: bool = False
    default_slices: int = 1
    doc: str = ""

    def slices(self, layout: int, n: int) -> int:
        sliced = self.slice_frames if layout == FRAMES else self.slice_positions
        return n if sliced else 1

    @property
    def sliced(self) -> bool:
        """Whether --slices N > 1 means anything for this schedule."""
        return self.slice_frames or self.slice_positions or self.slice_exchange


SCHEDULES: dict[str, Schedule] = {s.name: s for s in (
    Schedule("dsp", doc="blocking all-to-all switches frames <-> positions around each spatial block (the baseline)"),
    Schedule("ulysses", heads=True, slice_exchange=True,
             doc="tokens stay sharded; head all-to-all around each attention that spans ranks. --slices N > 1 "
                 "(full-3D attention): each all-to-all in N token chunks under the projections and attention"),
    Schedule("scalefusion", slice_frames=True, overlap=True, default_slices=4,
             doc="spatial layers run in N frame slices; slice k+1 arrives and slice k-1 leaves under slice k's compute"),
    Schedule("scalefusion-inter", slice_frames=True, slice_positions=True, overlap=True, default_slices=4,
             doc="also temporal layers run in N position slices, so each switch starts per slice as soon as "
                 "the producing layer finished it, under the rest of that layer (N x N chunks per switch)"),
)}


DEFAULT_TIMEOUT_S = 300.0  # seconds before a collective waiting on a dead or stuck rank fails


@dataclass(frozen=True)
class ParallelConfig:
    """What a user asks for. `slices`: an int >= 1, "auto", or None for the schedule's default;
    `link_delay` is for benchmarks only."""

    schedule: str = "scalefusion"
    slices: int | str | None = None
    cfg_parallel: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    link_delay: LinkDelay | None = None

    def __post_init__(self):
        choose(self.schedule, SCHEDULES, "schedule")
        ok = self.slices in (None, "auto") or (isinstance(self.slices, int) and not isinstance(self.slices, bool)
                                               and 1 <= self.slices <= 64)
        check(ok, f"slices={self.slices!r} must be an int in 1..64 or 'auto'")
        sched = SCHEDULES[self.schedule]
        check(sched.sliced or self.slices in (None, 1),
              f"slices={self.slices!r} does not apply to the {self.schedule} schedule (it has no slices); "
              f"valid: 1, or a sliced schedule ({', '.join(n for n, s in SCHEDULES.items() if s.sliced)})")
        check(self.timeout_s > 0, f"timeout_s={self.timeout_s} must be > 0")

    @property
    def requested_slices(self) -> int | str:
        return SCHEDULES[self.schedule].default_slices if self.slices is None else self.slices


@dataclass(frozen=True)
class Plan:
    """One model under one schedule: its adapter and parallel access record, blocks in call order,
    their kinds, and the attention sites that span ranks under Ulysses (every site but temporal
    ones, which are local when sharded by positions)."""

    model: str  # the model's class name
    adapter: object
    access: ModelAccess
    blocks: list
    kinds: list[str]
    sites: list[AttentionSite]

    @property
    def full(self) -> bool:
        return all(kind == "full" for kind in self.kinds)

    @property
    def head_sites(self) -> list[AttentionSite]:
        return [site for site in self.sites if site.kind != "temporal"]


def plan_for(model, schedule: Schedule, ranks: int | None = None) -> Plan:
    """The plan of `model` under `schedule` on `ranks` ranks, or a UserError saying what would run."""
    adapter = record_for(model)
    blocks, kinds = adapter.blocks(model), adapter.block_kinds(model)
    unknown = sorted(set(kinds) - set(KIND_LAYOUT))
    check(not unknown, f"blocks of kind {unknown} have no parallel layout; known: {sorted(KIND_LAYOUT)}")
    plan = Plan(adapter.class_name, adapter, model_access(adapter), blocks, kinds, adapter.attention_sites(model))
    if not schedule.heads and any(KIND_LAYOUT[k] is None for k in kinds):
        raise UserError(f"parallel schedule {schedule.name!r} needs spatial/temporal blocks; {plan.model} "
                        f"attends over all tokens at once; valid for {plan.model}: ulysses")
    if schedule.heads:
        modules = [model.get_submodule(site.path) for site in plan.head_sites]
        heads = min(access_for(m).heads(m) for m in modules)  # access_for rejects operators heads cannot split
        if ranks is not None and ranks > heads:
            raise UserError(f"ulysses splits attention heads over ranks: {ranks} ranks > {heads} heads of "
                            f"{plan.model}; valid: at most {heads} ranks per sequence group")
    return plan


def check_slices(plan: Plan, schedule: Schedule, slices: int | str) -> None:
    """Sliced Ulysses needs full-3D attention (a spatial-temporal model slices by frames instead)."""
    if schedule.heads and isinstance(slices, int) and slices > 1 and not plan.full:
        raise UserError(f"ulysses --slices {slices} slices full-3D attention; {plan.model} has spatial/temporal "
                        f"blocks; valid: ulysses --slices 1, or scalefusion / scalefusion-inter")


def check_fit(model, config: ParallelConfig, world: int | None) -> Plan:
    """Everything about `config` for `model` on `world` ranks (None: any) known before a process group exists."""
    ranks = world
    if world is not None and config.cfg_parallel:
        check(world % 2 == 0, f"cfg_parallel needs an even number of ranks; got {world}")
        ranks = world // 2
    schedule = SCHEDULES[config.schedule]
    plan = plan_for(model, schedule, ranks)
    check_slices(plan, schedule, config.requested_slices)
    return plan


def parse_slices(text: str | None) -> int | str | None:
    """--slices N|auto (None: the schedule's default)."""
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--slices={text!r} must be an integer >= 1 or 'auto'") from None
