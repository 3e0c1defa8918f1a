"""The GGUF export (llama.cpp's deepseek2): metadata and tensors as llama.cpp's loader reads them, refusals before
anything is written, and tiny conversions run in llama.cpp itself (.venv-llamacpp, scripts/install-llamacpp.sh)
against the native model in transformers: log-probs, greedy tokens, perplexity and the KV cache it allocates."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error

from mla_convert.errors import UserError
from mla_convert.export.gguf import export_gguf
from mla_convert.serving.llamacpp import llamacpp_python, run_llamacpp

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py
torch.set_num_threads(2)

VOCAB = 320
needs_llamacpp = pytest.mark.skipif(llamacpp_python() is None, reason="needs scripts/install-llamacpp.sh (.venv-llamacpp)")


def convert_tiny(kind, tmp_path, rank=24, rope_dims=8, strategy="uniform", merge=True, **source_overrides):
    from tiny import tiny_source

    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert

    source = tiny_source(kind, tmp_path / f"source-{kind}", **source_overrides)
    options = ConvertOptions(rank=rank, rope_dims=rope_dims, rope_strategy=strategy, rope_merge=merge,
                             method="weight", calib_data=None, force=True)  # fmt: skip
    native = tmp_path / f"native-{kind}"
    convert(open_source(str(source)), native, options, progress=False)
    return source, native


def native_scores(native, windows, prompts, new_tokens):
    from mla_convert.serving.engine import score_in_transformers

    return score_in_transformers(native, windows, prompts, new_tokens=new_tokens)


def logprob_difference(a: dict, b: dict) -> float:
    return max(abs(x - y) for wa, wb in zip(a["logprobs"], b["logprobs"], strict=True) for x, y in zip(wa, wb, strict=True))


def fields(path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    values = {}
    for name, f in reader.fields.items():
        if f.types and f.types[0] == gguf.GGUFValueType.STRING:
            values[name] = bytes(f.parts[f.data[0]]).decode()
        elif f.types and f.types[0] != gguf.GGUFValueType.ARRAY:
            values[name] = f.parts[f.data[0]][0].item()
    tensors = {t.name: (tuple(int(x) for x in t.shape), t.tensor_type.name) for t in reader.tensors}
    return values, tensors


# ------------------------------------------------------------------------------------------ what is written


def test_metadata_and_tensors_as_llamacpp_reads_them(tmp_path):
    _, native = convert_tiny("llama-gqa", tmp_path)
    record = export_gguf(native, tmp_path / "m.gguf", "f32")
    values, tensors = fields(tmp_path / "m.gguf")
    assert values["general.architecture"] == "deepseek2"
    layers, d_c, d_r = 2, record["kv_lora_rank"], record["qk_rope_head_dim"]
    assert values["deepseek2.block_count"] == layers and values["deepseek2.leading_dense_block_count"] == layers
    assert values["deepseek2.attention.head_count_kv"] == 1 and values["deepseek2.attention.kv_lora_rank"] == d_c
    assert values["deepseek2.attention.key_length"] == d_c + d_r and values["deepseek2.attention.value_length"] == d_c
    assert values["deepseek2.rope.dimension_count"] == d_r and values["deepseek2.expert_shared_count"] == 0
    assert values["deepseek2.attention.q_lora_rank"] == 64  # hidden 64 = 4 heads x (8 + 8): q_a = a I (input)
    assert values["tokenizer.ggml.model"] == "gpt2" and values["tokenizer.ggml.pre"] == "gpt-2"
    assert values["tokenizer.ggml.bos_token_id"] == 1 and values["tokenizer.ggml.eos_token_id"] == 2
    # ggml shapes: {columns, rows[, heads]}
    heads, nope, value = 4, record["qk_nope_head_dim"], record["v_head_dim"]
    assert tensors["blk.0.attn_k_b.weight"][0] == (nope, d_c, heads)
    assert tensors["blk.0.attn_v_b.weight"][0] == (d_c, value, heads)
    assert tensors["blk.0.attn_kv_a_mqa.weight"][0] == (64, d_c + d_r)
    assert {"output.weight", "blk.1.attn_q_a_norm.weight", "blk.1.attn_kv_a_norm.weight"} <= set(tensors)
    assert "blk.0.attn_q.weight" not in tensors
    assert record["kv_cache_elements_per_token"] == layers * (d_c + d_r)


def test_types(tmp_path):
    _, native = convert_tiny("llama-mha", tmp_path)
    for kind, big in (("f16", "F16"), ("bf16", "BF16"), ("q8_0", "Q8_0")):
        export_gguf(native, tmp_path / f"{kind}.gguf", kind)
        _, tensors = fields(tmp_path / f"{kind}.gguf")
        assert tensors["blk.0.ffn_up.weight"][1] == big and tensors["blk.0.attn_norm.weight"][1] == "F32"
        # the identity norms' tiny scales stay float32 where float16 (and Q8_0's float16 block scales) cannot hold them
        assert tensors["blk.0.attn_kv_a_mqa.weight"][1] == ("BF16" if kind == "bf16" else "F32")


def test_lite_layer_count_writes_the_query_without_lora(tmp_path):
    _, native = convert_tiny("llama-gqa", tmp_path, num_hidden_layers=26, hidden_size=32, intermediate_size=32)
    record = export_gguf(native, tmp_path / "lite.gguf", "f32")
    values, tensors = fields(tmp_path / "lite.gguf")
    assert record["q_lora_rank"] is None and "deepseek2.attention.q_lora_rank" not in values
    assert "blk.25.attn_q.weight" in tensors and "blk.0.attn_q_a.weight" not in tensors


# --------------------------------------------------------------------------------------------------- refusals


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix in (".gguf", ".partial"))


def test_refusals_before_writing(tmp_path):
    from typer.testing import CliRunner

    from mla_convert.cli import app

    out = tmp_path / "outs"
    out.mkdir()
    source, native = convert_tiny("llama-gqa", tmp_path)
    _, biased = convert_tiny("qwen2", tmp_path)
    _, qwen3 = convert_tiny("qwen3", tmp_path)
    _, grouped = convert_tiny("llama-mha", tmp_path, rank=32, rope_dims=16, strategy="high", merge=False,
                              num_key_value_heads=2)  # fmt: skip
    cases = [
        (biased, "m.gguf", [], "biases"),
        (qwen3, "m.gguf", [], "qk_norm"),
        (source, "m.gguf", [], "model_type mla"),
        (grouped, "m.gguf", [], "not exportable exactly"),
        (native, "m.safetensors", [], "must end in .gguf"),
        (native, "m.gguf", ["--gguf-type", "q4_0"], "--gguf-type must be one of"),
        (native, "m.gguf", ["--pad-latent", "vllm"], "a GGUF takes --pad-latent none or llamacpp"),
        (native, "m.gguf", ["--drop-biases"], "--drop-biases apply to --format deepseek"),
    ]
    for folder, name, extra, needle in cases:
        result = CliRunner().invoke(app, ["export", str(folder), "--format", "gguf", "-o", str(out / name), *extra])
        assert_user_error(result.exit_code, result.output, needle)
        assert leftovers(out) == [], (needle, leftovers(out))
    # an existing file is kept; --overwrite replaces only a GGUF this tool wrote
    (out / "mine.gguf").write_bytes(b"a user's file")
    for extra, needle in (([], "already exists"), (["--overwrite"], "not a GGUF mla-convert wrote")):
        result = CliRunner().invoke(app, ["export", str(native), "--format", "gguf", "-o", str(out / "mine.gguf"), *extra])
        assert_user_error(result.exit_code, result.output, needle)
        assert (out / "mine.gguf").read_bytes() == b"a user's file"
    result = CliRunner().invoke(app, ["export", str(native), "--format", "gguf", "-o", str(out / "ok.gguf"), "-q"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["export", str(native), "--format", "gguf", "-o", str(out / "ok.gguf"),
                                      "--overwrite", "--gguf-type", "f16", "-q"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert fields(out / "ok.gguf")[0]["general.file_type"] == 1  # MOSTLY_F16: replaced
    assert leftovers(out) == ["mine.gguf", "ok.gguf"]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    import gguf

    _, native = convert_tiny("llama-gqa", tmp_path)

    def fail(self):
        raise OSError("disk full")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", fail)
    with pytest.raises(OSError, match="disk full"):
        export_gguf(native, tmp_path / "out" / "m.gguf", "f32")
    assert leftovers(tmp_path / "out") == []


def test_unknown_type_refused(tmp_path):
    _, native = convert_tiny("llama-gqa", tmp_path)
    with pytest.raises(UserError, match="--gguf-type"):
        export_gguf(native, tmp_path / "m.gguf", "q4_k")
    assert not (tmp_path / "m.gguf").exists()


# ------------------------------------------------------------------------------------------------ in llama.cpp


@needs_llamacpp
@pytest.mark.parametrize("kind,options", [
    ("llama-gqa", {}),  # q_a = a I (input mode)
    ("llama-mha", {"rope_dims": 4}),  # query narrower than the model: q_a = a W_q, q_b = I (output mode)
    ("mistral", {"num_hidden_layers": 26, "hidden_size": 32, "intermediate_size": 32}),  # lite count: attn_q
    ("llama-gqa", {"pad_latent": "llamacpp"}),  # latent 24 + rope 8 zero-padded to 56 + 8: a row of 64 values
])  # fmt: skip
def test_llamacpp_runs_the_export_exactly(kind, options, tmp_path):
    """f32 GGUF in llama.cpp vs the native checkpoint in transformers, from the same token ids: per-token log-probs
    and greedy tokens (llama.cpp's own cached decode)."""
    options = dict(options)
    rope_dims, pad = options.pop("rope_dims", 8), options.pop("pad_latent", "none")
    _, native = convert_tiny(kind, tmp_path, rope_dims=rope_dims, **options)
    record = export_gguf(native, tmp_path / "m.gguf", "f32", pad_latent=pad)
    assert (record["kv_lora_rank"] + record["qk_rope_head_dim"]) % 64 == 0 if pad == "llamacpp" else (
        record["kv_lora_rank"] == 24)
    gen = torch.Generator().manual_seed(4)
    windows = torch.randint(3, VOCAB, (2, 64), generator=gen).tolist()
    prompts = torch.randint(3, VOCAB, (3, 8), generator=gen).tolist()
    ref = native_scores(native, windows, prompts, 8)
    got = run_llamacpp(tmp_path / "m.gguf", windows, prompts, new_tokens=8, n_ctx=256, cache_type="f32")
    assert logprob_difference(got, ref) < 1e-4
    assert got["greedy"] == ref["greedy"]
    assert got["kv_cache"]["k_type"] == "f32"
    # llama.cpp's default f16 cache rounds the cached latent: close, not exact
    got = run_llamacpp(tmp_path / "m.gguf", windows, prompts, new_tokens=8, n_ctx=256)
    assert logprob_difference(got, ref) < 2e-2
    kv = got["kv_cache"]
    assert kv is not None and kv["layers"] == options.get("num_hidden_layers", 2)
    # llama.cpp caches the latent and the rope key only, f16 (2 bytes): exactly what the export record states
    assert kv["k_type"] == "f16" and abs(kv["bytes_per_token"] - 2 * record["kv_cache_elements_per_token"]) <= kv[
        "bytes_per_token_resolution"]


@needs_llamacpp
def test_low_precision_types_run_close(tmp_path):
    _, native = convert_tiny("llama-gqa", tmp_path)
    windows = torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(5)).tolist()
    ref = native_scores(native, windows, [], 0)["logprobs"][0]
    for kind, tolerance in (("f16", 0.05), ("bf16", 0.2), ("q8_0", 0.2)):
        export_gguf(native, tmp_path / f"{kind}.gguf", kind)
        got = run_llamacpp(tmp_path / f"{kind}.gguf", windows, n_ctx=256)["logprobs"][0]
        mean = sum(abs(a - b) for a, b in zip(got, ref)) / len(ref)
        assert mean < tolerance, (kind, mean)


