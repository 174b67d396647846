"""Random sleeps in an offload engine's copy threads and optimizer worker, to expose races.

Tests and benchmarks only: a correct engine gives the same result whatever the timing, so a test
runs it with delays and compares with a run without them.
"""

import random
import time


def inject_delays(engine, max_seconds: float, seed: int = 0) -> None:
    """Sleep up to `max_seconds` (uniform, seeded) before every copy and every optimizer job of
    `engine` (an `OffloadEngine`)."""
    for offset, target in enumerate((engine.h2d, engine.d2h)):
        rng = random.Random(seed + offset)
        target.set_jitter(lambda rng=rng: time.sleep(rng.uniform(0, max_seconds)))
    rng = random.Random(seed + 7)
    engine.worker.jitter = lambda: time.sleep(rng.uniform(0, max_seconds))
