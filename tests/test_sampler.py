"""The self text's sampler (`mla_convert.sampler`): a slot per sequence in a preallocated cache, a token a step."""

from __future__ import annotations

import pytest
import torch

from mla_convert import sampler
from mla_convert.conversion import selftext
from mla_convert.checkpoint import open_source
from tiny import tiny_source

PROMPTS = [[1, 5, 9, 30], [1, 7], [1, 11, 12, 13, 14, 15, 16], [1], [1, 40, 41]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampler")
    kinds = ["llama-gqa", "mistral-window", "gemma2", "gemma3_text", "qwen3", "phi3"]
    return {k: selftext.causal_lm(open_source(str(tiny_source(k, root / k, seed=i)))) for i, k in enumerate(kinds)}


def run(model, width, temperature=1.0, eos=None, new=24, suppress=False, prompts=PROMPTS, seed=0, budget=None):
    requests = [sampler.Request(p, new, seed * 100 + i, suppress) for i, p in enumerate(prompts)]
    return list(sampler.sample(model, requests, width, temperature, eos, length=64, budget=budget))


@pytest.mark.parametrize("kind", ["llama-gqa", "mistral-window", "gemma2", "gemma3_text", "qwen3", "phi3"])
def test_greedy_is_generates_greedy(models, kind):
    """At temperature 0 every sequence is what `generate` writes greedily for its prompt alone: each slot at its own
    positions, refilled when its sequence ends (5 prompts in 2 slots), sliding windows (6 and 10 positions) kept."""
    model = models[kind]
    got = run(model, 2, temperature=0.0, new=30)
    for prompt, seq in zip(PROMPTS, got):
        ref = model.generate(input_ids=torch.tensor([prompt]), do_sample=False, max_new_tokens=30, min_new_tokens=30,
                             pad_token_id=0, eos_token_id=None)[0].tolist()
        assert seq == ref


def test_samples_from_the_models_own_distribution(models):
    """Every sampled token is drawn from softmax(logits / T) of the logits a full forward of its prefix gives (the
    slots at different positions, the cache read back right); and `choose` draws each token at its probability."""
    model = models["gemma2"]
    seen = []
    real = sampler.choose
    try:
        sampler.choose = lambda logits, t, u: seen.append(logits.clone()) or real(logits, t, u)
        seqs = run(model, 2, temperature=1.3, prompts=PROMPTS[:2], new=12)
    finally:
        sampler.choose = real
    for row, seq in enumerate(seqs):
        with torch.inference_mode():
            full = model(input_ids=torch.tensor([seq])).logits[0].float()
        for t in range(len(seq) - 1):
            torch.testing.assert_close(seen[t][row], full[t], rtol=1e-4, atol=1e-4)

    logits = torch.tensor([[0.0, 1.0, -1.0, 2.0, -60.0]])
    n = 100_000
    picked = sampler.choose(logits.expand(n, -1), 1.3, torch.rand(n, generator=torch.Generator().manual_seed(0)))
    freq = torch.bincount(picked, minlength=5).double() / n
    expected = torch.softmax(logits[0].double() / 1.3, -1)
    assert (freq - expected).abs().max() < 0.005 and freq[4] == 0


def test_seeded_ordered_and_independent_of_the_width(models):
    """The same requests give the same sequences; another seed other ones; sequences come in the requests' order
    with their prompts first, whatever the width (each request's uniforms are its own)."""
    model = models["llama-gqa"]
    a = run(model, 2)
    assert run(model, 2) == a
    assert [s[: len(p)] for p, s in zip(PROMPTS, a)] == PROMPTS and all(len(s) == len(p) + 24 for p, s in zip(PROMPTS, a))
    assert run(model, 2, seed=1) != a
    assert run(model, 5) == a and run(model, 1) == a  # float32 on a tiny model: the same rounding


def test_a_read_prompt_is_copied_not_read_again(models, monkeypatch):
    """Six requests cycling two prompts, then one sharing four tokens with the second: the later requests copy the
    keys and values a prompt's first reading left (each but its last token) and step from there, and sample what
    they would with their prompts read anew (the store off), in one slot and in two."""
    model = models["llama-gqa"]
    prompts = [PROMPTS[0], PROMPTS[2]] * 3 + [PROMPTS[2][:4] + [50, 51]]
    steps, real_step = [], sampler._forward
    monkeypatch.setattr(sampler, "_forward", lambda *a: steps.append(1) or real_step(*a))
    got = run(model, 1, prompts=prompts)
    # in one slot a step is one token: 24 answer tokens a request, each fed its prompt's last token or its own
    # previous one; before them the prompt tokens read: 3 by the first, 5 by the second (its BOS is the first's), none
    # by the repeats, 1 by the last
    assert len(steps) == 7 * 24 + 3 + 5 + 1 and run(model, 2, prompts=prompts) == got
    monkeypatch.setattr(sampler._PromptStore, "match", lambda self, prompt: (0, None))
    steps.clear()
    assert run(model, 1, prompts=prompts) == got and len(steps) == 7 * 24 + 3 * 3 + 3 * 6 + 5
    assert run(model, 2, prompts=prompts) == got


def test_decode_attention_is_eager_attention(models):
    """`decode_attention` (each kv head's query group as the rows of one product) computes what transformers' eager
    attention does, grouped heads, soft-capping and masks included, at one query and at several; the sampler's model
    attends through it while it samples, and as before once its samples end or are dropped."""
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    gen = torch.Generator().manual_seed(0)
    for q_len, softcap in ((1, None), (1, 20.0), (5, None)):
        query, key, value = (torch.randn(3, h, n, 16, generator=gen) for h, n in ((6, q_len), (2, 9), (2, 9)))
        mask = torch.zeros(3, 1, q_len, 9).masked_fill_(torch.rand(3, 1, q_len, 9, generator=gen) < 0.3, -1e30)
        mask[..., 0] = 0  # every query sees a key
        module = torch.nn.Module()
        module.num_key_value_groups, module.head_dim, module.training = 3, 16, False
        want, _ = eager_attention_forward(module, query, key, value, mask, scaling=0.3, softcap=softcap)
        got, _ = sampler.decode_attention(module, query, key, value, mask, scaling=0.3, softcap=softcap)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # in bfloat16 (scores in float32 from the products on): float32 attention within bfloat16 rounding
        low, _ = sampler.decode_attention(module, query.bfloat16(), key.bfloat16(), value.bfloat16(), mask,
                                          scaling=0.3, softcap=softcap)
        torch.testing.assert_close(low.float(), want, rtol=0.05, atol=0.02)
    with pytest.raises(NotImplementedError):
        sampler.decode_attention(module, query, key, value, mask, s_aux=torch.zeros(6))

    model = models["llama-gqa"]
    own = model.config._attn_implementation
    samples = sampler.sample(model, [sampler.Request([1, 5], 4, 0)] * 3, 2, 1.0, None, 16)
    next(samples)
    assert model.config._attn_implementation == sampler.DECODE_ATTENTION != own
    samples.close()
    assert model.config._attn_implementation == own
    assert len(run(model, 2)) == len(PROMPTS) and model.config._attn_implementation == own


def test_eos_ends_a_sequence_and_a_document_suppresses_it(models):
    """A sampled EOS ends its sequence (kept), the slot takes the next request: each sequence is the one sampled
    without an EOS, cut after its first; a document request never samples EOS and has exactly its new tokens."""
    model = models["qwen3"]
    free = run(model, 2, temperature=1.0)
    eos = free[0][len(PROMPTS[0]) + 3]  # a token the first answer samples
    cut = run(model, 2, temperature=1.0, eos=eos)
    for prompt, whole, seq in zip(PROMPTS, free, cut):
        answer = whole[len(prompt):]
        end = answer.index(eos) + 1 if eos in answer else len(answer)
        assert seq == prompt + answer[:end]
    assert len(cut[0]) == len(PROMPTS[0]) + 4
    docs = run(model, 2, temperature=1.0, eos=eos, suppress=True)
    assert all(len(s) == len(p) + 24 and eos not in s[len(p):] for p, s in zip(PROMPTS, docs))


def test_budget_stops_starting_requests(models):
    """With a token budget the sequences end soon after they hold it: the first ones of the unbounded stream."""
    model = models["llama-gqa"]
    endless = run(model, 2)
    some = run(model, 2, budget=40)
    assert sum(map(len, some)) >= 40 and some == endless[: len(some)] and len(some) < len(endless)


def test_self_text_cache_key_names_the_sampler(sources, tmp_path, monkeypatch):
    """Text of the earlier sampler (cache version 1) is not read for the new one's."""
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path))
    src = open_source(str(sources["llama-gqa"]))
    settings, path = selftext.cache_entry(src, 0, 1.0, 64, 4)
    monkeypatch.setattr(selftext, "CACHE_VERSION", 1)
    assert selftext.cache_entry(src, 0, 1.0, 64, 4)[1] != path and settings["version"] == 2


