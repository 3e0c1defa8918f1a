"""The anchor of trust: with full rank and every RoPE pair kept, the MLA model reproduces the source's logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import mla_convert  # noqa: F401
from mla_convert.convert import max_rank
from mla_convert.modeling.compat import cache_kwargs, output_cache

KINDS = ["llama-gqa", "llama-mha", "mistral", "qwen2", "two-shards"]
REL_TOL = 1e-4


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / a.abs().max()).item()


def full_options(config, merge: bool) -> dict:
    groups = config.num_key_value_heads
    return dict(rank=max_rank(config), rope_dims=groups * config.head_dim, rope_merge=merge, force=True)


@pytest.fixture(scope="module")
def pairs(sources, convert_tiny):
    """(source model, converted model) per kind, converted at full rank with every RoPE pair kept."""
    out = {}
    for kind in KINDS:
        src = AutoModelForCausalLM.from_pretrained(sources[kind], dtype=torch.float32).eval()
        dst = convert_tiny(sources[kind], **full_options(src.config, merge=kind != "mistral"))
        out[kind] = (src, AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval())
    return out


def tokens(batch: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("kind", KINDS)
def test_one_forward_matches_source(pairs, kind):
    src, mla = pairs[kind]
    assert type(mla).__name__ == "MLAForCausalLM"
    ids = tokens()
    with torch.no_grad():
        assert rel_err(src(ids).logits, mla(ids).logits) < REL_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_token_by_token_with_cache_matches_source(pairs, kind):
    """Prefill a prefix (expanded form), then decode one token at a time (absorbed form) over the latent cache."""
    src, mla = pairs[kind]
    ids = tokens()
    with torch.no_grad():
        reference = src(ids).logits
        out = mla(ids[:, :5], use_cache=True)
        steps = [out.logits]
        cache = output_cache(out)
        for t in range(5, ids.shape[1]):
            out = mla(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
            cache = output_cache(out)
            steps.append(out.logits)
    assert rel_err(reference, torch.cat(steps, dim=1)) < REL_TOL


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_generation_matches_source(pairs, kind):
    src, mla = pairs[kind]
    ids = tokens(batch=1, length=8)
    a = src.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    b = mla.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


def test_merged_and_per_head_rope_both_exact(sources, convert_tiny):
    src = AutoModelForCausalLM.from_pretrained(sources["llama-gqa"]).eval()
    ids = tokens()
    for merge in (True, False):
        mla = AutoModelForCausalLM.from_pretrained(convert_tiny(sources["llama-gqa"], **full_options(src.config, merge)))
        with torch.no_grad():
            assert rel_err(src(ids).logits, mla.eval()(ids).logits) < REL_TOL


def both_forms(mla, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits in the expanded form, logits in the absorbed form) of one forward."""
    logits = []
    with torch.no_grad():
        for mode in ("expanded", "absorbed"):
            mla.config.mla_attention_mode = mode
            logits.append(mla(ids).logits)
    mla.config.mla_attention_mode = "auto"
    return logits[0], logits[1]


def test_absorbed_equals_expanded_at_low_rank(sources, convert_tiny):
    """A lossy conversion still computes the same function in both decode forms."""
    mla = AutoModelForCausalLM.from_pretrained(convert_tiny(sources["qwen2"], rank=12, rope_dims=8)).eval()
    expanded, absorbed = both_forms(mla, tokens())
    assert rel_err(expanded, absorbed) < REL_TOL


def test_latent_prefill_equals_expanded(sources, convert_tiny):
    """Where the latent is narrower than the nope key, "auto" runs prefill and training over the latent (one shared
    kv head, fused sdpa): the same logits and gradients as the expanded form, with left padding and over a cache."""
    mla = AutoModelForCausalLM.from_pretrained(convert_tiny(sources["qwen2"], rank=6, rope_dims=8, nope_dims=16)).eval()
    attn = mla.model.layers[0].self_attn
    assert attn.kv_lora_rank < attn.qk_nope_head_dim
    assert attn.use_latent_prefill(24, 24, None) and attn.use_latent_prefill(14, 24, None)
    assert not attn.use_latent_prefill(1, 24, None)  # decode: the absorbed step
    ids = tokens()
    padding = torch.ones_like(ids)
    padding[0, :5] = 0  # left padding in the first row
    results = {}
    for mode in ("expanded", "auto"):
        mla.config.mla_attention_mode = mode
        with torch.no_grad():
            plain = mla(ids).logits
            padded = mla(ids, attention_mask=padding).logits[padding.bool()]
            past = output_cache(mla(ids[:, :10], use_cache=True))  # then 14 tokens in one step over the cache
            chunked = mla(ids[:, 10:], **cache_kwargs(past), use_cache=True).logits
        mla.train()
        loss = mla(ids, labels=ids).loss
        loss.backward()
        grads = {name: p.grad.clone() for name, p in mla.named_parameters() if p.grad is not None}
        mla.zero_grad(set_to_none=True)
        mla.eval()
        results[mode] = plain, padded, chunked, loss.detach(), grads
    mla.config.mla_attention_mode = "auto"
    for a, b in zip(results["expanded"][:4], results["auto"][:4]):
        assert rel_err(a, b) < REL_TOL
    assert torch.isfinite(results["auto"][1]).all()
    grads_e, grads_a = results["expanded"][4], results["auto"][4]
    assert grads_e.keys() == grads_a.keys() and "model.layers.0.self_attn.kv_b_proj.weight" in grads_a
    for name in grads_e:
        assert rel_err(grads_e[name], grads_a[name]) < 1e-3, name
    # queries at the end of a longer key range and no mask (causal offset): as the absorbed reference computes it
    generator = torch.Generator().manual_seed(1)
    d_n, d_r, d_c = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
    q_nope, q_rope = (torch.randn(2, attn.num_heads, 14, d, generator=generator) for d in (d_n, d_r))
    latent, k_rope = torch.randn(2, 1, 24, d_c, generator=generator), torch.randn(2, 1, 24, d_r, generator=generator)
    with torch.no_grad():
        reference, _ = attn._absorbed(q_nope, q_rope, latent, k_rope, None)
        assert rel_err(reference, attn._latent_prefill(q_nope, q_rope, latent, k_rope, None)) < REL_TOL


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2"])
def test_every_method_is_exact_at_full_rank(sources, convert_tiny, kind):
    """Attention-aware RoPE selection, expected rotation for dropped pairs, the attention objective and K/V balancing
    change only what is dropped: with every pair kept and full rank the logits still equal the source's."""
    src = AutoModelForCausalLM.from_pretrained(sources[kind]).eval()
    ids = tokens()
    for extra in (
        dict(rope_strategy="attention", dropped_rope="expected", objective="attention", kv_balance=1.0),
        dict(rope_strategy="attention", dropped_rope="expected", objective="scores", rank_allocation="energy",
             value_inputs="attended", key_inputs="attended", latent_rounds=2),
        dict(rope_strategy="2-norm", objective="kv", kv_balance=0.5, rope_merge=False),
    ):
        options = {**full_options(src.config, True), **extra}
        mla = AutoModelForCausalLM.from_pretrained(convert_tiny(sources[kind], **options))
        with torch.no_grad():
            assert rel_err(src(ids).logits, mla.eval()(ids).logits) < REL_TOL, extra


