"""CLI additions: `generate --parallel ...` (under torchrun) and `slidefusion simulate`.

Registered from slidefusion/cli.py through `add_parallel_options` and `add_simulate_parser`."""

import argparse
import json
import os
import time
from pathlib import Path

from slidefusion import cli_args as types
from slidefusion import validate
from slidefusion.errors import UserError
from slidefusion.parallel.plan import SCHEDULES, ParallelConfig, parse_slices


PARALLEL_ONLY = {"slices": "--slices", "cfg_parallel": "--cfg-parallel", "trace": "--trace", "timeout": "--timeout"}


def _slices(text: str) -> int | str:
    slices = parse_slices(text)
    ParallelConfig(slices=slices)  # the range check, in one place
    return slices


def add_parallel_options(generate: argparse.ArgumentParser) -> None:
    group = generate.add_argument_group("parallel inference (run under torchrun --nproc-per-node P)")
    group.add_argument("--parallel", metavar="SCHEDULE", choices=list(SCHEDULES),
                       help=f"run across the torchrun ranks: {', '.join(SCHEDULES)}")
    group.add_argument("--slices", type=types.arg_type("slices", _slices), default=None, metavar="N|auto",
                       help="slices per switch (scalefusion, scalefusion-inter; default 4) or per Ulysses all-to-all "
                            "(ulysses on full-3D models; default 1 = plain Ulysses)")
    group.add_argument("--cfg-parallel", action="store_true",
                       help="conditional and unconditional halves on two rank groups (even rank count)")
    group.add_argument("--trace", metavar="PATH", type=types.output_file(".json"),
                       help="write a Chrome trace (compute and transfers per rank)")
    group.add_argument("--timeout", type=types.number(0, low_open=True), default=None, metavar="S",
                       help="seconds before a collective waiting on a dead or stuck rank fails (default 300)")


def reject_parallel_options(args) -> None:
    """A parallel option without --parallel would be silently ignored: say so instead."""
    given = [flag for key, flag in PARALLEL_ONLY.items() if getattr(args, key, None) not in (None, False)]
    if given:
        raise UserError(f"{given[0]} applies to parallel runs only; add --parallel SCHEDULE "
                        f"({', '.join(SCHEDULES)}) under torchrun, or drop {given[0]}")


def _prepare(args, build_pipeline):
    """Every check that needs no process group, before any is joined: the config, the output path,
    whether the schedule suits the model, the launcher, and whether the model fits this many ranks."""
    from slidefusion.data.video_io import check_video_path
    from slidefusion.parallel.launch import launcher_world, pick_backend
    from slidefusion.parallel.plan import check_fit

    timeout = 300.0 if args.timeout is None else args.timeout
    config = ParallelConfig(args.parallel, parse_slices(args.slices), args.cfg_parallel, timeout)
    check_video_path(Path(args.out))
    args.device = str(pick_backend()[1])
    pipe = build_pipeline(args)
    check_fit(pipe.model, config, None)
    check_fit(pipe.model, config, launcher_world())
    return config, pipe


def _reported_by_rank_zero(run, *args) -> None:
    """`run(*args)` on every rank; bad input is reported by rank 0 alone (the others exit 2 silently,
    so the error is one line)."""
    try:
        run(*args)
    except UserError:
        if os.environ.get("RANK", "0") != "0":
            raise SystemExit(2) from None
        raise


def generate_parallel(args, build_pipeline) -> None:
    """The `generate` command across ranks: every rank samples; rank 0 writes the outputs and is the
    one that reports bad input."""
    _reported_by_rank_zero(_generate_parallel, args, build_pipeline)


def _generate_parallel(args, build_pipeline) -> None:
    import torch.distributed as dist

    from slidefusion.parallel.api import parallel_latents
    from slidefusion.parallel.launch import init_distributed
    from slidefusion.parallel.trace import Tracer

    start = time.perf_counter()
    config, pipe = _prepare(args, build_pipeline)
    init_distributed(config.timeout_s)
    rank = dist.get_rank()
    tracer = Tracer(rank=rank, enabled=True)
    latents = parallel_latents(pipe, args.prompt, config, tracer, frames=args.frames, height=args.height,
                               width=args.width, steps=args.steps, guidance=args.guidance, seed=args.seed,
                               progress=rank == 0 and not args.quiet)
    _finish(args, tracer, start, latents, lambda: pipe.decode(latents), pipe.config.data.fps)


