"""An fp8 frozen base (`lora.base_dtype=float8_e4m3fn`): frozen weights held and streamed as fp8
codes with scales, dequantised per block on the device. The fast path (the engine) against the
slow reference (resident training of a model whose frozen weights are the dequantised values),
the halving of the host bytes and of the uploads, what the planner says, and one-line refusals."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from test_offload_frozen import _loss, _model, _policy, _resident

from slidefusion.cli import main
from slidefusion.core.errors import UserError
from slidefusion.offload import OffloadEngine
from slidefusion.offload.plan.footprint import engine_plan
from slidefusion.offload.engine.fp8 import FrozenCodes, dequantise, quantise
from slidefusion.testing.delays import inject_delays

FP8 = torch.float8_e4m3fn


def _lora_model():
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["qkv", "proj", "fc1", "fc2"], init_lora_weights=False)
    torch.manual_seed(1)
    return get_peft_model(_model(), config).get_base_model()


def _dequantised(model, per: str = "channel"):
    """The slow reference: the same model with every frozen weight replaced by its fp8 value."""
    with torch.no_grad():
        for _, param in model.named_parameters():
            if not param.requires_grad:
                codes, scales = quantise(param, FP8, per)
                param.copy_(dequantise(codes, scales, tuple(param.shape), torch.float32))
    return model


@pytest.mark.parametrize("per", ["channel", "tensor"])
def test_quantise_rounds_within_the_format_and_channel_scales_follow_the_rows(per):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 48, generator=g) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different ranges
    codes, scales = quantise(weight, FP8, per)
    assert codes.dtype == FP8 and scales.shape == ((64,) if per == "channel" else (1,))
    back = dequantise(codes, scales, (64, 48), torch.float32)
    row_scale = scales if per == "channel" else scales.expand(64)
    # e4m3: 3 mantissa bits (half an ulp is 2**-4 of the value), subnormals below 2**-6 in code units
    bound = torch.maximum(weight.abs() * 2**-4, row_scale[:, None] * 2**-10)
    assert ((back - weight).abs() <= bound).all()
    rel = ((back - weight).norm(dim=1) / weight.norm(dim=1))
    assert rel.max() < (0.04 if per == "channel" else 1.0)  # one scale per tensor loses the small rows
    assert quantise(torch.zeros(3, 4), FP8, per)[1].eq(1).all()  # an all-zero row does not divide by 0


@pytest.mark.parametrize("options", [{}, {"resident_blocks": 1}, {"prefetch": 2, "max_grad_norm": 0.05},
                                     {"frozen_scales": "tensor"}])
def test_fp8_base_trains_as_resident_training_of_the_dequantised_base(options):
    options = dict(options)
    clip = options.pop("max_grad_norm", None)
    model, reference = _lora_model(), _dequantised(_lora_model(), options.get("frozen_scales", "channel"))
    engine = OffloadEngine(model, model.blocks, _policy(max_grad_norm=clip, frozen_dtype=FP8, **options))
    inject_delays(engine, 0.001, seed=3)  # uploads land late: a decode of the wrong bytes would show
    losses = [engine.train_step(lambda m, s=step: _loss(m, s)) for step in range(5)]
    assert losses == _resident(reference, 5, clip)
    state = engine.model_state_dict()
    for name, param in reference.named_parameters():
        if param.requires_grad:
            assert torch.equal(state[name], param.detach()), name
        else:
            assert state[name].dtype == FP8  # the host holds codes for the frozen weights
    engine.close()


def test_the_host_state_and_the_uploads_halve_and_the_planner_says_so():
    results = {}
    for name, frozen_dtype in (("bf16", None), ("fp8", FP8)):
        model = _lora_model()
        policy = _policy(torch.bfloat16, frozen_dtype=frozen_dtype, zero_copy=False)
        plan = engine_plan(model, model.blocks, policy)
        engine = OffloadEngine(model, model.blocks, policy)
        engine.train_step(lambda m: _loss(m, 0))
        results[name] = (engine.stats, plan, engine.state.frozen_bytes())
        engine.close()
    bf16, fp8 = results["bf16"][0], results["fp8"][0]
    frozen = sum(p.numel() for n, p in _lora_model().named_parameters() if "lora_" not in n)
    assert bf16.frozen_bytes_per_param == 2
    assert 1 <= fp8.frozen_bytes_per_param < 1.3  # codes, and a float32 scale per row of these narrow weights
    assert results["fp8"][2] < 0.65 * results["bf16"][2] and results["bf16"][2] == 2 * frozen
    assert fp8.h2d_bytes < 0.7 * bf16.h2d_bytes  # the streamed blocks: mostly frozen, now a byte each
    for name in ("bf16", "fp8"):  # the planner's host entry is what the engine allocated (alignment aside)
        stats, plan, _ = results[name]
        state = next(v for k, v in plan.host.items() if k.startswith("persistent state"))
        assert abs(state - stats.host_state_bytes) <= 16 * 8, (name, state, stats.host_state_bytes)
    assert "fp8 codes + scales" in next(k for k in results["fp8"][1].host if k.startswith("persistent"))


def test_frozen_codes_write_whole_parameters_and_decode_in_place():
    from slidefusion.offload.engine.layout import Entry

    entries = [Entry("a", (4, 6), 10, 24), Entry("b", (5,), 34, 5)]
    codes = FrozenCodes(entries, 10, FP8, "channel", lambda n, dtype, dma: torch.empty(n, dtype=dtype))
    a, b = torch.randn(4, 6), torch.randn(5)
    codes.write(10, a)
    codes.write(34, b)
    flat = torch.zeros(39)
    codes.decode_into(codes.wire.clone(), flat)
    assert flat[:10].eq(0).all()
    assert torch.equal(flat[10:34].view(4, 6), codes.value(0)) and torch.equal(flat[34:], codes.value(1))
    assert (flat[10:34].view(4, 6) - a).abs().max() <= a.abs().max() * 2**-4


def test_policy_and_config_refuse_what_an_fp8_base_cannot_do(monkeypatch, tmp_path, capsys, tiny_wan_dir):
    with pytest.raises(UserError, match="zero_copy=True computes from the host buffers in place"):
        _policy(frozen_dtype=FP8, zero_copy=True)
    with pytest.raises(UserError, match="frozen_dtype=torch.bfloat16 is unsupported"):
        _policy(frozen_dtype=torch.bfloat16)
    base = ["train", "configs/wan-finetune.yaml", f"model.pretrained={tiny_wan_dir}", "data.kind=shapes",
            "data.frames=5", "data.height=48", "data.width=80", "run.device=cpu", f"run.output_dir={tmp_path}", "--quiet"]
    cases = [
        (["lora.base_dtype=float8_e4m3fn"], "lora.base_dtype=float8_e4m3fn stores a LoRA run's frozen base; set lora.rank"),
        (["lora.rank=4", "lora.base_dtype=int4"], "lora.base_dtype='int4' is unknown; valid: None, float8_e4m3fn, "
                                                  "float8_e5m2"),
        (["lora.rank=4", "lora.base_dtype=float8_e4m3fn"], "add --offload, or drop lora.base_dtype"),
        (["lora.rank=4", "lora.base_scales=row"], "lora.base_scales='row' is unknown; valid: channel, tensor"),
    ]
    for extra, message in cases:
        assert main([*base, *extra]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err

    def no_fp8(*args, **kwargs):  # a device whose torch build cannot cast float8
        raise RuntimeError("\"copy_\" not implemented for 'Float8_e4m3fn'")

    monkeypatch.setattr("slidefusion.offload.engine.fp8.torch.ones", no_fp8)
    assert main([*base, "lora.rank=4", "lora.base_dtype=float8_e4m3fn", "--offload"]) == 2
    err = capsys.readouterr().err
    assert "lora.base_dtype=float8_e4m3fn is not supported on cpu" in err and err.count("\n") == 1, err
    assert not any(tmp_path.rglob("*.safetensors"))  # refused before any cache


def test_new_frozen_weights_loaded_mid_run_are_decoded_again():
    model, reference = _lora_model(), _lora_model()
    engine = OffloadEngine(model, model.blocks, _policy(frozen_dtype=FP8))
    engine.train_step(lambda m: _loss(m, 0))
    engine.synchronize()
    g = torch.Generator().manual_seed(7)
    fresh = {n: p.detach() + 0.05 * torch.randn(p.shape, generator=g) for n, p in reference.named_parameters()}
    engine.load_weights(fresh.items())
    with torch.no_grad():
        for name, param in reference.named_parameters():
            param.copy_(fresh[name])
    _dequantised(reference)
    with torch.no_grad():
        expected = _loss(reference, 1).item()
    assert engine.train_step(lambda m: _loss(m, 1)) == expected  # the forward ran on the new base's values
    engine.close()


def test_a_wan_lora_trains_on_an_fp8_base_through_the_cli(tiny_wan_dir, tmp_path):
    import json

    from safetensors.torch import load_file

    def run(name, *extra):
        args = ["train", "configs/wan-finetune.yaml", f"model.pretrained={tiny_wan_dir}", "data.kind=shapes",
                "data.num_samples=2", "data.frames=5", "data.height=48", "data.width=80", "run.device=cpu",
                "run.steps=2", "run.batch_size=2", f"run.output_dir={tmp_path}", f"run.name={name}", "optim.lr=1e-2",
                "optim.warmup_steps=0", "lora.rank=4", "--offload", "offload.compute_dtype=float32", "--quiet", *extra]
        assert main(args) == 0
        losses = [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return losses, load_file(tmp_path / name / "checkpoint-2" / "model.safetensors")

    full, full_weights = run("base")
    fp8, fp8_weights = run("fp8", "lora.base_dtype=float8_e4m3fn")
    assert fp8_weights.keys() == full_weights.keys() and all(".lora_" in k for k in fp8_weights)
    assert fp8 != full and all(abs(a - b) <= 0.05 * abs(b) for a, b in zip(fp8, full))
