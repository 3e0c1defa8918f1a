"""The DeepSeek-V3 export: facts of the stock format (proven against the installed transformers), the identity-norm
bound, and exported tiny models against the native model in stock DeepseekV3ForCausalLM."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from conftest import needs_smollm2
import torch

from mla_convert.errors import UserError
from mla_convert.export import (
    EXPORT_EPS,
    ExportOptions,
    deepseek_compatible_rope_pairs,
    export,
    fit_deepseek_rope,
    identity_norm_scale,
    relative_error,
)
from mla_convert.modeling import MLAConfig, MLAForCausalLM

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny.py
torch.set_num_threads(2)

VOCAB = 320


def ds_config(**overrides):
    from transformers import DeepseekV3Config

    params = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=8, n_routed_experts=1, n_group=1, topk_group=1, num_experts_per_tok=1, first_k_dense_replace=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    params.update(overrides)
    return DeepseekV3Config(**params)


# ---------------------------------------------------------------------------------------------------- stock facts


def test_stock_latent_norms_ignore_rms_norm_eps():
    """transformers builds kv_a_layernorm and q_a_layernorm with eps 1e-6 whatever rms_norm_eps is."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    attn = DeepseekV3Attention(ds_config(rms_norm_eps=1e-5, q_lora_rank=12), 0)
    assert attn.kv_a_layernorm.variance_epsilon == EXPORT_EPS
    assert attn.q_a_layernorm.variance_epsilon == EXPORT_EPS


def test_stock_format_needs_int_experts_and_equal_kv_heads():
    from transformers import DeepseekV3ForCausalLM

    with pytest.raises(Exception, match="n_routed_experts"):
        ds_config(n_routed_experts=None)
    model = DeepseekV3ForCausalLM(ds_config(num_key_value_heads=2))  # kv_b_proj is per query head regardless
    with pytest.raises(RuntimeError):
        model(torch.zeros(1, 4, dtype=torch.long))
    dense = DeepseekV3ForCausalLM(ds_config(first_k_dense_replace=1))
    assert not any("experts" in name for name, _ in dense.named_parameters())


def test_stock_biases_and_scaling():
    """attention_bias puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj only (never q_proj or kv_b_proj); the
    score scale is (d_n + d_r)^-0.5 with the default rope type and gains yarn's mscale^2 otherwise."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    attn = DeepseekV3Attention(ds_config(attention_bias=True), 0)
    assert attn.q_proj.bias is None and attn.kv_b_proj.bias is None
    assert attn.kv_a_proj_with_mqa.bias is not None and attn.o_proj.bias is not None
    attn = DeepseekV3Attention(ds_config(attention_bias=True, q_lora_rank=12), 0)
    assert attn.q_a_proj.bias is not None and attn.q_b_proj.bias is None
    assert DeepseekV3Attention(ds_config(), 0).scaling == pytest.approx(16**-0.5)
    yarn = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 512}  # fmt: skip
    assert DeepseekV3Attention(ds_config(rope_parameters=yarn), 0).scaling != pytest.approx(16**-0.5)


def test_stock_interleaved_rope_pairs_adjacent_dims():
    """With rope_interleave, dims (2m, 2m+1) form pair m, rotating at base^(-2m/d_r) like rotate_half's (m, m+d/2)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb,
        apply_rotary_pos_emb_interleave,
    )

    cfg = ds_config()
    rotary = DeepseekV3RotaryEmbedding(cfg)
    assert torch.allclose(rotary.inv_freq.double(), 1e4 ** (-torch.arange(0, 8, 2).double() / 8), rtol=1e-6)
    x = torch.randn(1, 1, 5, 8)
    cos, sin = rotary(x, torch.arange(5)[None])
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7])  # rotate_half dims -> interleaved dims
    ref, _ = apply_rotary_pos_emb(x, x, cos, sin)
    inter, _ = apply_rotary_pos_emb_interleave(x[..., perm], x[..., perm], cos, sin)
    assert torch.allclose(inter, ref, atol=1e-6)  # the interleaved rotation returns rotate_half layout


# ---------------------------------------------------------------------------------------------------- math