def mean_nll(result: dict) -> float:
    flat = [x for w in result["logprobs"] for x in w]
    return -sum(flat) / len(flat)


@needs_llamacpp
def test_quantized_cache_types_in_llamacpp_match_the_simulation(tmp_path):
    """llama.cpp's q8_0 / q4_0 / iq4_nl caches (flash attention) and its bfloat16 cache on a GGUF whose latent and rope
    key are whole blocks of 32 read the cached row [latent, rope key] as `latent_cache_type` simulates in
    transformers: the perplexity of each within 1% of the simulation, and the simulation explains most of what the
    cache type changes. llama.cpp logs attn_rot_k = 1 for this row of 64 values, yet its MLA path stores the row
    unrotated: LLAMA_ATTN_ROT_DISABLE=1 gives the same scores bit for bit. The same for the folder re-based for
    quantized caches (`rebase`)."""
    from tiny import tiny_text

    from mla_convert.rebase import rebase_checkpoint

    _, native = convert_tiny("llama-gqa", tmp_path, rank=16, rope_dims=32, head_dim=64, hidden_size=128)
    (tmp_path / "calib.txt").write_text(tiny_text(seed=3) * 4)
    rebased = tmp_path / "rebased"  # a latent re-based for quantized caches exports and serves alike
    rebase_checkpoint(native, rebased, calib_data=str(tmp_path / "calib.txt"), calib_samples=2, calib_seq_len=64)
    for folder in (native, rebased):
        check_quantized_cache_parity(folder, tmp_path / f"{folder.name}.gguf")


