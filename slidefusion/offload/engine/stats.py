"""`EngineStats`: what an `OffloadEngine` moved, waited for and holds (totals since construction)."""

from dataclasses import asdict, dataclass


@dataclass
class EngineStats:
    steps: int = 0
    step_s: float = 0.0  # wall seconds inside train_step
    optimizer_s: float = 0.0  # seconds the optimizer worker ran jobs
    exposed_optimizer_s: float = 0.0  # of those, seconds compute waited for them
    exposed_transfer_s: float = 0.0  # seconds compute waited for weight uploads
    h2d_bytes: int = 0  # weights uploaded (streamed blocks and refreshes of resident groups)
    d2h_bytes: int = 0  # gradients downloaded
    peak_device_param_bytes: int = 0  # most weight bytes on the device at once
    device_param_bytes_reserved: int = 0  # device weight buffers allocated (slots + resident groups)
    host_state_bytes: int = 0  # persistent host state: compute copies, masters, moments
    host_bytes_per_param: float = 0.0  # host state of the trainable parameters, per trainable parameter
    frozen_bytes_per_param: float = 0.0  # the same for frozen parameters (their compute copy alone)
    staging_bytes: int = 0  # host gradient staging
    pinned_bytes: int = 0  # page-locked host bytes
    pageable_copy_bytes: int = 0  # copy buffers that could not be page-locked
    host_bytes_rank: int = 0  # host state this process holds (data parallel: its shards, not a shared copy)
    host_bytes_node: int = 0  # host state of the node's ranks together (one shared compute copy counted once)
    comm_bytes: int = 0  # bytes this rank sent in data-parallel collectives
    exposed_comm_s: float = 0.0  # seconds the compute waited for them (gradient buffers still in flight)

    def as_dict(self) -> dict:
        return asdict(self)
