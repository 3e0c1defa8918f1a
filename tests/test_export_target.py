"""`convert --target deepseek` (exportable options chosen or refused up front), `convert --format deepseek` (native
checkpoint plus its verified DeepSeek-V3 export) and the serving-layout warnings."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_user_error
from typer.testing import CliRunner

from mla_convert.cli import app
from mla_convert.convert import ConvertOptions, deepseek_convert_options, prepare
from mla_convert.errors import UserError
from mla_convert.export import check_exportable, serving_notes

torch.set_num_threads(2)


def run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.output


@pytest.fixture
def calib(calib_text):
    return ["--calib-data", calib_text, "--calib-samples", 2, "--calib-seq-len", 16]


def llama_config(**overrides):
    from transformers import LlamaConfig

    params = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})  # fmt: skip
    params.update(overrides)
    return LlamaConfig(**params)


# ---------------------------------------------------------------------------------------------------- resolver


def test_target_picks_the_fastest_pairs():
    options, notes = deepseek_convert_options(llama_config(), ConvertOptions(rank=8))
    assert (options.rope_strategy, options.rope_dims, options.rope_merge) == ("high", 8, True)
    assert "[0, 1, 2, 3]" in notes[0] and notes[0].endswith("rope_theta 100")  # 10000^(8/16)
    options, notes = deepseek_convert_options(llama_config(), ConvertOptions(rank=8, rope_dims=12), {"rope_dims"})
    assert options.rope_strategy == "high" and "[0, 1, 2, 3, 4, 5]" in notes[0]
    # uniform on request: every second pair, the source's base
    options, notes = deepseek_convert_options(llama_config(), ConvertOptions(rank=8, rope_strategy="uniform"),
                                              {"rope_strategy"})  # fmt: skip
    assert options.rope_strategy == "uniform" and "[0, 2, 4, 6]" in notes[0] and notes[0].endswith("rope_theta 10000")
    # with a budget the rope key takes half of it as a power of two, up to the whole head and 64 (the native default:
    # a third, at most 3/4 of the head): 25% of 2 kv heads x 16 x 2 = 16 values -> 8 (native 6); 40% -> 12.8 -> 8
    # (native 8); 50% -> 16 (native 10)
    for budget, d_r in ((0.25, 8), (0.4, 8), (0.5, 16)):
        options, _ = deepseek_convert_options(llama_config(), ConvertOptions(kv_budget=budget))
        assert (options.rope_strategy, options.rope_dims) == ("high", d_r)
    # SmolLM2-135M's shape (3 kv heads of 64, 384 values a token): 25% -> 48 -> 32, 50% -> 96 -> 64
    smol = llama_config(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    for budget, d_r in ((0.25, 32), (0.5, 64)):
        assert deepseek_convert_options(smol, ConvertOptions(kv_budget=budget))[0].rope_dims == d_r
    # llama3 scaling bends the slow frequencies that uniform reaches: high keeps the unbent fast ones
    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    config = llama_config(hidden_size=256, head_dim=64, rope_parameters=llama3)
    options, _ = deepseek_convert_options(config, ConvertOptions(rank=8, rope_dims=16), {"rope_dims"})
    assert options.rope_strategy == "high"
    # the default width (32) halves to fit in the 15 unbent pairs (wavelength under 8192 / 4 tokens), and says so
    options, notes = deepseek_convert_options(config, ConvertOptions(rank=8))
    assert (options.rope_strategy, options.rope_dims) == ("high", 16)
    assert "not the default 32" in notes[1] and "bends the slower pairs" in notes[1]
    with pytest.raises(UserError, match="--target native"):  # 32 dims reach into the bent pairs either way
        deepseek_convert_options(config, ConvertOptions(rank=8, rope_dims=32), {"rope_dims"})


@pytest.mark.parametrize(
    "config,options,explicit,needle",
    [
        ({}, dict(rope_strategy="2-norm"), {"rope_strategy"}, "--rope-strategy uniform or high"),
        ({}, dict(rope_strategy="low"), {"rope_strategy"}, "--rope-strategy uniform or high"),
        ({}, dict(rope_strategy="uniform", rope_dims=12), {"rope_strategy", "rope_dims"}, "--rope-strategy high"),
        ({}, dict(rope_dims=32), {"rope_dims"}, "--rope-dims 16 or less"),
        ({}, dict(rope_dims=0), {"rope_dims"}, "--rope-dims"),
        ({}, dict(rope_merge=False), set(), "drop --no-rope-merge"),
        (dict(mlp_bias=True), {}, set(), "--target native"),
    ],
)
def test_target_refuses_explicit_choices(config, options, explicit, needle):
    with pytest.raises(UserError, match=needle):
        deepseek_convert_options(llama_config(**config), ConvertOptions(rank=8, **options), explicit)


def test_target_allows_unmerged_single_kv_head():
    options, _ = deepseek_convert_options(llama_config(num_key_value_heads=1), ConvertOptions(rank=8, rope_merge=False))
    assert options.rope_strategy == "high" and not options.rope_merge


def test_serving_notes():
    """Layouts vLLM's MLA backends refuse are named with what vLLM does instead and the exact fix; FlashMLA's is 512+64."""
    notes = serving_notes(160, 32, 192, heads=9, nope=64)
    assert any("accept only (320, 576)" in n and "VLLM_MLA_DISABLE=1" in n and "1728 values per token" in n
               and "--pad-latent vllm" in n for n in notes)  # fmt: skip
    assert any("FlashMLA needs kv_lora_rank 512 + qk_rope_head_dim 64" in n for n in notes)
    assert not any("vLLM's MLA" in n for n in serving_notes(256, 64, 320, heads=9, nope=64))
    assert serving_notes(512, 64, 576, heads=9, nope=64) == []


# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_target_dry_run_resolves_and_warns(sources, tmp_path, calib):
    out = tmp_path / "out"
    code, output = run("llama", sources["llama-gqa"], "--rank", 16, "--target", "deepseek", "--format", "deepseek",
                       "-o", out, "--dry-run", *calib)  # fmt: skip
    assert code == 0, output
    assert "--target deepseek: --rope-strategy high --rope-dims 8 --rope-merge keeps frequency pairs [0, 1, 2, 3]" in output
    assert "warning: kv_lora_rank + qk_rope_head_dim = 24" in output and "--pad-latent vllm" in output
    assert f"native MLA to {out}-native, DeepSeek-V3 export to {out}" in output
    # where the export serves, not the plugin route of a native checkpoint
    assert ("serving (DeepSeek-V3 export, no mla-convert needed): transformers' DeepseekV3ForCausalLM with the 16+8 "
            "row as written; llama.cpp from --format gguf; vLLM's DeepseekV3ForCausalLM after `mla-convert export "
            "--pad-latent vllm` on a GPU (256+64 row), `--pad-latent flashmla` on a CPU (512+64") in output, output
    assert "serving in vLLM (plugin)" not in output
    assert not out.exists() and not (tmp_path / "out-native").exists()


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--target", "deepseek", "--rope-strategy", "2-norm"], "--rope-strategy uniform or high"),
        (["--target", "deepseek", "--rope-dims", 6, "--rope-strategy", "uniform"], "--rope-strategy high"),
        (["--target", "deepseek", "--no-rope-merge", "--rope-dims", 8], "drop --no-rope-merge"),
        (["--format", "deepseek", "--target", "native"], "drop --target native"),
        (["--format", "deepseek", "--dtype", "float16"], "--dtype bfloat16"),
        (["--format", "onnx"], "--format must be"),
        (["--format", "gguf"], "-o must end in .gguf"),
        (["--target", "vllm"], "--target must be native or deepseek"),
    ],
)
def test_cli_target_refusals(sources, tmp_path, calib, args, needle):
    out = tmp_path / "o"
    assert_user_error(*run("llama", sources["llama-gqa"], "--rank", 16, *args, "-o", out, *calib), needle)
    assert not out.exists() and not (tmp_path / "o-native").exists()


def test_cli_format_deepseek_refuses_existing_native_folder(sources, tmp_path, calib):
    (tmp_path / "o-native").mkdir()
    (tmp_path / "o-native" / "keep.txt").write_text("mine")
    code, output = run("llama", sources["llama-gqa"], "--rank", 16, "--format", "deepseek", "-o", tmp_path / "o", *calib)
    assert_user_error(code, output, "o-native already exists", "--overwrite")


def test_cli_target_deepseek_native_output_is_exportable(sources, tmp_path, calib):
    out = tmp_path / "o"
    code, output = run("llama", sources["llama-mha"], "--kv-budget", 0.5, "--target", "deepseek", "-o", out, *calib)
    assert code == 0, output
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mla" and config["rope_pairs"] == [list(range(8))] * 2  # a third of 50%: all 8 pairs
    assert check_exportable(out) == [] and "will not export" not in output


def test_cli_format_deepseek_writes_verified_export(sources, tmp_path, calib):
    """GQA straight from convert to a stock DeepSeek-V3 folder, verified in a clean subprocess."""
    out = tmp_path / "ds"
    code, output = run("llama", sources["llama-gqa"], "--kv-budget", 0.5, "--format", "deepseek", "-o", out, *calib)
    assert code == 0, output
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v3"
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    assert json.loads((tmp_path / "ds-native" / "config.json").read_text())["model_type"] == "mla"
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["kind"] == "export" and prov["parent"]["kind"] == "convert" and prov["export"]["rope_exact"]
    m = prov["measurements"]
    assert m["export_max_rel_logit_error"] < 1e-3 and m["export_greedy_tokens_match"], m
    assert "greedy tokens match" in output and f"wrote {out}: DeepSeek-V3" in output


def test_cli_format_deepseek_refuses_biases_up_front(sources, tmp_path, calib):
    """Qwen2's biases would be dropped silently by vLLM's and SGLang's DeepSeek classes: refused before any work."""
    out = tmp_path / "ds"
    code, output = run("qwen", sources["qwen2"], "--kv-budget", 0.5, "--format", "deepseek", "-o", out, *calib)
    assert_user_error(code, output, "biases", "vLLM plugin")
    assert not out.exists() and not (tmp_path / "ds-native").exists()