def check_quantized_cache_parity(native: Path, gguf: Path) -> None:
    from transformers import AutoModelForCausalLM

    record = export_gguf(native, gguf, "f32", pad_latent="llamacpp")
    assert (record["kv_lora_rank"], record["qk_rope_head_dim"]) == (32, 32)  # latent padded to a whole block
    windows = torch.randint(3, VOCAB, (4, 128), generator=torch.Generator().manual_seed(4)).tolist()
    model = AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32).eval()

    def simulated(kind):
        model.config.latent_cache_type = kind
        with torch.no_grad():
            ids = torch.tensor(windows)
            logp = torch.log_softmax(model(ids).logits[:, :-1].double(), -1)
            return {"logprobs": logp.gather(-1, ids[:, 1:, None])[..., 0].tolist()}

    exact = mean_nll(simulated(None))
    for kind in ("q8_0", "q4_0", "iq4_nl", "bf16"):
        got = run_llamacpp(gguf, windows, n_ctx=256, cache_type=kind)
        flash = kind != "bf16"  # a float cache keeps llama-cpp-python's default (off)
        assert got["kv_cache"]["k_type"] == kind and bool(re.search(r"flash_attn += enabled", got["log"])) == flash
        engine, sim = mean_nll(got), mean_nll(simulated(kind))
        assert abs(engine - sim) < 0.01, (kind, engine, sim)  # perplexity within 1%
        if kind == "q4_0":
            assert abs(engine - sim) < 0.5 * abs(engine - exact), (engine, sim, exact)
            unrotated = run_llamacpp(gguf, windows, n_ctx=256, cache_type=kind,
                                     env={"LLAMA_ATTN_ROT_DISABLE": "1"})
            assert mean_nll(unrotated) == engine


