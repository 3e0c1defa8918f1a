"""Bad input: one line that names the fix, exit status 2, no traceback, and no output folder that looks complete."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import assert_user_error
from typer.testing import CliRunner

from mla_convert.cli import app
from mla_convert.modeling.configuration_mla import layer_ranks

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture
def calib(calib_text):
    return ["--calib-data", calib_text, "--calib-samples", 2, "--calib-seq-len", 16]


def test_dry_run_prints_plan_and_writes_nothing(sources, tmp_path, calib):
    out = tmp_path / "out"
    code, output = run("llama", sources["llama-gqa"], "--rank", 16, "--rope-dims", 8, "-o", out, "--dry-run", *calib)
    assert code == 0, output
    assert "KV cache per token per layer: 64 -> 24 elements" in output
    assert "ratio 0.375" in output and "kv_a_proj [24, 64]" in output
    assert "calibration: 2 windows x 16 tokens" in output
    # the bytes in the engines' cache types (a 24-value row padded to a whole block of 32 when quantized) against the
    # source's own 64-value rows quantized instead, and the note that the source's q4_0 is already that small
    assert ("this conversion f16 96 (0.375), q8_0 68 (0.266), q4_0 36 (0.141); the source's own cache quantized, no "
            "conversion: q8_0 136 (0.531), q4_0 72 (0.281)") in output, output
    assert "note: the source's own q4_0 cache is this small without converting" in output
    # where it serves: vLLM's cache row and kernels on a GPU (the heads padded for its MLA prefill) and on a CPU
    assert ("serving in vLLM (plugin): on a Hopper GPU a 256+64 cache row, decode by FlashMLA (unproven on this "
            "row) or Triton MLA, prefill by FlashAttention with nope/value heads 8/16 padded to 64/128; on a CPU "
            "512+64") in output, output
    assert not out.exists()


def test_dry_run_prices_each_phase(sources, tmp_path, monkeypatch):
    """The plan's time line: the total on this CPU and its phases, the self text only while it is not cached."""
    monkeypatch.setenv("MLA_CONVERT_CACHE", str(tmp_path / "cache"))

    def time_line(out, *extra):
        code, output = run("llama", sources["llama-gqa"], "--rank", 16, "--rope-dims", 8, "-o", tmp_path / out,
                           "--calib-samples", 2, "--calib-seq-len", 16, *extra)
        assert code == 0, output
        return next((t for t in output.splitlines() if t.startswith("time on this CPU (")), output)

    steps = ("--refine-steps", 5, "--refine-model-steps", 2)
    line = time_line("a", *steps, "--dry-run")
    assert all(phase in line for phase in ("self text", "calibration", "refinement", "model stage")), line
    time_line("a", *steps)  # converts: samples the text and caches it
    line = time_line("b", *steps, "--dry-run")
    assert "self text" not in line and "calibration" in line and "refinement" in line, line
    line = time_line("b", "--calib-data", "none", "--refine-steps", 0, "--refine-model-steps", 0, "--dry-run")
    assert line == "time on this CPU (MLA_CONVERT_CPU_SPEED=1): about 0 min", line  # tests/conftest.py sets it


@pytest.mark.parametrize("budget,windows", [(0.25, 16), (0.5, 32), (0.375, 32)])
def test_default_calibration_windows_follow_the_cache_kept(sources, tmp_path, calib_text, budget, windows):
    """Without --calib-samples a conversion calibrates on 16 windows below 37.5% of the source's cache and on 32
    from there up (convert.default_calib_samples); the plan says how many."""
    code, output = run("llama", sources["llama-gqa"], "--kv-budget", budget, "-o", tmp_path / "out", "--dry-run",
                       "--calib-data", calib_text, "--calib-seq-len", 16)
    assert code == 0, output
    assert f"calibration: {windows} windows x 16 tokens" in output
    code, output = run("llama", sources["llama-gqa"], "--kv-budget", budget, "-o", tmp_path / "out", "--dry-run",
                       "--calib-data", "none")
    assert code == 0 and "calibration: none" in output, output


def test_convert_command_and_family_detection(sources, tmp_path, calib):
    code, output = run("convert", sources["qwen2"], "--kv-budget", 0.5, "-o", tmp_path / "q", *calib)
    assert code == 0, output
    assert json.loads((tmp_path / "q" / "config.json").read_text())["model_type"] == "mla"


def test_wrong_family_command(sources, tmp_path, calib):
    assert_user_error(*run("llama", sources["qwen2"], "--rank", 8, "-o", tmp_path / "o", *calib), "mla-convert qwen")


