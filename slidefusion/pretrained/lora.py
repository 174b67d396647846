"""LoRA on a folder's transformer with peft: adapters only train, the base weights stay frozen.

The adapters are injected with peft (`inject_adapter_in_model`, as diffusers' `add_adapter` does),
on a real model or on one built on the meta device for the offload engine, whose frozen weights then
stream host to device only. Their initial values are ours, a function of the run's seed alone
(A uniform in +-1/sqrt(fan_in) as peft's default kaiming init, B zero, so training starts from the
base model exactly), so that the resident and the offloaded runs start from the same numbers.

Checkpoints hold the adapter weights only (peft names, "...to_q.lora_A.default.weight");
`diffusers_lora_state` turns them into the layout `pipe.load_lora_weights(DIR)` reads.
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor, nn

from slidefusion.errors import UserError, check

ADAPTER = "default"


def _matches(name: str, target: str) -> bool:
    return name == target or name.endswith("." + target)


def target_modules(model: nn.Module, lora, defaults: tuple[str, ...]) -> list[str]:
    """`lora.target_modules` (or the family's defaults), each checked to name at least one Linear."""
    targets = list(lora.target_modules or defaults)
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for target in targets:
        if not any(_matches(n, target) for n in linear):
            # "to_out.0", not "0": a bare index names nothing a user would recognise
            suffixes = sorted({".".join(n.split(".")[-2:]) if n.split(".")[-1].isdigit() else n.split(".")[-1]
                               for n in linear})
            raise UserError(f"lora.target_modules: {target!r} matches no Linear module of {type(model).__name__}; "
                            f"valid names end in e.g. {', '.join(suffixes[:12])}")
    return targets


def peft_config(model: nn.Module, lora, defaults: tuple[str, ...]):
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=lora.rank, lora_alpha=lora.scale_alpha, target_modules=target_modules(model, lora, defaults),
                          init_lora_weights=True, lora_dropout=0.0)


def add_lora(model: nn.Module, lora, defaults: tuple[str, ...]) -> nn.Module:
    """Inject LoRA adapters into `model` in place (meta device or real) and freeze everything else."""
    from peft import inject_adapter_in_model

    config = peft_config(model, lora, defaults)
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)
    check(any(p.requires_grad for p in model.parameters()), "LoRA added no trainable weight")
    model.peft_lora_config = config  # what export writes as the adapter's metadata
    return model


def is_lora_weight(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def initial_lora_weights(model: nn.Module, seed: int) -> dict[str, Tensor]:
    """The adapters' starting values, a function of `seed` and the parameter names alone: lora_A
    uniform in [-1/sqrt(fan_in), 1/sqrt(fan_in)] (peft's default, kaiming_uniform with a = sqrt(5)),
    lora_B zero. Shapes come from the model (the meta device is enough)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in sorted(model.named_parameters()):
        if not is_lora_weight(name):
            continue
        if ".lora_A." in name:
            bound = 1.0 / math.sqrt(param.shape[1])
            weights[name] = (torch.rand(tuple(param.shape), generator=generator, dtype=torch.float64) * 2 - 1).mul(bound).float()
        else:
            weights[name] = torch.zeros(tuple(param.shape))
    return weights


def base_name(name: str) -> str:
    """A peft-wrapped module's weight name -> the name in the folder ("to_q.base_layer.weight" -> "to_q.weight")."""
    return name.replace(".base_layer.", ".")


def folder_names(model: nn.Module) -> dict[str, str]:
    """folder weight name -> this (possibly LoRA-wrapped) model's state-dict name, for the base weights."""
    return {base_name(name): name for name in model.state_dict() if not is_lora_weight(name)}


def diffusers_lora_state(weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """Checkpointed adapter weights (peft names with the adapter name) -> diffusers' LoRA layout
    without it ("blocks.0.attn1.to_q.lora_A.weight"), which `save_lora_weights` prefixes with
    "transformer."."""
    pattern = re.compile(rf"\.(lora_[AB])\.{ADAPTER}\.")
    return {pattern.sub(r".\1.", name): tensor for name, tensor in weights.items() if is_lora_weight(name)}
