"""diffusers' context parallelism as the anchor of the parallel benchmark (benchmarks and tests only).

`enable_diffusers_cp(model, ulysses, ring)` runs diffusers' own `enable_parallelism(config=
ContextParallelConfig(...))` on a diffusers model inside an initialised process group.
`DelayedCollectives` holds each of diffusers' collectives until an emulated link would have
delivered it, by the rule slidefusion's `LinkDelay` applies to its own transfers (per rank, one
outgoing queue: done no earlier than max(issue, previous done) + latency + bytes / bandwidth), so
both sides of a benchmark pay for the same link.

Two facts of diffusers 0.42.1 on a CPU-only machine, worked around here only:
- `ModelMixin._resolve_parallel_config` picks the device as `rank % torch.accelerator.device_count()`,
  which divides by zero without an accelerator; `enable_diffusers_cp` makes that count 1 for the
  duration of the call (the device it computes is then cpu:0, as it should be on CPU).
- its ring attention asks the attention backend for the log-sum-exp, which only CUDA backends
  return: on CPU diffusers runs Ulysses only (`diffusers_can_run` says which).
"""

import contextlib
import time
from unittest import mock

import torch
import torch.distributed as dist

from slidefusion.parallel.comm import LinkDelay

CPU_WORKAROUND = ("diffusers 0.42.1 divides the rank by torch.accelerator.device_count(), 0 on a CPU-only machine: "
                  "the benchmark makes that count 1 while enable_parallelism runs (benchmark only)")


def diffusers_can_run(ulysses: int, ring: int, heads: int, tokens: int, device: str = "cpu") -> str | None:
    """None if diffusers' context parallelism runs this case, else why not (one line)."""
    if ring > 1 and device == "cpu":
        return "diffusers' ring attention needs a backend that returns the log-sum-exp (CUDA only)"
    if heads % ulysses:
        return f"diffusers' Ulysses needs heads divisible by the degree ({heads} heads, {ulysses} ranks)"
    if tokens % (ulysses * ring):
        return f"diffusers shards tokens evenly ({tokens} tokens, {ulysses * ring} ranks)"
    return None


@contextlib.contextmanager
def _device_count_at_least_one():
    if torch.accelerator.device_count() > 0:
        yield
        return
    with mock.patch.object(torch.accelerator, "device_count", lambda: 1):
        yield


def enable_diffusers_cp(model, ulysses: int, ring: int = 1):
    """diffusers' own context parallelism on `model` (a diffusers ModelMixin with a `_cp_plan`)."""
    from diffusers import ContextParallelConfig

    with _device_count_at_least_one():
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=ulysses, ring_degree=ring))
    return model


class DelayedCollectives:
    """Stands in for `torch.distributed._functional_collectives` inside diffusers' modules: each
    collective runs, is waited for, then held until the emulated link delivers it. `seconds` sums
    the time spent inside collectives (diffusers waits on each at once: all of it is exposed)."""

    def __init__(self, real, link: LinkDelay | None):
        self.real, self.link = real, link
        self.free = 0.0
        self.seconds = 0.0

    def __getattr__(self, name):
        return getattr(self.real, name)

    def _finish(self, out, issued: float, nbytes: float):
        out = out.wait() if hasattr(out, "wait") else out
        if self.link is not None:
            self.free = max(issued, self.free) + self.link.seconds(int(nbytes))
            delay = self.free - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        self.seconds += time.perf_counter() - issued
        return out

    def all_to_all_single(self, x, output_split_sizes, input_split_sizes, group, tag=""):
        issued = time.perf_counter()
        out = self.real.all_to_all_single(x, output_split_sizes, input_split_sizes, group)
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = input_split_sizes or [x.shape[0] // size] * size
        remote = (sum(rows) - rows[rank]) * (x.numel() // max(1, x.shape[0])) * x.element_size()
        return self._finish(out, issued, remote)

    def all_gather_tensor(self, x, gather_dim, group, tag=""):
        issued = time.perf_counter()
        out = self.real.all_gather_tensor(x, gather_dim, group)
        return self._finish(out, issued, x.numel() * x.element_size() * (dist.get_world_size(group) - 1))


@contextlib.contextmanager
def delayed_diffusers_collectives(link: LinkDelay | None):
    """Route diffusers' context-parallel collectives through one `DelayedCollectives` (yielded)."""
    from diffusers.hooks import context_parallel
    from diffusers.models import attention_dispatch

    delayed = DelayedCollectives(attention_dispatch.funcol, link)
    with mock.patch.object(attention_dispatch, "funcol", delayed), mock.patch.object(context_parallel, "funcol", delayed):
        yield delayed