def test_cli_export_prints_serving_warning(tmp_path):
    """`mla-convert export` tells the user when vLLM's MLA kernels will refuse the layout, and --pad-latent fixes it."""
    from test_export import native_model

    native = native_model("llama-gqa", tmp_path / "native")
    code, output = run("export", native, "-o", tmp_path / "ds", "--dtype", "float32", "--no-verify")
    assert code == 0, output
    assert "kv_lora_rank + qk_rope_head_dim = 32: vLLM's MLA backends accept only (320, 576)" in output
    assert "VLLM_MLA_DISABLE=1" in output and "--pad-latent vllm" in output
    code, output = run("export", native, "-o", tmp_path / "ds2", "--no-verify", "--pad-latent", "vllm")
    assert code == 0, output
    assert "vLLM's MLA backends" not in output and "FlashMLA needs kv_lora_rank 512" in output


def test_prepare_resolves_the_target_once(sources):
    """The library's first step resolves --target deepseek into the options and the plan it returns (nothing
    written), and refuses what the --format export cannot hold before any work."""
    from mla_convert.sources import open_source

    native = prepare(open_source(str(sources["llama-gqa"])), ConvertOptions(kv_budget=0.25))
    assert native.target == "native" and native.notes == [] and native.options.rope_strategy != "high"
    prepared = prepare(open_source(str(sources["llama-gqa"])), ConvertOptions(kv_budget=0.25), target="deepseek",
                       format="deepseek")
    assert prepared.options.rope_strategy == "high" and prepared.options.rank_allocation == "uniform"
    assert prepared.plan.rope_dims == prepared.options.rope_dims
    assert prepared.notes[0].startswith("--target deepseek: --rope-strategy high")
    with pytest.raises(UserError, match="llama.cpp's deepseek2 attention has no place for"):
        prepare(open_source(str(sources["qwen2"])), ConvertOptions(kv_budget=0.25), target="deepseek", format="gguf")
    with pytest.raises(UserError, match="target must be native or deepseek"):
        prepare(open_source(str(sources["llama-gqa"])), ConvertOptions(kv_budget=0.25), target="deepseek-v3")