def test_expected_rotation_helps_a_lossy_conversion(sources, convert_tiny):
    """Dropped pairs that keep their expected rotation reproduce the source's logits better than unrotated ones
    (same kept pairs, full rank: only the treatment of the dropped pairs differs)."""
    src = AutoModelForCausalLM.from_pretrained(sources["llama-gqa"]).eval()
    ids = tokens()
    errors = {}
    for dropped in ("unrotated", "expected"):
        out = convert_tiny(sources["llama-gqa"], rank=max_rank(src.config), rope_dims=4, rope_strategy="high",
                           dropped_rope=dropped, force=True)  # fmt: skip
        with torch.no_grad():
            errors[dropped] = rel_err(src(ids).logits, AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits)
    assert errors["expected"] < errors["unrotated"], errors


@pytest.mark.parametrize("kind", ["qwen2", "llama-mha"])
def test_narrowed_nope_is_exact_where_the_latent_is_narrower(sources, convert_tiny, kind):
    """The default narrows each head's nope query/key to head_dim - d_r (query/key as wide as the source's). Where the
    latent is no wider than that, the nope key spans at most d_c dims and the narrowing loses nothing: the same logits
    as keeping head_dim nope dims. The score energy kept is recorded per layer."""
    import json

    options = dict(rank=6, rope_dims=8, refine_steps=0, refine_model_steps=0)  # the closed form alone
    narrow = convert_tiny(sources[kind], **options)
    wide = convert_tiny(sources[kind], nope_dims=16, **options)
    models = {name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
              for name, path in (("narrow", narrow), ("wide", wide))}
    attn = models["narrow"].model.layers[0].self_attn
    assert (attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim) == (8, 8, 16)  # q/k 16 wide, as the source
    assert models["wide"].model.layers[0].self_attn.qk_nope_head_dim == 16
    ids = tokens()
    with torch.no_grad():
        assert rel_err(models["wide"](ids).logits, models["narrow"](ids).logits) < REL_TOL
    expanded, absorbed = both_forms(models["narrow"], ids)
    assert rel_err(expanded, absorbed) < REL_TOL
    plan = json.loads((narrow / "provenance.json").read_text())["plan"]
    assert plan["nope_dims"] == 8 and len(plan["nope_kept"]) == models["narrow"].config.num_hidden_layers
    assert all(row["kept"] > 1 - 1e-6 for row in plan["nope_kept"])
    # at 8 latent dims over 8 nope dims per group the narrowing has to choose: what it keeps is recorded (< 1)
    lossy = json.loads((convert_tiny(sources[kind], rank=12, rope_dims=8, refine_steps=0) / "provenance.json"
                        ).read_text())["plan"]["nope_kept"]
    assert all(0 < row["kept"] < 1 for row in lossy)


def test_narrowing_warns_for_each_layer_it_costs_more_than_the_threshold(sources, convert_tiny, caplog):
    """A layer whose narrowed nope query/key keeps less than NOPE_KEPT_WARN of the score energy gets one warning that
    names --nope-dims; the others none."""
    import json
    import logging

    from mla_convert.conversion.method import NOPE_KEPT_WARN

    with caplog.at_level(logging.WARNING, logger="mla_convert.conversion.method"):
        out = convert_tiny(sources["llama-gqa"], rank=16)
    kept = json.loads((out / "provenance.json").read_text())["plan"]["nope_kept"]
    low = {row["layer"] for row in kept if row["kept"] < NOPE_KEPT_WARN}
    warned = {int(r.getMessage().split("layer ")[1].split("'")[0]) for r in caplog.records
              if "--nope-dims 16 keeps all" in r.getMessage()}
    assert low and warned == low  # this tiny model has such a layer (layer 1: 97.8%)