def test_dry_run_prices_a_tiny_models_sampling():
    """The estimate of sampling is not a flop count alone: a 3-layer, 192-wide model with a 49,152-token vocabulary
    still takes time a token (its head, its sampling over the vocabulary, each step's fixed cost), less in wider
    steps, more in longer sequences."""
    from transformers import LlamaConfig

    from mla_convert.conversion import estimates

    tiny = LlamaConfig(vocab_size=49152, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                       num_attention_heads=3, num_key_value_heads=1)
    seconds = estimates.sample_seconds(tiny, 65536, 64)
    assert seconds > 30 and estimates.sample_seconds(tiny, 65536, 8) > seconds
    assert estimates.sample_seconds(tiny, 2 * 65536, 64) == pytest.approx(2 * seconds)
    # attention reads the cached positions: long documents cost more a token than short ones, and than chat answers
    # of the same length (those read the whole buffer from the start, documents their own positions until its middle)
    long_doc, short_doc = (estimates.sample_seconds(tiny, 65536, 8, length=n, document=True) for n in (8192, 2048))
    assert long_doc > short_doc > estimates.sample_seconds(tiny, 65536, 8, length=256, document=True)
    assert estimates.sample_seconds(tiny, 65536, 8, length=2048) > short_doc
    # the prefix every chat prompt shares (its template's system turn) is read once: those tokens take no step
    less = estimates.sample_seconds(tiny, 65536, 64, length=256, prompt=44, shared=30)
    assert less == pytest.approx(estimates.sample_seconds(tiny, 65536, 64, length=256) * (300 - 30) / 300)