@needs_llamacpp
def test_quantized_cache_refused_for_rows_not_in_blocks(tmp_path):
    """A GGUF whose latent is not whole blocks of 32: `eval --engine llamacpp --cache-type q4_0` refuses in one line
    naming the re-export; the export's own report says which cache types the file takes."""
    from typer.testing import CliRunner
    from tiny import tiny_text

    from mla_convert.cli import app

    _, native = convert_tiny("llama-gqa", tmp_path)  # latent 24 + rope 8
    result = CliRunner().invoke(app, ["export", str(native), "--format", "gguf", "-o", str(tmp_path / "m.gguf")])
    assert result.exit_code == 0, result.output
    assert "f16 (default), f32, bf16 only" in result.output and "--rope-dims 32" in result.output
    assert f"serve it: llama-server -m {tmp_path / 'm.gguf'} -fa on (exact" in result.output
    assert "--cache-type-k q8_0" not in result.output  # the row is not whole blocks: no quantized cache offered
    from mla_convert.serving.llamacpp import llamacpp_serve_line
    whole_blocks = llamacpp_serve_line("m.gguf", 64, 32)
    assert "-fa on (exact, the f16 cache); add --cache-type-k q8_0 --cache-type-v q8_0" in whole_blocks
    planned = llamacpp_serve_line("m.gguf", 128, 32, "iq4_nl", 30 * 160)  # --kv-bytes 0.125's plan on SmolLM2
    assert "-fa on --cache-type-k iq4_nl --cache-type-v iq4_nl (the cache type this conversion was planned for: " \
        "2,700 bytes per token)" in planned
    text = tmp_path / "eval.txt"
    text.write_text(tiny_text(seed=9))
    result = CliRunner().invoke(app, ["eval", str(tmp_path / "m.gguf"), "--data", str(text), "--seq-len", "64",
                                      "--windows", "1", "--engine", "llamacpp", "--cache-type", "q4_0"])
    assert_user_error(result.exit_code, result.output, "--rope-dims 32", "24 + 8")