def generate_pretrained_parallel(args) -> None:
    """`generate --pretrained DIR --parallel SCHEDULE` under torchrun: every check first (one line,
    from rank 0), then every rank loads the folder and samples, the decode is split over the ranks,
    and rank 0 writes the outputs."""
    _reported_by_rank_zero(_generate_pretrained, args)


def _generate_pretrained(args) -> None:
    import torch.distributed as dist

    from slidefusion.parallel.launch import init_distributed, launcher_world
    from slidefusion.parallel.pretrained import PretrainedParts, Request, check_request, pretrained_video
    from slidefusion.parallel.trace import Tracer
    from slidefusion.pretrained import open_folder

    start = time.perf_counter()
    timeout = 300.0 if args.timeout is None else args.timeout
    config = ParallelConfig(args.parallel, parse_slices(args.slices), args.cfg_parallel, timeout)
    sizes = {k: getattr(args, k) for k in ("frames", "height", "width") if getattr(args, k, None) is not None}
    request = Request(args.prompt, steps=args.steps, guidance=args.guidance, seed=args.seed, **sizes)
    folder = open_folder(args.pretrained, args.transformer, what="--transformer")
    check_request(folder, request, config, launcher_world(), args.out)
    if args.lora:
        from slidefusion.io.lora_files import lora_for

        lora_for(folder, args.lora)
    init_distributed(config.timeout_s)
    rank = dist.get_rank()
    tracer = Tracer(rank=rank, enabled=True)
    parts = PretrainedParts.load(folder)
    if args.lora:
        from slidefusion.io.lora_files import apply_lora

        apply_lora(parts, args.lora, args.lora_scale)  # before the plans wrap the transformers
    latents, video = pretrained_video(parts, request, config, tracer)
    _finish(args, tracer, start, latents, lambda: video, parts.adapter.fps)


def _finish(args, tracer, start: float, latents, video_of, fps: int) -> None:
    """Every rank's trace to rank 0, which reports the steps and writes the latents and the video
    (`video_of()`, computed there only), then the group ends."""
    import torch.distributed as dist

    from slidefusion.data.video_io import write_video
    from slidefusion.pipeline import save_latents

    tracers = [None] * dist.get_world_size()
    dist.all_gather_object(tracers, tracer)
    if dist.get_rank() == 0:
        _report(tracers, args.trace)
        if args.save_latents:
            print(f"wrote {save_latents(args.save_latents, latents)}")
        video = video_of()
        write_video(Path(args.out), video, fps=fps)
        print(f"wrote {args.out}")
        print(f"{args.prompt!r}: {video.shape[1]} frames on {dist.get_world_size()} ranks ({args.parallel}) "
              f"in {time.perf_counter() - start:.1f} s")
    dist.barrier()
    dist.destroy_process_group()


def _report(tracers, trace_path) -> None:
    from slidefusion.parallel.trace import step_table, write_chrome_trace

    for row in step_table(tracers):
        print(f"step {row['step']}: {1e3 * row['wall_s']:.1f} ms, exposed communication "
              f"{1e3 * row['exposed_comm_s']:.1f} ms")
    if trace_path:
        write_chrome_trace(trace_path, tracers)
        print(f"wrote {trace_path}")


def add_simulate_parser(sub) -> None:
    simulate = sub.add_parser("simulate", help="predict parallel schedules' step time (discrete-event model)")
    simulate.add_argument("--scenario", choices=["paper", "custom", "full", "calibration"], default="paper",
                          help="paper: Open-Sora STDiT3-XL/2, 720p, ~16 s, 1/2/4 nodes x 8 A100 (default); "
                               "full: Wan 2.1 14B and HunyuanVideo 720p under (sliced) Ulysses on H100, 1-32 GPUs, "
                               "next to xDiT; calibration: the paper's numbers as each P4d assumption moves")
    simulate.add_argument("--model", default="stdit3-xl", type=types.arg_type("model", _sim_model),
                          help="stdit3-xl or an stdit preset (custom scenario), or a full-3D model (full scenario)")
    simulate.add_argument("--frames", type=types.positive_int, default=102, help="latent frames T (custom)")
    simulate.add_argument("--positions", type=types.positive_int, default=3600,
                          help="tokens per frame S after patching (custom)")
    simulate.add_argument("--nodes", type=types.int_list(), default="1,2,4",
                          help="comma-separated node counts (default 1,2,4)")
    simulate.add_argument("--gpus-per-node", type=types.positive_int, default=8)
    simulate.add_argument("--inter-gbps", type=types.number(0, low_open=True), default=400.0,
                          help="bandwidth between nodes, Gb/s per node (> 0)")
    simulate.add_argument("--calibration", metavar="JSON", type=types.existing_file,
                          help="measured rates overriding the A100 profile")
    simulate.add_argument("--json", metavar="PATH", type=types.output_file(".json"), help="also write the table as JSON")
    simulate.set_defaults(func=cmd_simulate)


