"""A rank that dies or hangs ends the others with an error within the timeout, never a hang."""

import time

import pytest
from parallel_helpers import die_mid_run

from slidefusion.parallel import ParallelError, spawn


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_dead_rank_makes_the_others_fail_in_time(mode):
    start = time.monotonic()
    with pytest.raises(ParallelError) as info:
        spawn(die_mid_run, 2, mode, timeout_s=4, job_timeout_s=40)
    elapsed = time.monotonic() - start
    message = str(info.value)
    # rank 0 reported its own failure (it was not killed by the launcher): it ended by itself
    assert "rank 0 failed: RuntimeError: after" in message, message
    waited = float(message.split("after ")[1].split(" s")[0])
    assert waited < 12, message  # the 4 s timeout bounds the wait (a closed socket ends it sooner)
    assert f"rank 1 died with exit code {3 if mode == 'exit' else 4}" in message, message
    assert elapsed < 40
