"""Data-free calibration (`--calib-data self`: text sampled from the source, seeded and cached) and weighted mixtures
of calibration texts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mla_convert import policy
from mla_convert.conversion import selftext
from mla_convert.conversion.calibration import calibration_tokens, parse_mixture, token_windows, window_counts
from mla_convert.checkpoint import open_source
from mla_convert.conversion.plan import default_calib_samples
from mla_convert.errors import UserError


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "self-text"


def test_parse_mixture():
    assert parse_mixture("self") == [("self", 1.0)]
    assert parse_mixture("a.txt:0.25, self:0.75") == [("a.txt", 0.25), ("self", 0.75)]
    # a datasets name's config and split are not weights; a weight may follow them
    assert parse_mixture("wikitext:wikitext-2-raw-v1:validation") == [("wikitext:wikitext-2-raw-v1:validation", 1.0)]
    assert parse_mixture("wikitext:wikitext-2-raw-v1:validation:2") == [("wikitext:wikitext-2-raw-v1:validation", 2.0)]
    for bad in ("a.txt:0", "a.txt:-1", "a.txt:inf", "a.txt:nan", "self,,a.txt"):
        with pytest.raises(UserError):
            parse_mixture(bad)


def test_parse_mixture_datasets_name_beside_a_file_of_that_name(tmp_path, monkeypatch):
    """`wikitext:CONFIG` names a datasets config even where a file called `wikitext` is in the current folder; a file
    written as a path with a word after it is a bad weight."""
    monkeypatch.chdir(tmp_path)
    Path("wikitext").write_text("a file named like a data set\n")
    Path("calib.txt").write_text("text\n")
    assert parse_mixture("wikitext:wikitext-2-raw-v1") == [("wikitext:wikitext-2-raw-v1", 1.0)]
    assert parse_mixture("wikitext:2") == [("wikitext", 2.0)]
    for bad in ("calib.txt:abc", "./wikitext:abc", "self:abc"):
        with pytest.raises(UserError, match="weight of"):
            parse_mixture(bad)


def test_window_counts():
    assert window_counts([1, 1], 8) == [4, 4]
    assert window_counts([1, 3], 8) == [2, 6]
    assert window_counts([1, 1, 1], 8) == [3, 3, 2]
    assert sum(window_counts([0.2, 0.3, 0.5], 7)) == 7
    with pytest.raises(UserError, match="raise --calib-samples"):
        window_counts([0.01, 1], 4)


def test_self_text_is_seeded_and_cached(sources, cache, monkeypatch):
    src = open_source(str(sources["llama-gqa"]))
    a = selftext.self_tokens(src, 200, seed=0)
    files = list(cache.glob("*.json"))
    assert a.numel() >= 200 and len(files) == 1
    record = json.loads(files[0].read_text())  # plain JSON: token ids and their text
    assert record["settings"]["seed"] == 0 and all(isinstance(t, str) for b in record["batches"] for t in b["text"])
    vocab = src.config.vocab_size
    assert 0 <= int(a.min()) and int(a.max()) < vocab

    calls = []
    real = selftext.sample_stream
    monkeypatch.setattr(selftext, "sample_stream", lambda *args, **kw: calls.append(args[2]) or real(*args, **kw))
    assert torch.equal(selftext.self_tokens(src, 200, seed=0), a)  # read back, nothing sampled
    assert calls == []
    longer = selftext.self_tokens(src, a.numel() + 1, seed=0)  # samples only the samples it lacks
    held = sum(len(b["tokens"]) for b in record["batches"])
    assert calls == [held] and torch.equal(longer[: a.numel()], a)
    assert not torch.equal(selftext.self_tokens(src, 200, seed=1)[:100], a[:100])  # another seed, other text


def test_self_text_samples_in_bfloat16_where_the_cpu_prefers_it(sources, cache, monkeypatch):
    """On a CPU with bfloat16 arithmetic a wide source samples in bfloat16 (a tiny one stays float32), under a cache
    key of its own: the float32 text is neither read for it nor replaced by it."""
    from mla_convert import dtypes

    src = open_source(str(sources["llama-gqa"]))
    assert src.config.hidden_size < dtypes.BF16_MIN_HIDDEN
    monkeypatch.setattr(dtypes, "cpu_bf16_native", lambda: True)
    assert selftext.sampling_dtype(src) == torch.float32  # too narrow to gain
    assert selftext.sampling_dtype(src, "cuda") == torch.bfloat16
    f32 = selftext.self_tokens(src, 200, seed=0)
    monkeypatch.setattr(dtypes, "cpu_prefers_bf16", lambda hidden: True)
    assert selftext.sampling_dtype(src) == torch.bfloat16
    loaded = []
    real = selftext.causal_lm
    monkeypatch.setattr(selftext, "causal_lm", lambda s, d, dtype: loaded.append(dtype) or real(s, d, dtype))
    b16 = selftext.self_tokens(src, 200, seed=0)
    assert loaded == [torch.bfloat16] and not torch.equal(b16[:200], f32[:200])
    keys = sorted(json.loads(p.read_text())["settings"].get("dtype", "float32") for p in cache.glob("*.json"))
    assert keys == ["bfloat16", "float32"]
    assert torch.equal(selftext.self_tokens(src, 200, seed=0), b16) and len(loaded) == 1  # read back
    monkeypatch.setattr(dtypes, "cpu_prefers_bf16", lambda hidden: False)
    assert torch.equal(selftext.self_tokens(src, 200, seed=0), f32)


def test_cache_is_keyed_by_the_prompts(sources, cache, monkeypatch):
    """Chat text answers PROMPTS: another list samples its own text instead of reading this one's."""
    src = open_source(str(sources["llama-gqa"]))
    selftext.self_tokens(src, 200, seed=0)
    calls = []
    real = selftext.sample_stream
    monkeypatch.setattr(selftext, "sample_stream", lambda *args, **kw: calls.append(args[2]) or real(*args, **kw))
    monkeypatch.setattr(selftext, "PROMPTS", selftext.PROMPTS[::-1])
    assert "prompts" in selftext.cache_entry(src, 0, 1.0, 64, 4)[0]
    selftext.self_tokens(src, 200, seed=0)
    assert calls and calls[0] == 0  # sampled again from the first sample
    assert len(list(cache.glob("*.json"))) == 2


