"""Frozen parameters (LoRA) and loading into an engine built on the meta device."""

import copy
import json
import random
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from slidefusion.core.errors import UserError
from slidefusion.models import build_model, preset
from slidefusion.offload import OffloadEngine, OffloadPolicy
from slidefusion.optim import OptimConfig
from slidefusion.testing.delays import inject_delays

LR, WD = 3e-3, 0.1


def _model(depth=3, hidden=None) -> nn.Module:
    torch.manual_seed(0)
    options = {"hidden": hidden, "heads": 4} if hidden else {}
    model = build_model(preset("dit3d-tiny", depth=depth, text_dim=16, **options))
    with torch.no_grad():  # adaLN-Zero starts every block as the identity: wake them up
        for param in model.parameters():
            param.add_(0.02 * torch.randn_like(param))
    return model


def _freeze(model: nn.Module) -> None:
    """Some weights inside every block and outside them, as a partial fine-tune would."""
    for name, param in model.named_parameters():
        if name.endswith(("attn.qkv.weight", "cross_attn.kv.weight", "mlp.fc1.bias")) or name.startswith("t_embedder"):
            param.requires_grad_(False)


def _policy(compute_dtype=torch.float32, max_grad_norm=None, **options) -> OffloadPolicy:
    optim = OptimConfig(lr=LR, weight_decay=WD, max_grad_norm=max_grad_norm, warmup_steps=0, ema_decay=None)
    return OffloadPolicy(device="cpu", compute_dtype=compute_dtype, optim=optim, **options)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(2, 3, 2, 4, 4, generator=g)
    return (model(x, torch.rand(2, generator=g), torch.randn(2, 5, 16, generator=g)) - x.flip(0)).pow(2).mean()


def _resident(model: nn.Module, steps: int, max_grad_norm=None) -> list[float]:
    """torch.optim.AdamW(fused=True) over the trainable parameters only."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, weight_decay=WD, fused=True)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = _loss(model, step)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        optimizer.step()
        losses.append(loss.item())
    return losses


def _assert_bitwise(weights: dict, expected: dict) -> None:
    assert weights.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(weights[name], value), name


@pytest.mark.parametrize("max_grad_norm, resident_blocks", [(None, 0), (0.05, 1)])
def test_frozen_parameters_train_like_resident_training_of_the_rest(max_grad_norm, resident_blocks):
    model = _model()
    _freeze(model)
    reference = copy.deepcopy(model)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    engine = OffloadEngine(model, model.blocks, _policy(max_grad_norm=max_grad_norm, resident_blocks=resident_blocks))
    inject_delays(engine, 0.001, seed=5)
    losses = [engine.train_step(lambda m, s=step: _loss(m, s)) for step in range(8)]
    assert losses == _resident(reference, 8, max_grad_norm)
    weights = engine.model_state_dict()
    _assert_bitwise(weights, reference.state_dict())
    assert all(torch.equal(weights[n], v) for n, v in frozen.items())
    trainable = sum(p.numel() for p in reference.parameters() if p.requires_grad)
    assert engine.stats.d2h_bytes == 8 * trainable * 4  # no gradient leaves the device for a frozen weight
    # fp32 compute: the master is the compute copy (4 B) beside the moments (8 B)
    assert engine.stats.frozen_bytes_per_param == 4 and engine.stats.host_bytes_per_param == 12
    engine.close()


def test_a_frozen_parameter_holds_its_compute_copy_alone():
    model = _model()
    _freeze(model)
    engine = OffloadEngine(model, model.blocks, _policy(torch.bfloat16, master="bf16", moments="int8"))
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert engine.stats.frozen_bytes_per_param == 2
    assert engine.state.frozen_bytes() == 2 * frozen
    assert engine.stats.host_state_bytes == pytest.approx(engine.state.frozen_bytes() + engine.stats.host_bytes_per_param * trainable)
    engine.close()


def test_peft_lora_trains_like_resident_lora():
    from peft import LoraConfig, get_peft_model

    def wrapped():
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj", "fc1", "fc2"], init_lora_weights=False)
        torch.manual_seed(1)
        return get_peft_model(_model(), config).get_base_model()

    model, reference = wrapped(), wrapped()
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    engine = OffloadEngine(model, model.blocks, _policy())
    losses = [engine.train_step(lambda m, s=step: _loss(m, s)) for step in range(6)]
    assert losses == _resident(reference, 6)
    _assert_bitwise(engine.model_state_dict(), reference.state_dict())
    engine.close()


def _meta_engine(model_fn, policy):
    from accelerate import init_empty_weights

    with init_empty_weights():
        model = model_fn()
    assert next(model.parameters()).is_meta
    return OffloadEngine(model, model.blocks, policy)


def test_load_weights_equals_loading_a_materialised_model():
    def model_fn():
        model = build_model(preset("dit3d-tiny", depth=3, text_dim=16))
        _freeze(model)
        return model

    source = _model()
    state = list(source.state_dict().items())
    random.Random(0).shuffle(state)  # any order, as shards come
    loaded = _meta_engine(model_fn, _policy())
    loaded.load_weights(iter(state))
    materialised = model_fn()
    materialised.load_state_dict(source.state_dict())
    built = OffloadEngine(materialised, materialised.blocks, _policy())
    _assert_bitwise(loaded.model_state_dict(), built.model_state_dict())
    for step in range(3):
        assert loaded.train_step(lambda m, s=step: _loss(m, s)) == built.train_step(lambda m, s=step: _loss(m, s))
    _assert_bitwise(loaded.model_state_dict(), built.model_state_dict())


def test_load_weights_refuses_a_bad_checkpoint_in_one_line():
    engine = _meta_engine(lambda: build_model(preset("dit3d-tiny", depth=2, text_dim=16)), _policy())
    state = _model(depth=2).state_dict()
    first = next(iter(state))
    cases = [([(k, v) for k, v in state.items() if k != "final.linear.bias"], "1 weights missing, first final.linear.bias"),
             ([*state.items(), ("extra.weight", torch.zeros(1))], "unexpected key extra.weight"),
             ([(first, state[first]), (first, state[first])], f"{first} was given twice"),
             ([(first, torch.zeros(3))], f"{first} has shape \\(3,\\); this model needs")]
    for named, message in cases:
        with pytest.raises(UserError, match=message) as error:
            engine.load_weights(named)
        assert "\n" not in str(error.value)


RSS_SCRIPT = """
import json, sys, glob
import torch
from accelerate import init_empty_weights
from safetensors import safe_open
from slidefusion.models import build_model, preset
from slidefusion.offload import OffloadEngine, OffloadPolicy
from slidefusion.testing.rss import reset_peak_rss, status_kib

