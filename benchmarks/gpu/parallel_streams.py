"""What one GPU can say about the ring schedules: does a block's attention overlap the arrival of the
next block, and how much does the transfer slow the attention down (the simulator's `slowdown`)?

A ring step computes `attention_lse` of this rank's queries against one key/value block while the next
block arrives. Here the arrival is a copy of a block of the same size on a second CUDA stream - from
pinned host memory (a PCIe/NIC-like transfer through a copy engine) and device to device. Per size:
attention alone, the copy alone, both at once; overlap = (attention + copy - both) / min(attention,
copy) (1: fully hidden), slowdown = both / attention - 1 when the copy is the shorter. NCCL's send /
receive runs as kernels that take SMs, which a copy engine does not: multi-GPU runs measure that part
(see parallel.sh). Writes JSON under --out.

    python benchmarks/gpu/parallel_streams.py --out $OUT/parallel_streams.json
    python benchmarks/gpu/parallel_streams.py --dry-run
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from slidefusion.parallel.chunked import attention_lse, attention_lse_reference, merge  # noqa: E402

# (queries, keys per block, heads, head dim): Wan 14B's 40 x 128 heads at 720p on 8 ranks, a ring of 2 and
# of 8, and a small case.
SIZES = [(9450, 9450, 5, 128), (4725, 4725, 40, 128), (2048, 2048, 12, 64)]


def _time(fn, stream, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record(stream)
        fn()
        end.record(stream)
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def measure(mq: int, mk: int, heads: int, d: int, dtype, source: str, repeats: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, m, heads, d, device="cuda", dtype=dtype, generator=g) for m in (mq, mk, mk))
    block = torch.stack((k, v), dim=2)
    incoming = block.cpu().pin_memory() if source == "host" else block.clone()
    landing = torch.empty_like(block)
    compute, side = torch.cuda.current_stream(), torch.cuda.Stream()

    def attend():
        attention_lse(q, k, v)

    def arrive():
        side.wait_stream(compute)  # starts when the timing starts
        with torch.cuda.stream(side):
            landing.copy_(incoming, non_blocking=True)

    def copy():
        arrive()
        compute.wait_stream(side)  # the end event (on the compute stream) waits for the copy

    def both():
        arrive()
        attend()
        compute.wait_stream(side)

    for fn in (attend, copy, both):  # warm-up
        fn()
    t_attn, t_copy, t_both = (_time(fn, compute, repeats) for fn in (attend, copy, both))
    overlap = (t_attn + t_copy - t_both) / min(t_attn, t_copy)
    return {"queries": mq, "keys": mk, "heads": heads, "head_dim": d, "dtype": str(dtype), "source": source,
            "block_bytes": block.numel() * block.element_size(), "attention_s": t_attn, "copy_s": t_copy,
            "both_s": t_both, "overlap": overlap, "slowdown": max(0.0, t_both / t_attn - 1) if t_copy < t_attn else None}


def check_merge(dtype, tol: float) -> float:
    """A ring of 4 blocks merged by log-sum-exp on CUDA equals the whole attention (the float64 reference)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(2, m, 3, 64, device="cuda", dtype=dtype, generator=g) for m in (37, 203, 203))
    parts = None
    for kb, vb in zip(k.tensor_split(4, dim=1), v.tensor_split(4, dim=1)):
        parts = merge(parts, attention_lse(q, kb, vb))
    ref = attention_lse_reference(*(t.double() for t in (q, k, v)))[0]
    err = (parts[0].double() - ref).abs().max().item()
    assert err < tol, f"ring merge on CUDA in {dtype} differs by {err}"
    return err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="runs/gpu/parallel_streams.json")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    args = parser.parse_args()
    plan = [(s, dtype, source) for s in SIZES for dtype in (torch.bfloat16,) for source in ("host", "device")]
    if args.dry_run:
        for (mq, mk, heads, d), dtype, source in plan:
            print(f"would time attention {mq}x{mk} tokens, {heads}x{d} heads, {dtype}, next block from {source}")
        print(f"would check the ring merge on CUDA (fp32, bf16) and write {args.out}")
        return
    if not torch.cuda.is_available():
        raise SystemExit("parallel_streams.py needs CUDA (use --dry-run to see the plan)")
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "merge_error": {"fp32": check_merge(torch.float32, 1e-4), "bf16": check_merge(torch.bfloat16, 3e-2)},
              "rows": [measure(*size, dtype, source, args.repeats) for size, dtype, source in plan]}
    for r in report["rows"]:
        print(f"{r['queries']}x{r['keys']} {r['heads']}x{r['head_dim']} {r['source']:>6}: attention "
              f"{1e3 * r['attention_s']:.2f} ms, copy {1e3 * r['copy_s']:.2f} ms, both {1e3 * r['both_s']:.2f} ms, "
              f"overlap {r['overlap']:.2f}, slowdown {r['slowdown']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
