"""Optimizer state across the trainer's two optimizers, so `--resume` may switch `--offload` on or off.

`ResidentOptimizer` saves `torch.optim.AdamW.state_dict()`: per parameter index, `step`, `exp_avg`
and `exp_avg_sq`, plus `param_groups`. `OffloadEngine` saves flat per-group buffers over each
group's trainable parameters: `groups` -> {master, exp_avg, exp_avg_sq}, `format`, `step` and `lr`.
With fp32 host state both hold the same numbers (the engine's fp32 update is torch's AdamW bit for
bit), so converting is copying them into the other layout. Lean host state (bf16 master, bf16 or
int8 moments) is not converted: its numbers are not torch's.
"""

import torch
from torch import nn

from slidefusion.errors import UserError
from slidefusion.offload.engine.layout import layout_of, split_groups
from slidefusion.offload.engine.engine import engine_blocks

ENGINE, TORCH = "offload engine", "torch AdamW"


def state_kind(state) -> str | None:
    """Which optimizer wrote `state`: ENGINE, TORCH, or None if neither."""
    if isinstance(state, dict) and isinstance(state.get("groups"), dict):
        return ENGINE
    if isinstance(state, dict) and isinstance(state.get("state"), dict) and isinstance(state.get("param_groups"), list):
        return TORCH
    return None


FP32 = {"master": "fp32", "moments": "fp32"}


def _check_fp32(found: dict) -> None:
    found = {key: found.get(key, "fp32") for key in FP32}
    if found != FP32:
        raise UserError(f"switching --offload on resume needs fp32 host state (offload.master=fp32, offload.moments=fp32); "
                        f"this one has master={found['master']}, moments={found['moments']}")


def torch_to_engine(state: dict, model: nn.Module, engine) -> dict:
    """A torch AdamW state of `model` (parameters in `model.parameters()` order) as the engine's.
    The master weights are the model's current weights, which `resume` has just loaded."""
    fmt = engine.state_dict()["format"]
    _check_fp32(fmt)
    index = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    weights = model.state_dict()
    groups, steps = {}, set()
    for group in engine.state.groups.values():
        flat = {key: torch.zeros(group.n_train, dtype=torch.float32) for key in ("master", "exp_avg", "exp_avg_sq")}
        for entry in group.layout.entries[:len(group.trainable)]:
            saved = state["state"].get(index[entry.name], {})
            span = slice(entry.offset, entry.offset + entry.numel)
            flat["master"][span] = weights[entry.name].detach().float().flatten()
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    flat[key][span] = saved[key].float().flatten()
            if "step" in saved:
                steps.add(int(saved["step"]))
        groups[group.name] = flat
    if len(steps) > 1:
        raise UserError(f"the saved torch AdamW state has parameters at different steps {sorted(steps)}; it cannot "
                        "be converted for --offload")
    return {"step": steps.pop() if steps else 0, "lr": float(state["param_groups"][0]["lr"]), "format": fmt,
            "groups": groups}


def engine_to_torch(state: dict, model: nn.Module, template: dict) -> dict:
    """The engine's saved state as a torch AdamW state of `model`; `template` is the resident
    optimizer's own (fresh) `state_dict()`, which supplies `param_groups`."""
    _check_fp32(state.get("format", {}))
    entries = {}  # parameter name -> (group name, Entry), laid out as the engine lays them out
    per_block, rest = split_groups(model, engine_blocks(model))
    for spec in [*per_block, rest]:
        group_name, layout = spec.name, layout_of(spec.trainable)
        saved = state["groups"].get(group_name)
        if saved is None or saved["exp_avg"].numel() != layout.numel:
            raise UserError(f"the saved offload state's group {group_name} does not fit this model; it cannot be converted")
        entries.update({entry.name: (group_name, entry) for entry in layout.entries})
    per_param = {}
    for i, (name, _) in enumerate(model.named_parameters()):
        if name not in entries:
            raise UserError(f"the saved offload state has no moments for {name}; it cannot be converted")
        group_name, entry = entries[name]
        flat, span = state["groups"][group_name], slice(entry.offset, entry.offset + entry.numel)
        per_param[i] = {"step": torch.tensor(float(state["step"])),
                        **{key: flat[key][span].view(entry.shape).clone() for key in ("exp_avg", "exp_avg_sq")}}
    param_groups = [dict(group, lr=float(state["lr"])) for group in template["param_groups"]]
    return {"state": per_param, "param_groups": param_groups}
