"""What each arithmetic term of the lean AdamW kernels costs, in cache and streaming from DRAM.

Builds variants of slidefusion/offload/lean_kernels.c with one term replaced by a trivial stand-in
(their results are wrong: timing only, never loaded by the library), and times every variant and the
bandwidth floor of benchmarks/offload.py alternating, in thread CPU time, medians:
  nodiv    the IEEE division and square root of the update  -> a multiply and an add
  nohash   the stochastic-rounding hash (lowbias32)           -> one multiply
  nodec    the 8-bit decode                                   -> a conversion and a multiply
  noenc    the 8-bit encode                                   -> a multiply and a conversion
  all      all four at once: what the loads, stores, conversions and AdamW itself leave

    OMP_NUM_THREADS=1 nice -n 19 python benchmarks/offload_terms.py [--params 16e6] [--modes bf16/int8 ...]
"""

import argparse
import ctypes
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slidefusion.core import native
from slidefusion.offload.optim import lean
from slidefusion.offload.optim import kernels
from slidefusion.offload.optim.formats import QBLOCK
from slidefusion.optim import OptimConfig

import offload as bench  # noqa: E402 - benchmarks/ is the script's folder, first on sys.path

SOURCE = Path(kernels.__file__).with_name("lean_kernels.c")
EDITS = {  # term -> (text in lean_kernels.c, its stand-in)
    "nodiv": ("(c.neg * m) / (sqrtf(v) * c.ibs + c.eps)", "(c.neg * m) * (v * c.ibs + c.eps)"),
    "nohash": ("INLINE uint32_t mix32(uint32_t x) {", "INLINE uint32_t mix32(uint32_t x) { return x * 0x9E3779B1u;"),
    "nodec": ("INLINE float decode8(uint32_t code, int B) {", "INLINE float decode8(uint32_t code, int B) { return (float)code * 0.01f;"),
    "noenc": ("INLINE uint32_t encode8(float x, int B, int keep_positive) {",
              "INLINE uint32_t encode8(float x, int B, int keep_positive) { return (uint32_t)(x * 127.0f);"),
}
VARIANTS = {"kernel": [], "nodiv": ["nodiv"], "nohash": ["nohash"], "nodec": ["nodec"], "noenc": ["noenc"],
            "all": ["nodiv", "nohash", "nodec", "noenc"]}


def build(name: str, terms: list[str], folder: Path) -> ctypes.CDLL:
    text = SOURCE.read_text()
    for term in terms:
        old, new = EDITS[term]
        assert old in text, f"{term}: the kernel no longer contains {old!r}"
        text = text.replace(old, new)
    source, target = folder / f"{name}.c", folder / f"{name}.so"
    source.write_text(text)
    adam = SOURCE.with_name("adamw_kernels.c")
    subprocess.run(["gcc", *native.NATIVE, *kernels.FLAGS, "-fPIC", "-shared", str(adam), str(source), "-o", str(target)],
                   check=True)
    return kernels._signatures(ctypes.CDLL(str(target)))


def timed(lib, b, calls: int, cfg):
    args = lean._args(b, 1, 1e-4, cfg, 1.0, lean.seeds(0, 1, 0))
    blocks = b.starts.numel() - 1 if b.starts is not None else -(-b.numel // QBLOCK)
    return lambda: [lib.lean_update(ctypes.addressof(args), 0, blocks) for _ in range(calls)] and (args, b)


def measure(libs: dict, master: str, moments: str, n: int, repeats: int) -> dict:
    cfg, fns = OptimConfig(lr=1e-4, weight_decay=0.01), {}
    for name, lib in libs.items():
        fns[(name, "cache")] = timed(lib, bench._lean_buffers(32 * QBLOCK, master, moments), 100, cfg), 32 * QBLOCK * 100
        fns[(name, "dram")] = timed(lib, bench._lean_buffers(n, master, moments), 1, cfg), n
    fns[("floor", "dram")] = bench._floor(libs["kernel"], bench._lean_buffers(n, master, moments), 1), n
    for fn, _ in fns.values():
        fn()
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, (fn, count) in fns.items():
            start = time.thread_time()
            fn()
            times[key].append((time.thread_time() - start) / count * 1e9)
    return {key: statistics.median(t) for key, t in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=16e6)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--modes", nargs="*", default=[f"{m}/{v}" for m, v in bench.MODES[1:]])
    args = p.parse_args(argv)
    n = int(args.params) // QBLOCK * QBLOCK
    with tempfile.TemporaryDirectory() as folder:
        libs = {name: build(name, terms, Path(folder)) for name, terms in VARIANTS.items()}
        print(f"ns per parameter (thread CPU time, medians of {args.repeats}); share = floor / DRAM time")
        for mode in args.modes:
            t = measure(libs, *mode.split("/"), n, args.repeats)  # one mode's buffers at a time
            floor = t[("floor", "dram")]
            cells = [f"{name} {t[(name, 'cache')]:.3f} / {t[(name, 'dram')]:.3f} ({floor / t[(name, 'dram')]:.0%})" for name in libs]
            print(f"{mode:11s} floor {floor:.3f} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
