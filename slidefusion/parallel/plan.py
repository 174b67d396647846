"""Parallel schedules and plans as data; `engine.parallelize` is the one function that reads them.

A *schedule* says which layers run in how many slices, whether the switches between layouts are
overlapped, and whether attention is head-parallel (Ulysses). A *plan* is what a schedule needs
from one model: its blocks in call order, each block's kind and the layout that kind needs, and
the self-attention sites. The model facts come from `records.record_for` (the model's adapter) and
`records.model_access` (what the adapter contract does not say), never from a branch on a class here.
"""

from dataclasses import dataclass, replace

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
    overlap: switches are asynchronous (waited per chunk) instead of blocking; heads: tokens stay
    sharded and each attention site is hooked (Ulysses and the ring schedules); slice_exchange: each
    exchange is cut into N token chunks (full-3D attention); ring: key/value blocks pass around a
    ring of ranks (`ring.py`: ring, usp, and auto, which may choose either)."""

    name: str
    slice_frames: bool = False
    slice_positions: bool = False
    overlap: bool = False
    heads: bool = False
    slice_exchange: bool = False
    default_slices: int = 1
    doc: str = ""
    ring: bool = False

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
    Schedule("ring", heads=True, slice_exchange=True, ring=True,
             doc="full-3D: every rank keeps its queries; key/value blocks pass around the ring under the attention "
                 "of the block before, merged by log-sum-exp (not limited by heads). --slices N: N chunks per block"),
    Schedule("usp", heads=True, slice_exchange=True, ring=True,
             doc="full-3D, Ulysses x Ring (--ulysses U --ring R, U x R ranks): a head all-to-all inside groups of "
                 "U consecutive ranks, a ring across the R groups. --slices N: N token chunks per exchange"),
    Schedule("auto", heads=True, slice_exchange=True, ring=True,
             doc="full-3D: ulysses, ring or usp, their degrees and slices chosen from a cost model calibrated on "
                 "this run (measured compute, link and per-slice cost; the shortlist is timed)"),
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
    ulysses: int | None = None
    ring: int | None = None

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
        self._check_degrees()

    def _check_degrees(self) -> None:
        """--ulysses U / --ring R: usp needs at least one (the other follows from the ranks); no other
        schedule takes them (ring is U = 1, and auto chooses)."""
        given = [f"--{k} {v}" for k, v in (("ulysses", self.ulysses), ("ring", self.ring)) if v is not None]
        for key in ("ulysses", "ring"):
            value = getattr(self, key)
            check(value is None or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 4096),
                  f"{key}={value!r} must be an int in 1..4096")
        if self.schedule == "usp":
            check(bool(given), "--parallel usp needs its degrees: --ulysses U and/or --ring R with U x R = ranks per "
                               "sequence group (e.g. --ulysses 2 --ring 2 on 4 ranks)")
        else:
            check(not given, f"{given[0] if given else ''} applies to --parallel usp only; valid: --parallel usp "
                             f"--ulysses U --ring R, or drop it (ring is U = 1; auto chooses)")

    @property
    def requested_slices(self) -> int | str:
        if self.slices is None and self.schedule == "auto":
            return "auto"
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
    heads: int = 0  # the fewest heads of a site that spans ranks (head schedules)
    dense: bool = True  # every such site is plain softmax attention (key chunks merge by log-sum-exp)

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
        plan = replace(plan, heads=heads, dense=all(access_for(m).dense for m in modules))
        if schedule.ring:
            check_ring(plan, schedule, ranks)
        elif ranks is not None and ranks > heads:
            raise UserError(f"ulysses splits attention heads over ranks: {ranks} ranks > {heads} heads of "
                            f"{plan.model}; valid: at most {heads} ranks per sequence group, or --parallel ring / "
                            f"usp (not limited by heads)")
    return plan


def check_ring(plan: Plan, schedule: Schedule, ranks: int | None) -> None:
    """The ring schedules split the keys of full-3D softmax attention."""
    if not plan.full:
        raise UserError(f"--parallel {schedule.name} splits full-3D attention; {plan.model} has spatial/temporal "
                        f"blocks; valid: dsp, ulysses, scalefusion, scalefusion-inter")
    if plan.dense:
        return
    if schedule.name != "auto":
        raise UserError(f"--parallel {schedule.name} splits the keys of softmax attention; {plan.model}'s attention "
                        f"limits each query to a window, a mask that ring cannot split; valid: ulysses")
    if ranks is not None and ranks > plan.heads:  # auto could only choose plain Ulysses, which the heads rule out
        raise UserError(f"--parallel auto: {plan.model}'s attention limits each query to a window (ring cannot split "
                        f"it) and {ranks} ranks > {plan.heads} heads (Ulysses cannot); valid: at most {plan.heads} ranks")


def ring_degrees(config: ParallelConfig, ranks: int, heads: int) -> tuple[int, int]:
    """(U, R) of a ring schedule on `ranks` ranks per sequence group: ring is (1, ranks); usp takes
    --ulysses / --ring, one of them may follow from the ranks."""
    if config.schedule != "usp":
        return 1, ranks
    u, r = config.ulysses, config.ring
    valid = ", ".join(f"--ulysses {a} --ring {ranks // a}" for a in range(1, ranks + 1) if ranks % a == 0 and a <= heads)
    if u is None or r is None:
        given = u or r
        check(ranks % given == 0, f"--{'ulysses' if u else 'ring'} {given} does not divide the {ranks} ranks per "
                                  f"sequence group; valid: {valid}")
        u, r = (u, ranks // u) if u else (ranks // r, r)
    check(u * r == ranks, f"--ulysses {u} x --ring {r} = {u * r} must equal the ranks per sequence group ({ranks}); "
                          f"valid: {valid}")
    check(u <= heads, f"--ulysses {u} splits attention heads: {u} > {heads} heads; valid: {valid}")
    return u, r


def check_slices(plan: Plan, schedule: Schedule, slices: int | str) -> None:
    """Sliced Ulysses needs full-3D attention (a spatial-temporal model slices by frames instead) whose
    key chunks merge by log-sum-exp (dense softmax: a window operator is not)."""
    if schedule.heads and isinstance(slices, int) and slices > 1 and not plan.full:
        raise UserError(f"ulysses --slices {slices} slices full-3D attention; {plan.model} has spatial/temporal "
                        f"blocks; valid: ulysses --slices 1, or scalefusion / scalefusion-inter")
    if schedule.heads and isinstance(slices, int) and slices > 1 and not plan.dense:
        raise UserError(f"{schedule.name} --slices {slices} cuts softmax attention into key chunks; {plan.model}'s "
                        f"attention limits each query to a window; valid: --slices 1")


def check_fit(model, config: ParallelConfig, world: int | None) -> Plan:
    """Everything about `config` for `model` on `world` ranks (None: any) known before a process group exists."""
    ranks = world
    if world is not None and config.cfg_parallel:
        check(world % 2 == 0, f"cfg_parallel needs an even number of ranks; got {world}")
        ranks = world // 2
    schedule = SCHEDULES[config.schedule]
    plan = plan_for(model, schedule, ranks)
    check_slices(plan, schedule, config.requested_slices)
    if schedule.ring and ranks is not None:
        ring_degrees(config, ranks, plan.heads)
    return plan


def parse_slices(text: str | None) -> int | str | None:
    """--slices N|auto (None: the schedule's default)."""
    if text is None or text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise UserError(f"--slices={text!r} must be an integer >= 1 or 'auto'") from None