@needs_llamacpp
def test_eval_engine_llamacpp(tmp_path):
    """`eval --engine llamacpp` scores the GGUF on the windows and token ids `eval` (transformers) scores."""
    import json

    from typer.testing import CliRunner
    from tiny import tiny_text

    from mla_convert.cli import app

    _, native = convert_tiny("llama-gqa", tmp_path)
    export_gguf(native, tmp_path / "m.gguf", "f32")
    text = tmp_path / "eval.txt"
    text.write_text(tiny_text(seed=9))
    runs = {}
    for engine, model in (("transformers", native), ("llamacpp", tmp_path / "m.gguf")):
        result = CliRunner().invoke(app, ["eval", str(model), "--data", str(text), "--seq-len", "128", "--windows",
                                          "3", "--engine", engine, "--json", str(tmp_path / f"{engine}.json"), "-q"])
        assert result.exit_code == 0, result.output
        runs[engine] = json.loads((tmp_path / f"{engine}.json").read_text())
    a, b = runs["transformers"], runs["llamacpp"]
    assert a["tokens"] == b["tokens"] and a["windows"] == b["windows"] == 3
    assert math.isclose(a["perplexity"], b["perplexity"], rel_tol=1e-3), (a["perplexity"], b["perplexity"])
    assert "as llama.cpp allocates it" in result.output
    result = CliRunner().invoke(app, ["eval", str(native), "--data", str(text), "--engine", "llamacpp"])
    assert_user_error(result.exit_code, result.output, "needs a .gguf file")


