"""Qwen3: per-head q/k RMS norms before RoPE. Exact at full rank (full forward, cached decode, padded generation) with a
cache of latent + rope key only; the calibrated key norm is an absorbable approximation that vLLM serves through the
plugin; the DeepSeek-V3 export refuses both."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_user_error
from test_exactness import REL_TOL, both_forms, full_options, rel_err, tokens
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

import mla_convert  # noqa: F401
from mla_convert.checkpoint import open_source
from mla_convert.cli import app
from mla_convert.convert import ConvertOptions, make_plan, max_rank
from mla_convert.errors import UserError
from mla_convert.evaluate import kv_cache_bytes_per_token
from mla_convert.families import family_for
from mla_convert.modeling.compat import cache_kwargs, output_cache


def run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def source(sources):
    model = AutoModelForCausalLM.from_pretrained(sources["qwen3"], dtype=torch.float32).eval()
    config = model.config
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert config.head_dim != config.hidden_size // config.num_attention_heads
    norm = model.model.layers[0].self_attn.k_norm.weight
    assert norm.std() > 0.1  # non-trivial q/k norm weights: a conversion that ignored them would not be exact
    return model


@pytest.fixture(scope="module")
def exact(sources, convert_tiny, source):
    out = convert_tiny(sources["qwen3"], **full_options(source.config, merge=True))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def test_family_detected_from_config(sources):
    config = AutoConfig.from_pretrained(sources["qwen3"])
    family = family_for(config)
    assert family.name == "qwen" and family.has_qk_norm(config)
    assert family.attention_biases(config) == (False, False)  # Qwen3 follows attention_bias, unlike Qwen2
    qwen2 = AutoConfig.from_pretrained(sources["qwen2"])
    assert family_for(qwen2, "qwen") is family and not family.has_qk_norm(qwen2)
    with pytest.raises(UserError, match="mla-convert qwen"):
        family_for(config, "llama")


def test_full_rank_forward_is_exact(source, exact):
    assert exact.config.qk_norm == "exact"
    ids = tokens()
    with torch.no_grad():
        assert rel_err(source(ids).logits, exact(ids).logits) < REL_TOL


def test_full_rank_cached_decode_is_exact(source, exact):
    ids = tokens()
    with torch.no_grad():
        reference = source(ids).logits
        out = exact(ids[:, :5], use_cache=True)
        steps, cache = [out.logits], output_cache(out)
        for t in range(5, ids.shape[1]):
            out = exact(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
            cache = output_cache(out)
            steps.append(out.logits)
    assert rel_err(reference, torch.cat(steps, dim=1)) < REL_TOL


def test_greedy_generation_equal_with_left_padding(source, exact):
    """Batched generation with a left-padded prompt: the cached keys' positions follow the step's (padding included)."""
    ids = tokens(batch=2, length=10)
    mask = torch.ones_like(ids)
    ids[0, :3], mask[0, :3] = 0, 0
    kwargs = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(source.generate(ids, **kwargs), exact.generate(ids, **kwargs))


def test_cache_holds_latent_and_rope_key_only(sources, source, exact):
    config = exact.config
    ids = tokens(batch=3, length=11)
    with torch.no_grad():
        cache = output_cache(exact(ids, use_cache=True))
    d_c, d_r = config.kv_lora_ranks[0], config.qk_rope_head_dim
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == (3, 1, 11, d_c) and tuple(layer.values.shape) == (3, 1, 11, d_r)
    plan = make_plan(open_source(str(sources["qwen3"])), family_for(source.config),
                     ConvertOptions(**full_options(source.config, merge=True), dtype="float32"))  # fmt: skip
    assert kv_cache_bytes_per_token(exact) == plan.kv_bytes_after == sum(d_c + d_r for _ in cache.layers) * 4


@pytest.mark.parametrize(
    "extra",
    [
        dict(rope_merge=False, rope_strategy="2-norm"),
        dict(objective="attention", rank_allocation="energy", calib_propagate="source"),
        dict(calib_propagate="converted", objective="scores"),
    ],
)
def test_every_method_is_exact_at_full_rank(sources, convert_tiny, source, extra):
    out = convert_tiny(sources["qwen3"], **{**full_options(source.config, merge=True), **extra})
    ids = tokens()
    with torch.no_grad():
        assert rel_err(source(ids).logits, AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits) < REL_TOL


@pytest.mark.parametrize("mode", ["exact", "calibrated"])
def test_half_cache_conversion_loads_and_runs(sources, convert_tiny, source, mode):
    out = convert_tiny(sources["qwen3"], kv_budget=0.5, qk_norm=mode)
    model = AutoModelForCausalLM.from_pretrained(out).eval()  # the registered classes, after `import mla_convert`
    assert type(model).__name__ == "MLAForCausalLM" and model.config.qk_norm == mode
    groups, head_dim = source.config.num_key_value_heads, source.config.head_dim
    assert sum(model.config.kv_lora_ranks) / len(model.config.kv_lora_ranks) + model.config.qk_rope_head_dim == (
        groups * head_dim
    )  # half of K and V
    ids = tokens(batch=1, length=8)
    generated = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert generated.shape == (1, 14)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_calibrated_key_norm_is_absorbable_and_bounded(sources, convert_tiny, source, exact):
    """The calibrated mode: absorbed decode equals its expanded form; at full rank its only error is the key's RMS
    replaced by a calibration statistic, finite and bounded (measured on a trained model in
    benchmarks/qwen3/README.md)."""
    out = convert_tiny(sources["qwen3"], **full_options(source.config, merge=True), qk_norm="calibrated")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("k_rope_up" in name or "k_norm" in name for name in model.state_dict())  # plain MLA keys
    ids = tokens()
    with torch.no_grad():
        reference = source(ids).logits
    expanded, absorbed = both_forms(model, ids)
    assert rel_err(expanded, absorbed) < REL_TOL
    error = rel_err(reference, expanded)
    assert 1e-3 < error < 1.0, error  # an approximation (not exact), but finite and within the logits' range


def test_exact_mode_never_takes_the_absorbed_form(exact):
    attention = exact.model.layers[0].self_attn
    exact.config.mla_attention_mode = "absorbed"
    try:
        assert not attention.use_absorbed(1, object())
    finally:
        exact.config.mla_attention_mode = "auto"


def test_deepseek_target_refused_up_front(sources, tmp_path, calib_text):
    for flags in (["--target", "deepseek"], ["--format", "deepseek"], ["--target", "deepseek", "--qk-norm", "calibrated"]):
        code, output = run("qwen", sources["qwen3"], "--kv-budget", 0.5, "-o", tmp_path / "o", "--calib-data",
                           calib_text, *flags)  # fmt: skip
        assert_user_error(code, output, "q_norm/k_norm", "--target native")
        assert not (tmp_path / "o").exists() and not (tmp_path / "o-native").exists()


@pytest.mark.parametrize("mode", ["exact", "calibrated"])
def test_export_refuses_qk_norm_checkpoints_and_vllm_the_exact_mode(sources, convert_tiny, tmp_path, calib_text, mode):
    """The DeepSeek-V3 export holds no per-head norm: both modes refused. vLLM through the plugin runs the calibrated
    mode (the query path is the plugin's own; keys are linear in the latent) and refuses the exact one, naming the
    mode that serves."""
    out = convert_tiny(sources["qwen3"], kv_budget=0.5, qk_norm=mode)
    code, output = run("export", out, "-o", tmp_path / "ds")
    assert_user_error(code, output, f"qk_norm {mode}", "transformers")
    assert not (tmp_path / "ds").exists()
    from mla_convert.serving.vllm_plugin import layout_for

    if mode == "exact":
        code, output = run("eval", out, "--engine", "vllm", "--data", calib_text)
        assert_user_error(code, output, f"qk_norm {mode}", "vLLM", "--qk-norm calibrated")
        with pytest.raises(UserError, match="vLLM's MLA kernels"):
            layout_for(AutoConfig.from_pretrained(out))
    else:
        from mla_convert.serving.layout import check_servable

        check_servable(AutoConfig.from_pretrained(out), "vLLM's MLA kernels", query_norm=True)  # no refusal


def test_calibrated_needs_calibration_text(sources, tmp_path):
    code, output = run("qwen", sources["qwen3"], "--kv-budget", 0.5, "--qk-norm", "calibrated", "--calib-data",
                       "none", "-o", tmp_path / "o")  # fmt: skip
    assert_user_error(code, output, "--calib-data")
    code, output = run("qwen", sources["qwen3"], "--kv-budget", 0.5, "--qk-norm", "approx", "--dry-run")
    assert_user_error(code, output, "--qk-norm")


def test_dry_run_names_the_mode(sources, calib_text):
    code, output = run("convert", sources["qwen3"], "--kv-budget", 0.5, "--dry-run", "--calib-data", calib_text)
    assert code == 0, output
    assert "family qwen (qwen3)" in output and "per-head q/k norms: exact" in output


def test_exact_mode_trains_its_weights_not_its_rope_key_maps(sources, convert_tiny):
    """Training (expanded attention) reaches the query map and the key norm; R and K are buffers, saved, not trained."""
    model = AutoModelForCausalLM.from_pretrained(convert_tiny(sources["qwen3"], kv_budget=0.5)).train()
    ids = tokens(batch=2, length=16)
    model(ids, labels=ids).loss.backward()
    attention = model.model.layers[0].self_attn
    for module in (attention.q_head_proj, attention.q_norm, attention.k_norm, attention.kv_b_proj):
        assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0
    buffers = dict(attention.named_buffers())
    assert set(buffers) == {"k_rope_up", "k_rope_down"} and not any(b.requires_grad for b in buffers.values())
    assert "model.layers.0.self_attn.k_rope_up" in model.state_dict()