def status(key):
    return status_kib(key) * 1024

def stream(folder):
    for path in sorted(glob.glob(folder + "/*.safetensors")):
        with safe_open(path, framework="pt") as shard:  # one shard mapped at a time
            for key in shard.keys():
                yield key, shard.get_tensor(key)

with init_empty_weights():
    model = build_model(preset("dit3d-tiny", hidden=HIDDEN, heads=8, depth=DEPTH, text_dim=16))
assert reset_peak_rss()  # restart VmHWM from here
before = status("VmRSS")
engine = OffloadEngine(model, model.blocks, OffloadPolicy(device="cpu", compute_dtype=torch.float32))
engine.load_weights(stream(sys.argv[1]))
print(json.dumps({"before": before, "peak": status("VmHWM"), "after": status("VmRSS"),
                  "host_state": engine.stats.host_state_bytes, "params": sum(p.numel() for p in model.parameters())}))
"""


def test_loading_sharded_safetensors_peaks_near_the_final_host_state(tmp_path):
    """A ~100 MB model from four shards: the process peaks within 1.2x of what it finally holds."""
    from safetensors.torch import save_file

    hidden, depth = 512, 4
    state = build_model(preset("dit3d-tiny", hidden=hidden, heads=8, depth=depth, text_dim=16)).state_dict()
    keys = list(state)
    for shard in range(4):
        save_file({k: state[k].contiguous() for k in keys[shard::4]}, str(tmp_path / f"model-{shard}.safetensors"))
    assert sum(v.numel() * 4 for v in state.values()) > 90e6
    del state
    script = textwrap.dedent(RSS_SCRIPT).replace("HIDDEN", str(hidden)).replace("DEPTH", str(depth))
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, check=True)
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grown, peak = m["after"] - m["before"], m["peak"] - m["before"]
    print(f"load: peak {peak / 1e6:.0f} MB over the baseline, final {grown / 1e6:.0f} MB, "
          f"host state {m['host_state'] / 1e6:.0f} MB: peak / final = {peak / grown:.3f}")
    assert grown >= 0.9 * m["host_state"]  # the state really is in memory now
    assert peak <= 1.2 * grown and peak <= 1.2 * m["host_state"]
