"""`benchmarks/parallel.py --anchor diffusers`: slidefusion's full-3D schedules against diffusers'
context parallelism on the same random WanTransformer3DModel, inputs and emulated link.

One spawned job per (ranks, tokens); inside it, per link: every case is built (ours: `parallelize`
on a copy of the model, `--parallel auto` and `--slices auto` calibrating themselves on that link;
diffusers: `enable_parallelism` on a copy, once), warmed up, then timed in alternation so load
drift hits all alike. Per case: median step wall time of the slowest rank, the communication it
waited on, and the largest difference from the single-process output (every case must be exact).
"""

import copy
import os
import statistics
import time

import torch

from slidefusion.families import TextConditioning, adapter_for
from slidefusion.parallel import LinkDelay, ParallelConfig, Tracer, parallelize, spawn
from slidefusion.testing.cp_anchor import CPU_WORKAROUND, delayed_diffusers_collectives, diffusers_can_run, enable_diffusers_cp
from slidefusion.testing.tiny import tiny_model

# The Wan row: 12 heads x 16, FFN 768, 4 blocks, Wan's 16 latent channels; 1x2x2 patches.
WAN = dict(num_attention_heads=12, attention_head_dim=16, ffn_dim=768, num_layers=4, in_channels=16, out_channels=16,
           text_dim=64, freq_dim=64, rope_max_seq_len=128)
# tokens -> latent (T, H, W): T x H/2 x W/2 tokens
TOKENS = {2048: (8, 32, 32), 8192: (8, 64, 64), 32768: (8, 128, 128)}
QUICK_TOKENS = {256: (4, 16, 16)}
LINKS = {"none": None, "2 Gb/s": (200.0, 2.0), "0.5 Gb/s": (200.0, 0.5)}  # (latency us, Gb/s)
QUICK_LINKS = {"none": None, "0.5 Gb/s": (200.0, 0.5)}
LINK_NAMES = {"none": "none", "2": "2 Gb/s", "0.5": "0.5 Gb/s"}


def _pick(text: str | None, table: dict, names: dict, what: str) -> dict:
    """The entries of `table` a comma-separated option names (all when None)."""
    if text is None:
        return table
    keys = [names.get(t.strip(), t.strip()) for t in text.split(",")]
    unknown = [k for k in keys if k not in table]
    if unknown:
        raise SystemExit(f"--{what} {unknown[0]!r} is not in the grid; valid: {', '.join(map(str, names))}")
    return {k: table[k] for k in keys}


def our_cases(ranks: int) -> list[tuple[str, ParallelConfig]]:
    """(label, config) of every slidefusion case on `ranks` ranks."""
    cases = [("ulysses", ParallelConfig("ulysses", 1)), ("ulysses --slices 2", ParallelConfig("ulysses", 2)),
             ("ulysses --slices 4", ParallelConfig("ulysses", 4)), ("ring", ParallelConfig("ring", 1)),
             ("ring --slices 2", ParallelConfig("ring", 2))]
    if ranks == 4:
        cases += [("usp 2x2", ParallelConfig("usp", 1, ulysses=2, ring=2)),
                  ("usp 2x2 --slices 2", ParallelConfig("usp", 2, ulysses=2, ring=2))]
    return cases + [("ulysses --slices auto", ParallelConfig("ulysses", "auto")), ("auto", ParallelConfig("auto"))]


def diffusers_cases(ranks: int, tokens: int) -> tuple[list, dict]:
    """(label, (U, R)) diffusers can run here, and why the others cannot."""
    wanted = [("diffusers ulysses", (ranks, 1)), ("diffusers ring", (1, ranks))]
    if ranks == 4:
        wanted.append(("diffusers usp 2x2", (2, 2)))
    runs, skipped = [], {}
    for label, (u, r) in wanted:
        why = diffusers_can_run(u, r, WAN["num_attention_heads"], tokens)
        (runs.append((label, (u, r))) if why is None else skipped.__setitem__(label, why))
    return runs, skipped


def _inputs(model, latent, batch: int):
    adapter = adapter_for(model)
    g = torch.Generator().manual_seed(0)
    shape = (batch, adapter.latent_channels(model), *latent)  # 2: a CFG batch, as a sampler calls the model
    x, t = torch.randn(shape, generator=g), torch.tensor([700.0, 300.0][:batch])
    return shape, (x, t, TextConditioning(torch.randn(batch, 12, adapter.text_width(model), generator=g)))


def _build(model, ranks, tokens, shape, link):
    """Every case on this link: label -> (model to call, how to read its exposed seconds)."""
    cases, tunings = {}, {}
    for label, config in our_cases(ranks):
        config = ParallelConfig(config.schedule, config.slices, link_delay=link, timeout_s=600,
                                ulysses=config.ulysses, ring=config.ring)
        tracer = Tracer(rank=torch.distributed.get_rank(), enabled=True)  # its steps hold the exposed time
        handle = parallelize(copy.deepcopy(model), config, tracer=tracer, latent_shape=shape)
        cases[label] = (handle.model, handle.engine)
        if handle.engine.tuning is not None:
            tunings[label] = handle.engine.tuning
    return cases, tunings


def _exposed(engine_or_delayed, before: float) -> float:
    if hasattr(engine_or_delayed, "seconds"):  # diffusers: every collective waited at once
        return engine_or_delayed.seconds - before
    steps = engine_or_delayed.tracer.steps
    return steps[-1]["exposed_comm_s"] if steps else 0.0