def test_foreign_or_broken_cache_is_sampled_again(sources, cache):
    src = open_source(str(sources["llama-gqa"]))
    a = selftext.self_tokens(src, 100, seed=3)
    path = next(cache.glob("*.json"))
    path.write_text("{not json")
    assert torch.equal(selftext.self_tokens(src, 100, seed=3), a)
    record = json.loads(path.read_text())
    record["batches"][0]["tokens"][0][0] = "x"  # not a token id
    path.write_text(json.dumps(record))
    assert torch.equal(selftext.self_tokens(src, 100, seed=3), a)


def test_mixture_windows(sources, cache, calib_text):
    """A weighted mixture: each part's windows in the weights' proportions, in order; `self` windows are the
    consecutive sampled stream, a file's are its own random windows."""
    src = open_source(str(sources["llama-gqa"]))
    mixed = calibration_tokens(src, f"{calib_text}:1,self:3", 8, 16, seed=0)
    assert mixed.shape == (8, 16)
    text = token_windows(src.tokenizer(), calib_text.read_text(), 2, 16, 0)
    assert torch.equal(mixed[:2], text)
    stream = selftext.self_tokens(src, 6 * 16, seed=0, temperature=selftext.CALIB_TEMPERATURE)
    assert torch.equal(mixed[2:], stream[: 6 * 16].view(6, 16))


