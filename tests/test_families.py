"""Families beyond Llama and Qwen: each converts exactly at full rank (full forward and cached decode, fp32 logits
within 1e-4 of the source's), a 50% conversion loads and generates, and what no engine can hold is refused up front."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_user_error
from test_exactness import REL_TOL, full_options, rel_err, tokens
from tiny import tiny_source
from transformers import AutoConfig, AutoModelForCausalLM
from typer.testing import CliRunner

import mla_convert  # noqa: F401
from mla_convert.cli import app
from mla_convert.errors import UserError
from mla_convert.families import family_for
from mla_convert.modeling.compat import cache_kwargs, output_cache

# each family's tiny source (tests/tiny.py KINDS) and its transformers class
FAMILY_KINDS = {"mistral-window": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "olmo2": "Olmo2ForCausalLM",
                "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def run(*args):
    result = CliRunner().invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


@pytest.fixture(scope="module")
def family_sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("family-sources")
    return {kind: tiny_source(kind, root / kind, seed=11 + i) for i, kind in enumerate(FAMILY_KINDS)}


@pytest.fixture(scope="module")
def pairs(family_sources, convert_tiny):
    """(source, full-rank conversion) per kind, converted with calibration and refinement as by default (the
    calibration windows, 32 tokens, are longer than any window a tiny source attends within)."""
    out = {}
    for kind, folder in family_sources.items():
        src = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        assert type(src).__name__ == FAMILY_KINDS[kind]
        dst = convert_tiny(folder, **full_options(src.config, merge=True))
        out[kind] = (src, AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval())
    return out


def decode_logits(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits of `ids` from a prefill of `prefill` tokens, then one token at a time over the cache."""
    with torch.no_grad():
        out = model(ids[:, :prefill], use_cache=True)
        steps, cache = [out.logits], output_cache(out)
        for t in range(prefill, ids.shape[1]):
            out = model(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
            cache = output_cache(out)
            steps.append(out.logits)
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_full_rank_forward_is_exact(pairs, kind):
    src, mla = pairs[kind]
    ids = tokens()
    with torch.no_grad():
        assert rel_err(src(ids).logits, mla(ids).logits) < REL_TOL


@pytest.mark.parametrize("kind", FAMILY_KINDS)
@pytest.mark.parametrize("prefill", [3, 15])  # shorter and longer than the sliding window (6)
def test_full_rank_cached_decode_is_exact(pairs, kind, prefill):
    src, mla = pairs[kind]
    ids = tokens()
    with torch.no_grad():
        reference = src(ids).logits
    assert rel_err(reference, decode_logits(mla, ids, prefill)) < REL_TOL


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_greedy_generation_equal(pairs, kind):
    src, mla = pairs[kind]
    ids = tokens(batch=1, length=8)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(src.generate(ids, **kwargs), mla.generate(ids, **kwargs))


@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_half_cache_conversion_loads_and_generates(family_sources, convert_tiny, kind):
    out = convert_tiny(family_sources[kind], kv_budget=0.5)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "MLAForCausalLM"
    ids = tokens(batch=1, length=8)
    assert model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0).shape == (1, 14)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


# ---------------------------------------------------------------------------------------------- Mistral's window


def test_window_is_kept_and_attended_within(pairs):
    """The window is the source's, and it matters: the same weights attending to the whole past give other logits."""
    src, mla = pairs["mistral-window"]
    assert mla.config.sliding_window == src.config.sliding_window == 6
    ids = tokens()
    with torch.no_grad():
        windowed = mla(ids).logits
        for layer in mla.model.layers:  # each layer's type, which the model masks by
            layer.self_attn.layer_type = "full_attention"
        try:
            whole = mla(ids, use_cache=False).logits
        finally:
            for layer in mla.model.layers:
                layer.self_attn.layer_type = "sliding_attention"
    assert rel_err(windowed[:, :6], whole[:, :6]) < REL_TOL  # the first 6 positions see their whole past anyway
    assert rel_err(windowed, whole) > 1e-2


def test_window_cache_keeps_the_window_only(pairs):
    _, mla = pairs["mistral-window"]
    with torch.no_grad():
        cache = output_cache(mla(tokens(batch=1, length=20), use_cache=True))
    assert all(layer.keys.shape[2] == 5 for layer in cache.layers)  # window - 1 rows: all the next query sees


