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