def anchor_job(rank, world, options):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_model("wan", **WAN)
    adapter = adapter_for(model)
    shape, inputs = _inputs(model, options["latent"], options["batch"])
    tokens = adapter.tokens(model, shape)
    with torch.no_grad():
        reference = adapter.predict(model, *inputs)
    dcases, skipped = diffusers_cases(world, tokens)
    dmodels = {label: enable_diffusers_cp(copy.deepcopy(model), u, r) for label, (u, r) in dcases}
    out = {"tokens": tokens, "diffusers_skipped": skipped, "links": {}}
    for name, spec in options["links"].items():
        link = None if spec is None else LinkDelay(*spec)
        with delayed_diffusers_collectives(link) as delayed, torch.no_grad():
            cases, tunings = _build(model, world, tokens, shape, link)
            for label, dmodel in dmodels.items():
                cases[label] = (dmodel, delayed)
            out["links"][name] = {"rows": _time_cases(cases, adapter, inputs, reference, options), "auto": tunings}
    return out


def _time_cases(cases: dict, adapter, inputs, reference, options) -> dict:
    """Warm-up, then `repeats` rounds alternating every case; per case medians and the error."""
    times = {label: [] for label in cases}
    exposed = {label: [] for label in cases}
    errors = {}
    for round_ in range(options["warmup"] + options["repeats"]):
        for label, (model, counter) in cases.items():
            before = getattr(counter, "seconds", 0.0)
            start = time.perf_counter()
            y = adapter.predict(model, *inputs)
            elapsed = time.perf_counter() - start
            errors[label] = max(errors.get(label, 0.0), (y - reference).abs().max().item())
            if round_ >= options["warmup"]:
                times[label].append(elapsed)
                exposed[label].append(_exposed(counter, before))
    return {label: {"wall_s": statistics.median(times[label]), "exposed_comm_s": statistics.median(exposed[label]),
                    "max_abs_error": errors[label]} for label in cases}


def _slowest(results: list[dict], link: str) -> dict:
    """Per case, the slowest rank's median (a step ends when its last rank ends)."""
    labels = results[0]["links"][link]["rows"]
    return {label: {key: max(r["links"][link]["rows"][label][key] for r in results)
                    for key in ("wall_s", "exposed_comm_s", "max_abs_error")} for label in labels}


def summarise(rows: dict) -> dict:
    """Ratios to diffusers' Ulysses, the best fixed choice, and whether auto met its targets."""
    anchor = rows.get("diffusers ulysses", {}).get("wall_s")
    fixed = {k: v["wall_s"] for k, v in rows.items() if not k.startswith("diffusers") and "auto" not in k}
    best = min(fixed, key=fixed.get)
    summary = {"best_fixed": best, "best_fixed_s": fixed[best]}
    for label in ("auto", "ulysses --slices auto"):
        if label in rows:
            t = rows[label]["wall_s"]
            summary[label] = {"vs_best_fixed": t / fixed[best], "within_3_percent": t <= 1.03 * fixed[best],
                              "vs_plain_ulysses": t / fixed["ulysses"]}
    if anchor:
        summary["vs_diffusers"] = {k: v["wall_s"] / anchor for k, v in rows.items()}
        summary["diffusers_comm_share"] = rows["diffusers ulysses"]["exposed_comm_s"] / anchor
    return summary


def _print(ranks: int, tokens: int, link: str, rows: dict, summary: dict) -> None:
    print(f"\n{ranks} ranks, {tokens} tokens, link {link}: best fixed {summary['best_fixed']}")
    print(f"{'case':<26} {'step ms':>9} {'exposed ms':>10} {'vs diffusers':>12} {'max err':>9}")
    for label, r in rows.items():
        ratio = summary.get("vs_diffusers", {}).get(label)
        print(f"{label:<26} {1e3 * r['wall_s']:>9.1f} {1e3 * r['exposed_comm_s']:>10.1f} "
              f"{'' if ratio is None else f'{ratio:.3f}':>12} {r['max_abs_error']:>9.1e}")


def run_anchor_grid(args) -> dict:
    tokens = QUICK_TOKENS if args.quick else _pick(args.tokens, TOKENS, {str(n): n for n in TOKENS}, "tokens")
    links = QUICK_LINKS if args.quick else _pick(args.links, LINKS, LINK_NAMES, "links")
    ranks = (2,) if args.quick else tuple(int(r) for r in (args.grid_ranks or "2,4").split(","))
    options = {"warmup": 1, "repeats": args.repeats or (2 if args.quick else 7), "links": links, "batch": args.batch}
    grid = []
    for p in ranks:
        for n, latent in tokens.items():
            start = time.perf_counter()
            results = spawn(anchor_job, p, {**options, "latent": latent}, timeout_s=3600)
            for link in links:
                rows = _slowest(results, link)
                summary = summarise(rows)
                _print(p, n, link, rows, summary)
                grid.append({"ranks": p, "tokens": n, "latent": latent, "link": link, "link_spec": links[link],
                             "rows": rows, "summary": summary, "auto": results[0]["links"][link]["auto"],
                             "diffusers_skipped": results[0]["diffusers_skipped"]})
            print(f"({p} ranks, {n} tokens: {time.perf_counter() - start:.0f} s)")
    return {"model": {"class": "WanTransformer3DModel", **WAN}, "batch": args.batch, "grid": grid,
            "workarounds": [CPU_WORKAROUND], "notes": [
                "diffusers' collectives are delayed by slidefusion's LinkDelay rule (latency + bytes / bandwidth, one "
                "outgoing queue per rank), applied when each collective completes; diffusers waits on each at once",
                "on CPU diffusers' ring needs a log-sum-exp attention backend it only has on CUDA: its Ulysses is the anchor",
                f"{os.cpu_count()} cores: with more ranks than cores the ranks time-share them, so those rows measure "
                "scheduling as much as the schedules"]}
