"""The planner for a run on several GPUs: per-GPU memory, per-node host bytes, and a step time
with the data-parallel collectives' terms (`slidefusion plan ... --gpus N --nodes M`).

Per GPU it is the one-GPU plan (`planner.plan_policy`) of the GPU's own work: its rows of the
batch, and with sequence parallelism (`sp`) 1/sp of each sample's tokens. Per node:
  host    the compute copy once (shared by the node's ranks through /dev/shm; once per rank with
          `shared=False`), each rank's shard of the master weights and moments (together one set
          per node on one node; 1/M of it on each of M nodes), gradient staging and host-placed
          activation checkpoints per rank
  time    max(compute, PCIe, the rank's AdamW on its shard, reduce-scatter, all-gather): the
          reduce-scatter of each block's gradient runs under the backward of the blocks before it,
          the all-gather of its updated shards under the next forward, so one block's worth of each
          is exposed; `exposed` adds those tails to the step
The reduce-scatter moves (W - 1) / W of the gradients per rank; the all-gather, with shared host
copies, only the shards of the other nodes: (M - 1) x P / W values per rank (none on one node).
Both at `interconnect` (bytes/s per GPU, the slowest link the collective crosses).
"""

import dataclasses
import math
from dataclasses import dataclass

from slidefusion.core.errors import check
from slidefusion.offload.optim.formats import trainable_bytes_per_param, update_bytes_per_param
from slidefusion.offload.plan.plan import Plan, human
from slidefusion.offload.plan.planner import Machine, plan_policy
from slidefusion.offload.policy import OffloadPolicy

NVLINK_BYTES_S = 450e9  # one H100/H200 GPU's NVLink bandwidth per direction (a stated assumption)
NODE_LINK_BYTES_S = 50e9  # 400 Gbit/s per GPU between nodes (InfiniBand NDR)


@dataclass(frozen=True)
class Cluster:
    """GPUs per node, nodes, ranks per sample (`sp`), collective bandwidth per GPU (bytes/s), and
    whether a node's ranks share one host compute copy."""

    gpus: int
    nodes: int = 1
    sp: int = 1
    interconnect: float | None = None  # None: NVLink on one node, NODE_LINK_BYTES_S across nodes
    shared: bool = True

    def __post_init__(self):
        check(self.gpus >= 1 and self.nodes >= 1, f"--gpus {self.gpus} and --nodes {self.nodes} must be >= 1")
        world = self.gpus * self.nodes
        check(world % self.sp == 0, f"--sp {self.sp} does not divide the {world} GPUs (--gpus x --nodes)")

    @property
    def world(self) -> int:
        return self.gpus * self.nodes

    @property
    def dp(self) -> int:
        return self.world // self.sp

    @property
    def link(self) -> float:
        if self.interconnect is not None:
            return self.interconnect
        return NVLINK_BYTES_S if self.nodes == 1 else NODE_LINK_BYTES_S


@dataclass
class ClusterPlan:
    """The per-GPU plan, the node's host bytes by part, and the step's terms in seconds."""

    gpu: Plan
    cluster: Cluster
    node_host: dict[str, int] = dataclasses.field(default_factory=dict)
    node_host_capacity: int | None = None
    terms: dict[str, float] = dataclasses.field(default_factory=dict)
    exposed: dict[str, float] = dataclasses.field(default_factory=dict)
    global_batch: int = 0

    @property
    def node_host_bytes(self) -> int:
        return sum(self.node_host.values())

    @property
    def step_s(self) -> float:
        return max(self.terms.values()) + sum(self.exposed.values())

    @property
    def problems(self) -> list[str]:
        found = [p for p in self.gpu.problems if not p.startswith("host ")]
        if self.node_host_capacity is not None and self.node_host_bytes > self.node_host_capacity:
            found.append(f"host needs {human(self.node_host_bytes)} per node but has {human(self.node_host_capacity)}")
        return found


