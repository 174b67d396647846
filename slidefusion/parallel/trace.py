"""Per-rank timeline of compute and communication spans, as a Chrome trace (chrome://tracing, Perfetto).

Exposed communication is the time the compute thread spends blocked in a wait: a transfer that
finished under compute costs nothing, one still in flight when its data is needed costs the rest.
"""

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Tracer:
    """Collects spans (name, category, start s, end s) and per-step exposed communication."""

    rank: int = 0
    enabled: bool = True
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    origin: float = field(default_factory=time.perf_counter)

    def add(self, name: str, category: str, start: float, end: float) -> None:
        if self.enabled:
            self.spans.append((name, category, start - self.origin, end - self.origin))

    @contextmanager
    def span(self, name: str, category: str = "compute"):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, category, start, time.perf_counter())

    @contextmanager
    def step(self):
        """One model evaluation: records its wall time and the exposed (waited) communication."""
        first = len(self.spans)
        start = time.perf_counter()
        yield
        end = time.perf_counter()
        waited = sum(e - s for _, cat, s, e in self.spans[first:] if cat == "wait")
        self.steps.append({"wall_s": end - start, "exposed_comm_s": waited})
        self.add(f"step {len(self.steps) - 1}", "step", start, end)


def chrome_trace(per_rank: list[Tracer]) -> dict:
    """Chrome trace events: one process per rank; compute, waits and transfers on separate rows."""
    rows = {"compute": 0, "wait": 1, "comm": 2, "step": 3}
    events = []
    for tracer in per_rank:
        for name, cat, start, end in tracer.spans:
            events.append({"name": name, "cat": cat, "ph": "X", "pid": tracer.rank, "tid": rows.get(cat, 4),
                           "ts": start * 1e6, "dur": max(end - start, 0.0) * 1e6})
        for tid, label in ((0, "compute"), (1, "blocked on comm"), (2, "transfers"), (3, "steps")):
            events.append({"name": "thread_name", "ph": "M", "pid": tracer.rank, "tid": tid, "args": {"name": label}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def step_table(per_rank: list[Tracer]) -> list[dict]:
    """Per step: the slowest rank's wall time and the largest exposed communication of any rank."""
    table = []
    for i in range(min(len(t.steps) for t in per_rank)):
        table.append({"step": i, "wall_s": max(t.steps[i]["wall_s"] for t in per_rank),
                      "exposed_comm_s": max(t.steps[i]["exposed_comm_s"] for t in per_rank)})
    return table