@pytest.mark.parametrize(
    "model_type,needle", [("qwen3_moe", "Qwen3-MoE"), ("gpt2", "not supported"), ("deepseek_v3", "already an MLA")]
)
def test_unknown_or_refused_family(sources, tmp_path, calib, model_type, needle):
    src = tmp_path / "src"
    shutil.copytree(sources["llama-gqa"], src)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = model_type
    (src / "config.json").write_text(json.dumps(config))
    code, output = run("convert", src, "--rank", 8, "-o", tmp_path / "o", *calib)
    assert_user_error(code, output, needle)
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--rank", 0], "positive"),
        (["--rank", -3], "positive"),
        (["--rank", 100], "exceeds the maximum 64"),
        (["--rank", 8, "--rope-dims", 7], "even"),
        (["--rank", 8, "--rope-dims", 64], "at most 32"),
        (["--rank", 8, "--rope-dims", 6, "--no-rope-merge"], "multiple of 4"),
        (["--rank", 60, "--rope-dims", 16], "--force"),
        (["--rank", 8, "--rope-strategy", "fast"], "--rope-strategy"),
        (["--rank", 8, "--method", "magic"], "--method"),
        (["--rank", 8, "--objective", "loss"], "--objective"),
        (["--rank", 8, "--value-inputs", "mean"], "--value-inputs"),
        (["--rank", 8, "--key-inputs", "mean"], "--key-inputs"),
        (["--rank", 8, "--rank-allocation", "greedy"], "--rank-allocation"),
        (["--rank", 8, "--latent-rounds", -1], "--latent-rounds"),
        (["--rank", 8, "--refine-mlp-lr-scale", -1], "--refine-mlp-lr-scale"),
        (["--rank", 8, "--calib-temperature", 0], "--calib-temperature"),
        (["--rank", 8, "--calib-sample-tokens", 0], "--calib-sample-tokens"),
        (["--rank", 8, "--latent-rounds", 2, "--value-inputs", "token"], "--value-inputs attended"),
        (["--rank", 8, "--latent-rounds", 2, "--factorization", "split"], "--factorization joint"),
        ([], "--rank"),
    ],
)
def test_bad_options(sources, tmp_path, calib, args, needle):
    out = tmp_path / "o"
    code, output = run("llama", sources["llama-gqa"], *args, "-o", out, *calib)
    assert_user_error(code, output, needle)
    assert not out.exists()
    assert not list(tmp_path.glob(".o.incomplete*"))


def test_missing_and_broken_files(sources, tmp_path, calib):
    assert_user_error(*run("llama", tmp_path / "nope", "--rank", 8, "-o", tmp_path / "o1", *calib), "does not exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert_user_error(*run("llama", empty, "--rank", 8, "-o", tmp_path / "o2", *calib), "config.json")

    missing_shard = tmp_path / "missing"
    shutil.copytree(sources["two-shards"], missing_shard)
    (missing_shard / "model-00002-of-00002.safetensors").unlink()
    assert_user_error(*run("llama", missing_shard, "--rank", 8, "-o", tmp_path / "o3", *calib), "missing")

    truncated = tmp_path / "truncated"
    shutil.copytree(sources["llama-gqa"], truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    code, output = run("llama", truncated, "--rank", 8, "-o", tmp_path / "o4", *calib)
    assert_user_error(code, output, "truncated")
    assert not (tmp_path / "o4").exists()

    pickled = tmp_path / "pickled"
    shutil.copytree(sources["llama-gqa"], pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    assert_user_error(*run("llama", pickled, "--rank", 8, "-o", tmp_path / "o5", *calib), "pickle")


def test_config_missing_keys(sources, tmp_path, calib):
    src = tmp_path / "src"
    shutil.copytree(sources["llama-gqa"], src)
    config = json.loads((src / "config.json").read_text())
    del config["intermediate_size"]
    config["hidden_size"] = None
    (src / "config.json").write_text(json.dumps(config))
    code, output = run("llama", src, "--rank", 8, "-o", tmp_path / "o", *calib)
    assert code == 2 and "Traceback" not in output, output


def test_output_inside_input_and_existing_output(sources, tmp_path, calib):
    src = tmp_path / "src"
    shutil.copytree(sources["llama-gqa"], src)
    assert_user_error(*run("llama", src, "--rank", 8, "-o", src / "mla", *calib), "inside the input")
    assert not (src / "mla").exists()

    out = tmp_path / "existing"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert_user_error(*run("llama", src, "--rank", 8, "-o", out, *calib), "--overwrite")
    assert (out / "notes.txt").read_text() == "mine"
    # --overwrite replaces only a folder mla-convert wrote: a user's own folder stays as it is
    assert_user_error(*run("llama", src, "--rank", 8, "-o", out, "--overwrite", *calib), "not a folder mla-convert wrote")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    ours = tmp_path / "ours"
    assert run("llama", src, "--rank", 8, "-o", ours, *calib)[0] == 0
    (ours / "notes.txt").write_text("a file of the user's in our folder")
    assert_user_error(*run("llama", src, "--rank", 4, "-o", ours, "--overwrite", *calib), "did not write")
    assert (ours / "notes.txt").exists()
    (ours / "notes.txt").unlink()
    code, output = run("llama", src, "--rank", 4, "-o", ours, "--overwrite", *calib)
    assert code == 0, output
    assert layer_ranks(json.loads((ours / "config.json").read_text()))[0] == 4
    assert not list(tmp_path.glob(".ours.*"))  # no staging or replaced folder left beside it


def test_eval_reports_perplexity_and_cache(sources, tmp_path, calib_text, convert_tiny):
    out = convert_tiny(sources["llama-gqa"], rank=16, rope_dims=8)
    code, output = run("eval", out, "--data", calib_text, "--seq-len", 32, "--windows", 2, "-q", "--json", tmp_path / "r.json")
    assert code == 0, output
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["windows"] == 2 and result["perplexity"] > 1
    assert result["kv_cache_bytes_per_token"] == 2 * (16 + 8) * 4
    assert_user_error(*run("eval", tmp_path / "none", "--data", calib_text), "does not exist")
    again = ("eval", out, "--data", calib_text, "--seq-len", 32, "--windows", 1, "-q", "--json", tmp_path / "r.json")
    assert_user_error(*run(*again), "already exists", "--overwrite")  # our own file too: not without --overwrite
    code, output = run(*again, "--overwrite")  # a results file eval wrote: replaced
    assert code == 0, output
    assert json.loads((tmp_path / "r.json").read_text())["windows"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary file left beside it
    legacy = {k: v for k, v in json.loads((tmp_path / "r.json").read_text()).items() if k != "written_by"}
    (tmp_path / "r.json").write_text(json.dumps(legacy))  # written by eval before results were marked: still ours
    code, output = run(*again, "--overwrite")
    assert code == 0, output