def test_convert_format_gguf(tmp_path, calib_text):
    """`--format gguf` at conversion: OUT.gguf plus the native checkpoint beside it; refusals before any work."""
    from typer.testing import CliRunner
    from tiny import tiny_source

    from mla_convert.cli import app

    src = tiny_source("llama-gqa", tmp_path / "src")
    common = ["--rank", "24", "--rope-dims", "8", "--calib-data", str(calib_text), "--calib-samples", "2",
              "--calib-seq-len", "16", "--refine-steps", "0", "--refine-model-steps", "0", "--force", "-q"]
    result = CliRunner().invoke(app, ["llama", str(src), *common, "--format", "gguf", "-o", str(tmp_path / "m.gguf")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "m.gguf").is_file() and (tmp_path / "m-native" / "config.json").is_file()
    assert fields(tmp_path / "m.gguf")[0]["general.architecture"] == "deepseek2"
    result = CliRunner().invoke(app, ["llama", str(src), *common, "--format", "gguf", "-o", str(tmp_path / "m")])
    assert_user_error(result.exit_code, result.output, "must end in .gguf")
    result = CliRunner().invoke(app, ["llama", str(src), *common, "--format", "gguf", "-o", str(tmp_path / "m.gguf")])
    assert_user_error(result.exit_code, result.output, "already exists")
    qwen = tiny_source("qwen2", tmp_path / "qwen")
    result = CliRunner().invoke(app, ["qwen", str(qwen), *common, "--format", "gguf", "-o", str(tmp_path / "q.gguf")])
    assert_user_error(result.exit_code, result.output, "biases")
    assert not (tmp_path / "q.gguf").exists() and not (tmp_path / "q-native").exists()


@needs_llamacpp
def test_benchmark_decode_and_profile_workers(tmp_path):
    """benchmarks/llamacpp/decode_worker.py times every model at every context it reaches, in rounds whose order
    reverses; benchmarks/llamacpp/profile_worker.py gives CPU time per step and per graph node, with and without flash
    attention."""
    import json
    import subprocess

    _, native = convert_tiny("llama-gqa", tmp_path)
    export_gguf(native, tmp_path / "m.gguf", "f32")
    model, workers = str(tmp_path / "m.gguf"), Path(__file__).parents[1] / "benchmarks" / "llamacpp"
    ids = list(range(3, 40))

    def worker(name, request):
        (tmp_path / "req.json").write_text(json.dumps(request))
        proc = subprocess.run([str(llamacpp_python()), str(workers / name), str(tmp_path / "req.json"),
                               str(tmp_path / "res.json")], capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads((tmp_path / "res.json").read_text()), proc.stderr

    out, log = worker("decode_worker.py", {"models": {"a": model, "b": model}, "n_ctx": 128, "threads": 1,
                                             "contexts": [16, 40], "tokens": 2, "rounds": 2, "ids": ids,
                                             "max_context": {"b": 16}})  # fmt: skip
    assert [(s["context"], s["model"], s["round"]) for s in out["steps"]] == [
        (16, "a", 0), (16, "b", 0), (16, "b", 1), (16, "a", 1), (40, "a", 0), (40, "a", 1)]
    assert all(s["tokens_per_s"] > 0 and 0 < s["cpu_seconds"] and len(s) == 9 for s in out["steps"])
    # a grows from 16 + 2 x 2 decoded tokens to 40: 20 more
    assert [(f["context"], f["model"], f["tokens"]) for f in out["fills"]] == [(16, "a", 16), (16, "b", 16), (40, "a", 20)]
    assert log.count("llama_kv_cache: size") == 2
    for flash, attention in ((True, "FLASH_ATTN_EXT"), (False, "SOFT_MAX")):
        out, _ = worker("profile_worker.py", {"models": {"m": model}, "n_ctx": 128, "threads": 1, "contexts": [16, 32],
                                                "tokens": 2, "ids": ids, "flash_attn": flash})  # fmt: skip
        for context in ("16", "32"):
            r = out["m"][context]
            ops = {n["op"] for n in r["nodes"]}
            assert r["cpu_step_seconds"] > 0 and "MUL_MAT" in ops and attention in ops, (flash, ops)
            assert sum(n["count_per_step"] for n in r["nodes"] if n["op"] == "MUL_MAT") >= 2 * 5  # 2 layers
