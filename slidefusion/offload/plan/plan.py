"""`Plan`: what an offloaded training step needs, where, and why it does not fit; sizes as text.

A plan is data: byte counts per place and per kind, PCIe traffic, a predicted step time with the
assumptions it rests on, and the reasons it does not fit. `footprint` fills in the engine's
weights and state, `sizing` the activations of a workload and where they go, `planner` the time.
"""

from dataclasses import dataclass, field

import torch

from slidefusion import validate


def parse_bytes(text: str | float, name: str) -> int:
    """'141GB', '1.5TB', '64GiB', '55GB/s', or (from Python) a number of bytes -> bytes >= 1 (a UserError
    naming `name` otherwise: zero, negative, NaN and infinite sizes are refused, not read as "no limit";
    text without a unit is refused, as everywhere a user types a size)."""
    number = isinstance(text, (int, float)) and not isinstance(text, bool)
    if number:
        text = repr(text)
    per_second = str(text).strip().upper().endswith("/S")
    return validate.byte_size(text, name, per_second=per_second, bare_bytes=number)


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.3g} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n} TB"


@dataclass
class Plan:
    """Bytes by place and kind, traffic, time, and why it does not fit (empty when it fits)."""

    host: dict[str, int] = field(default_factory=dict)
    device: dict[str, int] = field(default_factory=dict)
    disk: dict[str, int] = field(default_factory=dict)  # spilled checkpoints
    host_capacity: int | None = None
    device_capacity: int | None = None
    disk_capacity: int | None = None
    pcie_bytes: int = 0
    disk_traffic: int = 0  # bytes written and read per step
    tile: int | None = None  # frames per tile inside a block (None: whole blocks)
    tile_device_bytes: int = 0  # device bytes that scale with one tile
    step_s: float | None = None
    flops: float = 0.0
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())

    @property
    def device_bytes(self) -> int:
        return sum(self.device.values())

    @property
    def fits(self) -> bool:
        return not self.problems

    def check_capacity(self) -> None:
        """Fill `problems` from the totals and capacities."""
        for place, used, capacity, parts in (("device", self.device_bytes, self.device_capacity, self.device),
                                             ("host", self.host_bytes, self.host_capacity, self.host),
                                             ("disk", sum(self.disk.values()), self.disk_capacity, self.disk)):
            if capacity is not None and used > capacity:
                largest = sorted(parts, key=parts.get, reverse=True)[:2]
                self.problems.append(f"{place} needs {human(used)} but has {human(capacity)} (largest parts: "
                                     + ", ".join(f"{name} {human(parts[name])}" for name in largest) + ")")

    def verdict(self) -> str:
        return "fits" if self.fits else "does not fit: " + "; ".join(self.problems)


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo (bytes), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def device_capacity(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