def test_window_refused_where_no_engine_holds_it(family_sources, convert_tiny, tmp_path, calib_text):
    folder = family_sources["mistral-window"]
    for flags in (["--target", "deepseek"], ["--format", "deepseek"], ["--format", "gguf"]):
        target = tmp_path / ("o.gguf" if "gguf" in flags else "o")
        code, output = run("llama", folder, "--kv-budget", 0.5, "-o", target, "--calib-data", calib_text, *flags)
        assert_user_error(code, output, "sliding attention window (6 tokens)", "--target native")
        assert not target.exists()
    out = convert_tiny(folder, kv_budget=0.5)
    code, output = run("export", out, "-o", tmp_path / "ds")
    assert_user_error(code, output, "sliding window of 6", "transformers")
    code, output = run("eval", out, "--engine", "vllm", "--data", calib_text)
    assert_user_error(code, output, "sliding window of 6", "vLLM")
    from mla_convert.serving.vllm_plugin import layout_for

    with pytest.raises(UserError, match="sliding window"):
        layout_for(AutoConfig.from_pretrained(out))


def test_window_only_where_the_family_has_one(family_sources, sources):
    config = AutoConfig.from_pretrained(family_sources["mistral-window"])
    assert family_for(config).sliding_window(config) == 6
    config.use_sliding_window = False  # Qwen2's switch, read for every family
    assert family_for(config).sliding_window(config) is None
    config = AutoConfig.from_pretrained(sources["llama-gqa"])
    config.sliding_window = 6
    with pytest.raises(UserError, match="sliding-window attention"):
        family_for(config)
    config.sliding_window = "6"
    with pytest.raises(UserError, match="sliding_window in config.json"):
        family_for(config)


# ---------------------------------------------------------------------------------------------- Phi-3's fused tensors


def test_phi3_fused_tensors_read_apart(family_sources, pairs):
    from safetensors import safe_open

    from mla_convert.checkpoint import open_source

    folder = family_sources["phi3"]
    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as f:
        stored = set(f.keys())
        qkv = f.get_tensor("model.layers.1.self_attn.qkv_proj.weight")
        gate_up = f.get_tensor("model.layers.1.mlp.gate_up_proj.weight")
    assert "model.layers.0.self_attn.qkv_proj.weight" in stored and "model.layers.0.self_attn.q_proj.weight" not in stored
    source = open_source(str(folder))
    keys = set(source.keys())
    assert "model.layers.0.self_attn.qkv_proj.weight" not in keys and "model.layers.0.mlp.gate_up_proj.weight" not in keys
    q, k, v = (source.get(f"model.layers.1.self_attn.{p}_proj.weight") for p in "qkv")
    assert q.shape == (64, 64) and k.shape == v.shape == (32, 64) and source.shape("model.layers.1.self_attn.v_proj.weight") == (32, 64)
    assert torch.equal(torch.cat([q, k, v]), qkv)
    gate, up = source.get("model.layers.1.mlp.gate_proj.weight"), source.get("model.layers.1.mlp.up_proj.weight")
    assert torch.equal(torch.cat([gate, up]), gate_up)  # gate first: Phi3MLP chunks gate, then up
    _, mla = pairs["phi3"]
    assert torch.equal(mla.model.layers[1].mlp.gate_proj.weight, gate)  # the MLP passes through, apart


