"""The kernel's own account of this process's resident memory (Linux /proc), for peak measurements
in tests and benchmarks: a real high-water mark, not an estimate."""


def status_kib(field: str) -> int:
    """A memory field of /proc/self/status in KiB, e.g. "VmRSS" (now) or "VmHWM" (the peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> bool:
    """Restart VmHWM from the current RSS (Linux >= 4.0: write 5 to clear_refs); False if refused."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False