def test_tokens_to_sample_are_what_the_cache_lacks(sources, cache, calib_text):
    """What `--dry-run` prices as sampling: the self text's windows the cache does not hold yet, none of a file's."""
    from mla_convert.conversion.calibration import self_tokens_to_sample

    src = open_source(str(sources["llama-gqa"]))
    spec = f"{calib_text}:1,self:3"
    assert self_tokens_to_sample(src, spec, 8, 16, seed=0) == 6 * 16  # nothing cached: the self part's 6 windows
    assert self_tokens_to_sample(src, str(calib_text), 8, 16, seed=0) == 0
    calibration_tokens(src, spec, 8, 16, seed=0)
    assert self_tokens_to_sample(src, spec, 8, 16, seed=0) == 0
    held = selftext.self_tokens(src, 6 * 16, seed=0, temperature=selftext.CALIB_TEMPERATURE).numel()
    assert self_tokens_to_sample(src, "self", held // 16 + 4, 16, seed=0) == (held // 16 + 4) * 16 - held
    assert self_tokens_to_sample(src, spec, 8, 16, seed=1) == 6 * 16  # another seed: other text


def test_document_windows(sources, cache, monkeypatch):
    """`self-doc`: every window is one document sampled from the BOS token alone, as long as the window (EOS
    suppressed), cached apart from the chat text; mixed with `self` by weight."""
    src = open_source(str(sources["llama-gqa"]))
    tok = src.tokenizer()
    start = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    monkeypatch.setattr(selftext, "DOC_BATCH", 2)
    docs = calibration_tokens(src, "self-doc", 3, 24, seed=0)
    assert docs.shape == (3, 24)
    assert docs[:, 0].tolist() == [start] * 3  # each window starts its own document
    assert tok.eos_token_id is None or not (docs[:, 1:] == tok.eos_token_id).any()  # none ends early
    records = [json.loads(f.read_text()) for f in cache.glob("*.json")]
    assert [r["settings"]["style"] for r in records] == ["document"]
    assert all(len(s) == 24 for r in records for b in r["batches"] for s in b["tokens"])

    mixed = calibration_tokens(src, "self:1,self-doc:3", 4, 24, seed=0)
    assert torch.equal(mixed[1:], docs)  # the document windows (cached) after the chat window
    assert torch.equal(mixed[:1], selftext.self_tokens(src, 24, seed=0, temperature=selftext.CALIB_TEMPERATURE)[:24].view(1, 24))
    assert len(list(cache.glob("*.json"))) == 2  # chat and document text in their own files


def test_chat_template_prompts():
    """An instruct tokenizer's prompts go through its chat template; a base tokenizer starts from BOS."""

    class Chat:
        chat_template = "x"
        bos_token_id = 1

        def apply_chat_template(self, messages, add_generation_prompt, tokenize):
            assert add_generation_prompt and tokenize
            return [7, len(messages[0]["content"]), 8]

    class Base:
        chat_template = None
        bos_token_id = 5
        eos_token_id = 6

    out = selftext.prompts(Chat(), 1, 2)
    assert out == [[7, len(selftext.PROMPTS[1]), 8], [7, len(selftext.PROMPTS[2]), 8]]
    assert selftext.prompts(Base(), 0, 3) == [[5]] * 3


def test_convert_data_free(sources, convert_tiny, cache):
    """The default calibration is the source's own text: no file needed; the record names it and the sampling
    settings, which reach the sampler (its cache is keyed by them; answers stop at the given length)."""
    out = convert_tiny(sources["llama-gqa"], rank=8, rope_dims=8, calib_data="self", calib_temperature=0.5,
                       calib_sample_tokens=8)
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["options"]["calib_data"] == "self"
    assert (prov["options"]["calib_temperature"], prov["options"]["calib_sample_tokens"]) == (0.5, 8)
    records = [json.loads(f.read_text()) for f in cache.glob("*.json")]
    assert [(r["settings"]["temperature"], r["settings"]["sample_tokens"]) for r in records] == [(0.5, 8)]
    tok = open_source(str(sources["llama-gqa"])).tokenizer()
    width = max(len(p) for p in selftext.prompts(tok, 0, selftext.BATCH))
    assert max(len(s) for r in records for b in r["batches"] for s in b["tokens"]) <= width + 8
    from mla_convert.convert import ConvertOptions

    assert ConvertOptions().calib_data == "self"
    assert (ConvertOptions().calib_temperature, ConvertOptions().calib_sample_tokens) == (None, selftext.SAMPLE_TOKENS)


@pytest.mark.parametrize("budget", [0.25, 0.5])
def test_default_temperature_follows_the_cache_kept(sources, convert_tiny, cache, budget):
    """Without --calib-temperature the `self` text is sampled hotter for a small cache (1.2 below 37.5% of the
    source's) and at the model's own temperature (1.0) for a wider one; without --calib-samples a small cache
    calibrates on 16 windows and a wider one on 32. Provenance and the cache record what ran."""
    out = convert_tiny(sources["llama-gqa"], kv_budget=budget, calib_data="self", calib_sample_tokens=8,
                       calib_samples=None, calib_seq_len=16, refine_steps=0, refine_model_steps=0)
    prov = json.loads((out / "provenance.json").read_text())
    kept = prov["kv_cache"]["ratio"]
    assert kept == pytest.approx(budget)
    expected = selftext.CALIB_TEMPERATURE if budget < policy.WIDE_FROM else selftext.TEMPERATURE
    assert expected == (1.2 if budget == 0.25 else 1.0) and selftext.calib_temperature(kept) == expected
    assert prov["options"]["calib_temperature"] == expected
    records = [json.loads(f.read_text()) for f in cache.glob("*.json")]
    assert [r["settings"]["temperature"] for r in records] == [expected]
    windows = 16 if budget == 0.25 else 32
    assert default_calib_samples(kept) == windows and prov["options"]["calib_samples"] == windows


def test_eval_warns_on_any_text_of_a_mixture(sources, convert_tiny, cache, calib_text):
    from mla_convert.conversion.calibration import calibration_overlap

    out = convert_tiny(sources["llama-gqa"], rank=8, rope_dims=8, calib_data=f"self:1,{calib_text}:1")
    assert "calibrated on" in calibration_overlap(str(out), str(calib_text), calib_text.read_text())
    assert calibration_overlap(str(out), "other.txt", "unrelated text") is None


def test_self_text_refuses_a_source_that_does_not_fit(sources, cache, monkeypatch):
    """Sampling holds the whole source in float32 (conversion streams layers): refused before loading, with the fix."""
    src = open_source(str(sources["llama-gqa"]))
    need = src.nbytes() * 4 // src.element_size("model.embed_tokens.weight")
    real_causal_lm = selftext.causal_lm
    monkeypatch.setattr(selftext, "available_memory", lambda: need)  # just short of need / 0.9
    monkeypatch.setattr(selftext, "causal_lm", lambda s: pytest.fail("the source was loaded"))
    with pytest.raises(UserError, match="--calib-data FILE"):
        selftext.self_tokens(src, 200, seed=0)
    assert not list(cache.glob("*.json"))
    monkeypatch.setattr(selftext, "causal_lm", real_causal_lm)
    monkeypatch.setattr(selftext, "available_memory", lambda: 2 * need)
    assert selftext.self_tokens(src, 200, seed=0).numel() >= 200