def test_identity_norm_bound():
    """RMSNorm_eps(a c) * sqrt(eps)/a = c within the tolerance for every c with mean(c^2) <= M."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

    # tolerances well above the float32 rounding of the stock norm (it computes in float32)
    for bound, tol in ((1e2, 1e-4), (1e5, 1e-3), (3.0, 1e-2)):
        a = identity_norm_scale(bound, EXPORT_EPS, tol)
        assert math.log2(a) == int(math.log2(a))
        norm = DeepseekV3RMSNorm(64).double()
        norm.weight.data.fill_(math.sqrt(EXPORT_EPS) / a)
        c = torch.randn(200, 64, dtype=torch.float64)
        c = c / c.pow(2).mean(-1, keepdim=True).sqrt() * math.sqrt(bound) * torch.rand(200, 1, dtype=torch.float64)
        c[0] *= math.sqrt(bound) / c[0].pow(2).mean().sqrt()  # one vector exactly at the bound
        err = ((norm(a * c) - c).abs() / c.abs()).max()
        assert tol / 8 <= err <= tol  # the bound holds and is loose by at most the power-of-two rounding of a
    a = identity_norm_scale(1e4)  # the export's default tolerance: float32 rounding dominates
    norm.weight.data.fill_(math.sqrt(EXPORT_EPS) / a)
    c = torch.randn(200, 64, dtype=torch.float64)
    assert ((norm(a * c) - c).abs() / c.abs()).max() < 1e-6


def test_rope_fit():
    half = 8
    inv = 1e4 ** (-torch.arange(half).double() / half)  # head_dim 16
    fit = fit_deepseek_rope(inv, [[0, 2, 4, 6], [6, 0, 4, 2]])
    assert fit.exact and fit.base == pytest.approx(1e4) and fit.order[1] == [1, 3, 2, 0]
    fit = fit_deepseek_rope(inv, [[0, 1, 2]])
    assert fit.exact and fit.base == pytest.approx(1e4 ** (6 / 16))
    assert not fit_deepseek_rope(inv, [[1, 3, 5]]).exact  # fastest pair missing
    assert not fit_deepseek_rope(inv, [[0, 2, 4], [0, 1, 2]]).exact  # per-layer sets
    assert not fit_deepseek_rope(inv, [[0, 0, 1]]).exact  # repeats (merged components)
    assert not fit_deepseek_rope(inv, [[0, 1, 3]]).exact  # not geometric


def test_deepseek_compatible_rope_pairs():
    assert deepseek_compatible_rope_pairs(64, 16, "high") == list(range(8))
    assert deepseek_compatible_rope_pairs(64, 16, "uniform") == list(range(0, 32, 4))
    assert deepseek_compatible_rope_pairs(64, 24, "uniform") == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22]
    with pytest.raises(UserError, match="high or uniform"):
        deepseek_compatible_rope_pairs(64, 16, "2-norm")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    llama3 = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    inv = LlamaRotaryEmbedding(LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_parameters=llama3)).inv_freq
    assert deepseek_compatible_rope_pairs(128, 32, "high", inv) == list(range(16))
    with pytest.raises(UserError, match="not export exactly"):
        deepseek_compatible_rope_pairs(128, 32, "uniform", inv)  # reaches into llama3's bent low frequencies


# ---------------------------------------------------------------------------------------------------- exports

KINDS = {
    # GQA, per-layer ranks, uniform pairs (stride 2) listed in a different order per layer, tied embeddings
    "llama-gqa": dict(num_key_value_heads=2, kv_lora_rank=[24, 20], qk_rope_head_dim=8,
                      rope_pairs=[[0, 2, 4, 6], [4, 0, 6, 2]], tie_word_embeddings=True),
    # MHA, the fastest pairs, untied
    "llama-mha": dict(num_key_value_heads=4, kv_lora_rank=[24, 24], qk_rope_head_dim=6,
                      rope_pairs=[[0, 1, 2], [2, 1, 0]], tie_word_embeddings=False),
    # Qwen2 shapes: biases on q, kv_a (latent and rope key), kv_b (nope key and value); eps 1e-6, large theta
    "qwen2-biases": dict(num_key_value_heads=2, kv_lora_rank=[20, 20], qk_rope_head_dim=8,
                         rope_pairs=[[0, 2, 4, 6], [0, 2, 4, 6]], attention_bias=True, o_proj_bias=False,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}  # fmt: skip


def native_model(kind: str, folder, seed: int = 0, **overrides):
    params = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    params.update(KINDS[kind])
    params.update(overrides)
    config = MLAConfig(**params)
    torch.manual_seed(seed)
    model = MLAForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15)
    model.save_pretrained(folder)
    return folder


def stock(folder):
    from transformers import DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def native_and_stock_logits(native_folder, export_folder, tokens=48):
    ids = torch.randint(0, VOCAB, (2, tokens), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = MLAForCausalLM.from_pretrained(native_folder, dtype=torch.float32).eval()(ids).logits
        got = stock(export_folder)(ids).logits
    return ref, got


def greedy(model, prompt, n=6):
    with torch.no_grad():
        return model.generate(prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)


@pytest.mark.parametrize("kind", list(KINDS))
def test_export_equals_native(kind, tmp_path):
    """Stock DeepseekV3ForCausalLM on the export equals the native model: logits and greedy tokens (cached decode)."""
    native = native_model(kind, tmp_path / "native")
    biased = kind == "qwen2-biases"
    record = export(native, tmp_path / "ds", ExportOptions(dtype="float32", verify=False, keep_biases=biased))
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["num_key_value_heads"] == cfg["num_attention_heads"]
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] and cfg["rope_interleave"] is True
    assert cfg["rms_norm_eps"] == EXPORT_EPS and cfg["tie_word_embeddings"] is False
    assert cfg["kv_lora_rank"] == max(KINDS[kind]["kv_lora_rank"]) and record["rope_exact"]
    assert (tmp_path / "ds" / "generation_config.json").is_file()
    assert json.loads((tmp_path / "ds" / "provenance.json").read_text())["kind"] == "export"
    assert cfg["attention_bias"] == biased and (cfg["q_lora_rank"] is not None) == biased
    ref, got = native_and_stock_logits(native, tmp_path / "ds")
    assert relative_error(ref, got) < 1e-5
    prompt = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(2))
    assert torch.equal(greedy(MLAForCausalLM.from_pretrained(native).eval(), prompt), greedy(stock(tmp_path / "ds"), prompt))


# ------------------------------------------------------------------------------------- from the converter


def convert_tiny(kind, tmp_path, rank, rope_dims, strategy="uniform", merge=True, **source_overrides):
    from tiny import tiny_source

    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert

    source = tiny_source(kind, tmp_path / "source", **source_overrides)
    options = ConvertOptions(rank=rank, rope_dims=rope_dims, rope_strategy=strategy, rope_merge=merge,
                             method="weight", calib_data=None, force=True)  # fmt: skip
    convert(open_source(str(source)), tmp_path / "native", options, progress=False)
    return source, tmp_path / "native"


@pytest.mark.parametrize("kind", ["llama-gqa", "llama-mha", "qwen2"])
def test_converted_export_verified_in_stock_transformers(kind, tmp_path):
    """Converted with exportable options (uniform pairs merged across kv heads): the built-in check (stock
    transformers in a subprocess that never imports mla_convert) finds the export equal to the native model."""
    _, native = convert_tiny(kind, tmp_path, rank=24, rope_dims=8)
    record = export(native, tmp_path / "ds", ExportOptions(dtype="float32", keep_biases=kind == "qwen2"))
    m = record["measurements"]
    assert m["export_max_rel_logit_error"] < 1e-3 and m["export_greedy_tokens_match"], m
    prov = json.loads((tmp_path / "ds" / "provenance.json").read_text())
    assert prov["measurements"]["export_max_rel_logit_error"] == m["export_max_rel_logit_error"]
    assert prov["parent"]["kind"] == "convert"
    if kind == "qwen2":  # the biases survive in transformers; vLLM/SGLang would run without them
        assert record["attention_bias"] and m["export_max_rel_logit_error_without_biases"] > 1e-2
        assert any("vLLM and SGLang" in w for w in record["warnings"])


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2"])
def test_full_rank_every_pair_equals_source(kind, tmp_path):
    """Full rank, every RoPE pair kept, one kv head (the only grouping whose rope key fits DeepSeek's one pair per
    frequency): the stock export reproduces the source model."""
    from transformers import AutoModelForCausalLM

    source, native = convert_tiny(kind, tmp_path, rank=32, rope_dims=16, strategy="high", merge=False,
                                  num_key_value_heads=1)  # fmt: skip
    export(native, tmp_path / "ds", ExportOptions(dtype="float32", verify=False, keep_biases=kind == "qwen2"))
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()(ids).logits
        got = stock(tmp_path / "ds")(ids).logits
    assert relative_error(ref, got) < 1e-4


def test_grouped_keys_with_every_pair_are_refused(tmp_path):
    """With 2+ kv heads, keeping every pair puts several rope components on one frequency: DeepSeek's rope key has
    one pair per frequency, so the export refuses (and names the options that work)."""
    _, native = convert_tiny("llama-gqa", tmp_path, rank=32, rope_dims=32, strategy="high")
    with pytest.raises(UserError, match="repeats"):
        export(native, tmp_path / "ds", ExportOptions())


def test_export_pad_latent_vllm_is_exact(tmp_path):
    native = native_model("llama-gqa", tmp_path / "native")
    record = export(native, tmp_path / "ds", ExportOptions(dtype="float32", pad_latent="vllm", verify=False))
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (256, 64)
    # nope and value dims padded with zeros to the smallest head layout vLLM's CUDA MLA prefill takes (64 / 128)
    native_cfg = json.loads((native / "config.json").read_text())
    assert native_cfg["qk_nope_head_dim"] < 64 and native_cfg["v_head_dim"] < 128
    assert (cfg["qk_nope_head_dim"], cfg["v_head_dim"]) == (64, 128)
    assert not any("vLLM's MLA backends" in w for w in record["warnings"])
    ref, got = native_and_stock_logits(native, tmp_path / "ds")
    assert relative_error(ref, got) < 1e-5


def test_export_bfloat16_is_close(tmp_path):
    native = native_model("llama-mha", tmp_path / "native")
    export(native, tmp_path / "ds", ExportOptions(dtype="bfloat16", verify=False))
    ref, got = native_and_stock_logits(native, tmp_path / "ds")
    assert relative_error(ref, got) < 3e-2  # bfloat16 weight rounding only


def test_export_refusals(tmp_path):
    native = native_model("llama-gqa", tmp_path / "native", rope_pairs=[[0, 2, 4, 6], [0, 1, 2, 3]])
    with pytest.raises(UserError, match="rope-strategy high or uniform"):
        export(native, tmp_path / "ds", ExportOptions(dtype="float32"))
    with pytest.raises(UserError, match="float16"):
        export(native, tmp_path / "ds", ExportOptions(dtype="float16"))
    with pytest.raises(UserError, match="--allow-approx"):
        export(native, tmp_path / "ds", ExportOptions(drop_biases=True))
    with pytest.raises(UserError, match="drop silently"):  # biases the engines would skip: refused by default
        export(native_model("qwen2-biases", tmp_path / "n3"), tmp_path / "ds", ExportOptions(dtype="float32"))
    with pytest.raises(UserError, match="measured"):
        export(native, tmp_path / "ds", ExportOptions(allow_approx=True, verify=False))
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("pad", ["vllm", "llamacpp"])
def test_export_pads_any_rope_width_exactly(tmp_path, pad):
    """A rope key whose pair count does not divide 32 (here 3 pairs, as 24 pairs of a 48-dim key) pads to vLLM's 64
    dims by going on with the geometric set past the slowest kept pair: rope_theta = base^(64/6), exact."""
    native = native_model("llama-mha", tmp_path / "native")
    record = export(native, tmp_path / "ds", ExportOptions(dtype="float32", pad_latent=pad, verify=False))
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    base = record["rope_theta"] if pad == "llamacpp" else record["rope_theta"] ** (6 / 64)
    assert cfg["qk_rope_head_dim"] == (64 if pad == "vllm" else 6)
    assert cfg["rope_parameters"]["rope_theta"] == pytest.approx(record["rope_theta"])
    assert base == pytest.approx(1e4 ** (6 / 16))  # the kept (fastest) pairs' own base
    ref, got = native_and_stock_logits(native, tmp_path / "ds")
    assert relative_error(ref, got) < 1e-5


def test_export_approximations_are_measured(tmp_path):
    """Per-layer pair sets and dropped biases export only with --allow-approx, and the error is reported."""
    native = native_model("qwen2-biases", tmp_path / "native", rope_pairs=[[0, 2, 4, 6], [0, 1, 2, 3]])
    record = export(native, tmp_path / "ds", ExportOptions(allow_approx=True, drop_biases=True, verify_new_tokens=2))
    assert len(record["approximations"]) == 2
    cfg = json.loads((tmp_path / "ds" / "config.json").read_text())
    assert not cfg["attention_bias"] and cfg["q_lora_rank"] is None
    err = record["measurements"]["export_max_rel_logit_error"]
    ref, got = native_and_stock_logits(native, tmp_path / "ds")
    assert 1e-3 < err and relative_error(ref, got) > 1e-3


def test_cli_export(tmp_path):
    from typer.testing import CliRunner

    from mla_convert.cli import app

    native = native_model("llama-mha", tmp_path / "native")
    result = CliRunner().invoke(app, ["export", str(native), "--format", "deepseek", "-o", str(tmp_path / "ds"),
                                      "--dtype", "float32", "--no-verify", "-q"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert (tmp_path / "ds" / "config.json").is_file()
    result = CliRunner().invoke(app, ["export", str(native), "-o", str(tmp_path / "ds"), "--no-verify"])
    assert result.exit_code == 2 and "already exists" in result.output


@pytest.mark.slow
def test_smollm2_export_verified(tmp_path):
    """The real SmolLM2-135M, converted (weight-only, fast) with DeepSeek-exportable RoPE pairs: the stock export
    matches the native model in the built-in subprocess check."""
    needs_smollm2()
    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert

    options = ConvertOptions(kv_budget=0.5, rope_dims=32, rope_strategy="uniform", rope_merge=True, method="weight",
                             calib_data=None)  # fmt: skip
    convert(open_source(None), tmp_path / "native", options, progress=False)
    record = export(tmp_path / "native", tmp_path / "ds", ExportOptions(dtype="float32", verify_tokens=32))
    assert record["rope_exact"] and record["kv_lora_rank"] == 160 and record["qk_rope_head_dim"] == 32
    m = record["measurements"]
    assert m["export_max_rel_logit_error"] < 1e-3 and m["export_greedy_tokens_match"], m