def _sim_model(name: str) -> str:
    from slidefusion.parallel.simulate import model_dims
    from slidefusion.parallel.simulate_full import FULL_MODELS

    if name not in FULL_MODELS:
        model_dims(name)  # a UserError naming the valid models
    return name


# Calibration keys and their ranges: rates must be positive, times and the slowdown may be 0.
_RATES = {"flops": (0, True), "intra_Bps": (0, True), "inter_Bps_per_node": (0, True), "latency_s": (0, False),
          "slice_overhead_s": (0, False), "slowdown": (0, False), "bytes_per_value": (1, False)}


def _calibration(path: Path) -> dict:
    """The --calibration JSON object, every value a finite number in its range."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UserError(f"--calibration {path} is not a readable JSON file: {error}") from None
    if not isinstance(data, dict):
        raise UserError(f"--calibration {path} must hold a JSON object of rates, e.g. {{\"flops\": 1.5e14}}")
    unknown = sorted(set(data) - set(_RATES))
    if unknown:
        raise UserError(f"--calibration key {unknown[0]!r} is unknown; valid: {', '.join(sorted(_RATES))}")
    for key, (low, open_) in _RATES.items():
        if key in data:
            data[key] = validate.finite(data[key], f"--calibration {key}", low, low_open=open_)
    if "bytes_per_value" in data:
        data["bytes_per_value"] = validate.integer(data["bytes_per_value"], "--calibration bytes_per_value", 1)
    return data


def _hardware(args):
    import dataclasses

    from slidefusion.parallel.simulate import HARDWARE

    profile = HARDWARE["h100" if args.scenario == "full" else "a100"]
    hw = dataclasses.replace(profile, inter_Bps_per_node=args.inter_gbps * 1e9 / 8)
    if args.calibration:
        path = Path(args.calibration)
        hw = dataclasses.replace(hw, name=f"calibrated ({path.name})", **_calibration(path))
    return hw


def cmd_simulate(args) -> None:
    from slidefusion.parallel import simulate as sim

    nodes = args.nodes
    hw = _hardware(args)
    if args.scenario in ("full", "calibration"):
        return _simulate_more(args, hw)
    if args.scenario == "paper":
        report = sim.paper_scenario(hw, nodes, args.gpus_per_node)
    else:
        dims = sim.model_dims(args.model)
        rows = [sim.schedule_rows(sim.scenario_costs(dims, hw, args.frames, args.positions, 2, n, args.gpus_per_node),
                                  (1, 2, 4, 8, 16, 32), {"nodes": n, "gpus": n * args.gpus_per_node}) for n in nodes]
        report = sim.summarise(rows, nodes)
    report["hardware"] = vars(hw) if not hasattr(hw, "__dataclass_fields__") else __import__("dataclasses").asdict(hw)
    print(sim.format_table(report))
    if args.json:
        _write_json(Path(args.json), report)


def _simulate_more(args, hw) -> None:
    """--scenario full | calibration (kept apart from the STDiT table above)."""
    from slidefusion.parallel import simulate as sim
    from slidefusion.parallel import simulate_full as full

    if args.scenario == "calibration":
        report = {"steps": sim.calibration_steps(hw), "paper": sim.PAPER}
        for row in report["steps"]:
            print(f"{row['assumption']:<62} DSP {100 * row['dsp_comm_share_2_nodes']:4.1f}%  "
                  f"scalefusion {row['scalefusion_vs_dsp_2_nodes']:.2f}x / inter {row['inter_vs_dsp_2_nodes']:.2f}x  "
                  f"1->4 nodes {row['scaling_1_to_4_nodes']:.2f}x")
    else:
        names = list(full.FULL_MODELS) if args.model == "stdit3-xl" else [args.model]
        report = {"xdit": full.xdit_check(hw), "models": [full.full_scenario(n, hw, per_node=args.gpus_per_node)
                                                          for n in names]}
        for model in report["models"]:
            print(full.format_full(model))
        print(full.format_xdit(report["xdit"]))
    if args.json:
        _write_json(Path(args.json), report)


def _write_json(path: Path, report: dict) -> None:
    """Atomically (temp + rename): a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=1, default=str))
    tmp.replace(path)
    print(f"wrote {path}")