def test_phi3_mismatched_fused_rows_and_partial_rope_refused(family_sources, tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(family_sources["phi3"], bad)
    shard = next(bad.glob("*.safetensors"))
    state = load_file(shard)
    state["model.layers.0.self_attn.qkv_proj.weight"] = state["model.layers.0.self_attn.qkv_proj.weight"][:-16].clone()
    save_file(state, str(shard), metadata={"format": "pt"})
    code, output = run("phi3", bad, "--kv-budget", 0.5, "-o", tmp_path / "o", "--calib-data", "none")
    assert_user_error(code, output, "model.layers.0.self_attn.v_proj.weight", "[16, 64]")
    partial = tmp_path / "partial"
    shutil.copytree(family_sources["phi3"], partial)
    config = json.loads((partial / "config.json").read_text())
    config["rope_parameters"]["partial_rotary_factor"] = 0.75
    (partial / "config.json").write_text(json.dumps(config))
    code, output = run("phi3", partial, "--kv-budget", 0.5, "-o", tmp_path / "o2", "--calib-data", "none")
    assert_user_error(code, output, "partial_rotary_factor 0.75")
    code, output = run("llama", family_sources["phi3"], "--kv-budget", 0.5, "-o", tmp_path / "o3")
    assert_user_error(code, output, "mla-convert phi3")


# ---------------------------------------------------------------------------------------------- OLMo 2


def test_olmo2_norms_kept_whole(family_sources, pairs):
    """The q/k norms span the whole projection (one RMS per token over all heads) and the blocks are post-norm: the
    native model keeps both as the source has them, with the source's non-trivial weights."""
    src, mla = pairs["olmo2"]
    attention, layer = mla.model.layers[0].self_attn, mla.model.layers[0]
    assert mla.config.qk_norm == "exact" and mla.config.qk_norm_scope == "projection"
    assert mla.config.norm_layout == "post"
    assert attention.q_norm.weight.shape == (64,) and attention.k_norm.weight.shape == (32,)
    assert torch.equal(attention.k_norm.weight, src.model.layers[0].self_attn.k_norm.weight)
    assert src.model.layers[0].self_attn.k_norm.weight.std() > 0.1
    assert not hasattr(layer, "input_layernorm")
    assert torch.equal(layer.post_feedforward_layernorm.weight, src.model.layers[0].post_feedforward_layernorm.weight)


def test_olmo2_calibrated_key_norm_is_absorbable(family_sources, convert_tiny):
    """--qk-norm calibrated: the whole key projection's RMS replaced by one calibration statistic per layer, so keys
    are linear in the latent (absorbed decode equals the expanded form); an approximation, bounded."""
    from test_exactness import both_forms

    src = AutoModelForCausalLM.from_pretrained(family_sources["olmo2"], dtype=torch.float32).eval()
    out = convert_tiny(family_sources["olmo2"], **full_options(src.config, merge=True), qk_norm="calibrated")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("k_norm" in name for name in model.state_dict())
    ids = tokens()
    expanded, absorbed = both_forms(model, ids)
    assert rel_err(expanded, absorbed) < REL_TOL
    with torch.no_grad():
        assert 1e-4 < rel_err(src(ids).logits, expanded) < 1.0
    assert model.generate(tokens(batch=1, length=8), max_new_tokens=4, do_sample=False, pad_token_id=0).shape == (1, 12)


def test_olmo2_refused_where_no_engine_holds_it(family_sources, convert_tiny, tmp_path, calib_text):
    folder = family_sources["olmo2"]
    code, output = run("olmo2", folder, "--kv-budget", 0.5, "-o", tmp_path / "o", "--calib-data", calib_text,
                       "--target", "deepseek")  # fmt: skip
    assert_user_error(code, output, "post-norm blocks", "--target native")
    out = convert_tiny(folder, kv_budget=0.5, qk_norm="calibrated")
    code, output = run("export", out, "-o", tmp_path / "ds")
    assert_user_error(code, output, "norm_layout post", "transformers")
    code, output = run("eval", out, "--engine", "vllm", "--data", calib_text)
    assert_user_error(code, output, "norm_layout post", "vLLM")
    from mla_convert.serving.layout import check_servable

    config = AutoConfig.from_pretrained(out).to_dict()
    config["norm_layout"] = "pre"
    with pytest.raises(UserError, match="whole query and key projections"):
        check_servable(config, "vLLM's MLA kernels", query_norm=True)


# ---------------------------------------------------------------------------------------------- Gemma 2


def test_gemma2_features_kept(pairs):
    """Scaled embeddings, (1+w) norms, both soft-caps, the softmax scale and the alternating windows are the
    source's, and each matters: the same weights without it give other logits."""
    src, mla = pairs["gemma2"]
    config = mla.config
    assert config.embed_scale == 8.0 and config.norm_unit_offset and config.hidden_act == "gelu_pytorch_tanh"
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (2.0, 3.0)
    assert config.softmax_scale == 24**-0.5 and config.norm_layout == "sandwich"
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 6
    assert torch.equal(mla.model.norm.weight, src.model.norm.weight)  # the (1+w) weights as stored, not folded
    assert mla.lm_head.weight.data_ptr() == mla.model.embed_tokens.weight.data_ptr()  # tied, as the source
    ids = tokens()
    with torch.no_grad():
        reference = mla(ids).logits
        for field, value in (("attn_logit_softcapping", None), ("final_logit_softcapping", None),
                             ("embed_scale", None)):
            kept = getattr(config, field)
            setattr(config, field, value)
            for layer in mla.model.layers:
                layer.self_attn.softcap = config.attn_logit_softcapping
            try:
                assert rel_err(reference, mla(ids).logits) > 1e-2, field
            finally:
                setattr(config, field, kept)
                for layer in mla.model.layers:
                    layer.self_attn.softcap = config.attn_logit_softcapping
        cache = output_cache(mla(ids, use_cache=True))
    assert [layer.keys.shape[2] for layer in cache.layers] == [5, 24]  # the window's rows, then every row


def test_gemma2_refused_where_no_engine_holds_it(family_sources, convert_tiny, tmp_path, calib_text):
    folder = family_sources["gemma2"]
    code, output = run("gemma", folder, "--kv-budget", 0.5, "-o", tmp_path / "o", "--calib-data", calib_text,
                       "--format", "deepseek")  # fmt: skip
    assert_user_error(code, output, "logit soft-capping", "--target native")
    out = convert_tiny(folder, kv_budget=0.5)
    code, output = run("export", out, "-o", tmp_path / "ds")
    assert_user_error(code, output, "transformers")
    code, output = run("eval", out, "--engine", "vllm", "--data", calib_text)
    assert_user_error(code, output, "vLLM")
    from mla_convert.serving.layout import check_servable

    config = AutoConfig.from_pretrained(out).to_dict()
    config.update(sliding_window=None, layer_types=None, norm_layout="pre")
    with pytest.raises(UserError, match="soft-caps its logits"):
        check_servable(config, "vLLM's MLA kernels")


# ---------------------------------------------------------------------------------------------- Gemma 3


def test_gemma3_norms_and_rope_bases_kept(pairs):
    """Per-head (1+w) q/k norms in the exact mode with windowed layers (the cached keys' positions are the window's),
    and each layer type's RoPE base: rotating the sliding layers with the global base gives other logits."""
    src, mla = pairs["gemma3_text"]
    config = mla.config
    assert config.qk_norm == "exact" and config.qk_norm_scope == "head" and config.norm_unit_offset
    assert config.rope_parameters["rope_theta"] == 1e6 and config.local_rope_parameters["rope_theta"] == 1e4
    assert [layer.self_attn.local_rope for layer in mla.model.layers] == [True, False]
    assert torch.equal(mla.model.layers[0].self_attn.k_norm.weight, src.model.layers[0].self_attn.k_norm.weight)
    ids = tokens()
    with torch.no_grad():
        reference = mla(ids).logits
        mla.model.layers[0].self_attn.local_rope = False
        try:
            assert rel_err(reference, mla(ids).logits) > 1e-2
        finally:
            mla.model.layers[0].self_attn.local_rope = True


def test_gemma3_calibrated_key_norm_is_absorbable(family_sources, convert_tiny):
    from test_exactness import both_forms

    src = AutoModelForCausalLM.from_pretrained(family_sources["gemma3_text"], dtype=torch.float32).eval()
    out = convert_tiny(family_sources["gemma3_text"], **full_options(src.config, merge=True), qk_norm="calibrated")
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = tokens()
    expanded, absorbed = both_forms(model, ids)
    assert rel_err(expanded, absorbed) < REL_TOL
    with torch.no_grad():
        assert 1e-4 < rel_err(src(ids).logits, expanded) < 1.0


def test_gemma3_multimodal_checkpoint_names_the_text_model(family_sources):
    config = AutoConfig.from_pretrained(family_sources["gemma3_text"])
    config.model_type = "gemma3"
    with pytest.raises(UserError, match="gemma3_text"):
        family_for(config)
