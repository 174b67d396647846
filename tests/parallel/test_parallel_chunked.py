"""Sliced Ulysses' pieces in one process: key-chunked softmax attention merged by log-sum-exp
equals whole attention, and in-place hooks leave a model as it was outside a parallel call."""

import pytest
import torch
from parallel_helpers import random_model, run_sample

from slidefusion.parallel import hooks
from slidefusion.parallel.chunked import attention_lse, attention_lse_reference, merge
from slidefusion.parallel.records import AttentionSite, access_for
from slidefusion.parallel.ulysses import UlyssesHook


def qkv(g, mq, mk, h, d, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(g, mq, h, d, generator=gen, dtype=dtype), torch.randn(g, mk, h, d, generator=gen, dtype=dtype),
            torch.randn(g, mk, h, d, generator=gen, dtype=dtype))


@pytest.mark.parametrize("g, mq, mk, h, d", [(1, 1, 1, 1, 8), (2, 7, 13, 3, 8), (1, 5, 40, 2, 16)])
def test_fast_lse_attention_matches_the_reference(g, mq, mk, h, d):
    q, k, v = qkv(g, mq, mk, h, d)
    out, lse = attention_lse(q, k, v)
    ref_out, ref_lse = attention_lse_reference(*(t.double() for t in (q, k, v)))
    assert (out.double() - ref_out).abs().max() < 1e-5 and (lse.double() - ref_lse).abs().max() < 1e-5


@pytest.mark.parametrize("cuts", [[13], [1, 12], [0, 5, 0, 8], [3, 3, 3, 4]])
def test_key_chunks_merged_by_lse_equal_whole_attention(cuts):
    q, k, v = qkv(2, 7, 13, 3, 8, seed=1)
    whole = attention_lse_reference(q, k, v)
    parts = None
    for kc, vc in zip(k.split(cuts, dim=1), v.split(cuts, dim=1)):
        parts = merge(parts, attention_lse(q, kc, vc))  # an empty chunk contributes nothing
    assert (parts[0] - whole[0]).abs().max() < 1e-5 and (parts[1] - whole[1]).abs().max() < 1e-5


def test_empty_queries_or_keys_give_none():
    q, k, v = qkv(1, 0, 4, 2, 8)
    assert attention_lse(q, k, v) is None
    q, k, v = qkv(1, 3, 0, 2, 8)
    assert attention_lse(q, k, v) is None and merge(None, None) is None


def test_hooks_are_inert_outside_a_parallel_call_and_keep_the_state_dict():
    model = random_model("dit3d-5h")
    keys = list(model.state_dict())
    before = run_sample(model, (1, 3, 2, 4, 6))
    hooks.attach(model.blocks[0], "shard", hooks.ShardHook("full"))
    hooks.attach(model.final, "gather", hooks.GatherHook())
    for i, block in enumerate(model.blocks):
        site = AttentionSite(i, f"blocks.{i}.attn", "full", False)
        hooks.attach(block.attn, "ulysses", UlyssesHook(site, access_for(block.attn)))
    assert hooks.hooked(model.blocks[0].attn, "ulysses") is not None and list(model.state_dict()) == keys
    assert torch.equal(run_sample(model, (1, 3, 2, 4, 6)), before)
    hooks.detach_all(model)
    assert hooks.hooked(model.blocks[0].attn, "ulysses") is None and "forward" not in vars(model.blocks[0].attn)
