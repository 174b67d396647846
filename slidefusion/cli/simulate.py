"""`slidefusion simulate`: predicted step times of the parallel schedules (`slidefusion.parallel.simulate`)."""

import json
from pathlib import Path

from slidefusion.core import validate
from slidefusion.cli import args as types
from slidefusion.cli import help_text
from slidefusion.core.errors import UserError
from slidefusion.io.files import write_text


EXAMPLES = ["slidefusion simulate", "slidefusion simulate --scenario full --inter-gbps 3200 --json sim.json"]


def add_parser(sub) -> None:
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
    simulate.add_argument("--gpus-per-node", type=types.positive_int, default=8, help="GPUs in each node (default 8)")
    simulate.add_argument("--inter-gbps", type=types.number(0, low_open=True), default=400.0,
                          help="bandwidth between nodes, Gb/s per node (> 0)")
    simulate.add_argument("--calibration", metavar="JSON", type=types.existing_file,
                          help="measured rates overriding the A100 profile")
    simulate.add_argument("--json", metavar="PATH", type=types.output_file(".json"), help="also write the table as JSON")
    help_text.examples(simulate, EXAMPLES)
    simulate.set_defaults(func=run)


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


def run(args) -> None:
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
    print(f"wrote {write_text(path, json.dumps(report, indent=1, default=str))}")