def plan_cluster(shape, work, cluster: Cluster, policy: OffloadPolicy, machine: Machine) -> ClusterPlan:
    """The plan of one step on `cluster` for a `ModelShape`, a workload (`work.batch`: samples per
    data-parallel rank), the engine's `OffloadPolicy` and one GPU's `Machine` (`host_memory`: per node)."""
    per_gpu = dataclasses.replace(work, tokens=math.ceil(work.tokens / cluster.sp))
    gpu = plan_policy(shape, per_gpu, policy, machine)
    out = ClusterPlan(gpu, cluster, node_host_capacity=machine.host_memory, global_batch=work.batch * cluster.dp)
    _node_host(out, shape, policy)
    _terms(out, shape, policy, machine)
    return out


def _node_host(out: ClusterPlan, shape, policy: OffloadPolicy) -> None:
    cluster, gpu, ranks, size = out.cluster, out.gpu, out.cluster.gpus, policy.compute_bytes
    per = trainable_bytes_per_param(policy.dtype, policy.master, policy.moments, policy.rounding)
    copies = 1 if cluster.shared else ranks
    out.node_host[f"compute copy x{copies} ({'shared' if cluster.shared else 'one per rank'})"] = copies * shape.params * size
    out.node_host[f"master + moments: {ranks} shards of 1/{cluster.world}"] = int(shape.params * (per - size) * ranks
                                                                                  / cluster.world)
    largest = max(shape.block_params)
    out.node_host[f"gradient staging ({ranks} ranks)"] = ranks * 2 * math.ceil(largest / cluster.world) * size
    for name, value in gpu.host.items():
        if "checkpoint" in name:
            out.node_host[f"{name} ({ranks} ranks)"] = ranks * value


def _terms(out: ClusterPlan, shape, policy: OffloadPolicy, machine: Machine) -> None:
    cluster, gpu, params, size = out.cluster, out.gpu, shape.params, policy.compute_bytes
    world, blocks, link = cluster.world, len(shape.block_params), cluster.link
    compute = gpu.flops / (machine.tflops * 1e12 * machine.mfu)
    upd = update_bytes_per_param(policy.dtype, policy.master, policy.moments, policy.rounding)
    reduce = (world - 1) / world * params * size / link
    gathered = ((cluster.nodes - 1) * params / world if cluster.shared else (world - 1) / world * params) * size
    out.terms = {"compute": compute, "PCIe": gpu.pcie_bytes / machine.pcie_bytes_s,
                 "host AdamW (shard)": params / world * upd / machine.host_bytes_s,
                 "reduce-scatter": reduce, "all-gather": gathered / link}
    out.exposed = {"reduce-scatter (last block)": reduce / blocks, "all-gather (first block)": gathered / link / blocks}


def report_cluster(plan: ClusterPlan, title: str) -> str:
    c = plan.cluster
    lines = [title, f"  cluster: {c.nodes} node(s) x {c.gpus} GPUs = {c.world} ranks = {c.dp} data parallel x {c.sp} "
                    f"sequence parallel; global batch {plan.global_batch}; collectives at {human(c.link)}/s per GPU"]
    lines.append(f"  per GPU: {human(plan.gpu.device_bytes)}" + (f" of {human(plan.gpu.device_capacity)}"
                                                                   if plan.gpu.device_capacity else ""))
    lines += [f"    {name:<60} {human(value):>10}" for name, value in plan.gpu.device.items()]
    lines.append(f"  per node host: {human(plan.node_host_bytes)}" + (f" of {human(plan.node_host_capacity)}"
                                                                        if plan.node_host_capacity else ""))
    lines += [f"    {name:<60} {human(value):>10}" for name, value in plan.node_host.items()]
    lines.append(f"  predicted step time: {plan.step_s:.3g} s = max(" + ", ".join(f"{k} {v:.3g} s" for k, v in plan.terms.items())
                 + ") + exposed (" + ", ".join(f"{k} {v:.3g} s" for k, v in plan.exposed.items()) + ")")
    lines.append(f"  throughput: {plan.global_batch / plan.step_s:.3g} samples/s")
    problems = plan.problems
    lines.append("  verdict: " + ("fits" if not problems else "does not fit: " + "; ".join(problems)))
    return "\n".join(lines)
