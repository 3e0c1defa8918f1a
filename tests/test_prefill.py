"""The expanded attention (prefill, eval, training) keeps sdpa's fused kernel and gives the eager result.

With query/key width d_n + d_r different from the value width d_v, sdpa falls back to its math kernel; the model
zero-pads the narrower side to one width and slices the output (modeling_mla.MLAAttention._expanded).
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from mla_convert.modeling import MLAConfig, MLAForCausalLM
from mla_convert.modeling.compat import cache_kwargs, output_cache

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)


def tiny_mla(implementation: str, **shape) -> MLAForCausalLM:
    torch.manual_seed(0)
    config = MLAConfig(**TINY, **shape)
    model = MLAForCausalLM(config).eval()
    model.config._attn_implementation = implementation
    return model


SHAPES = {
    "value narrower": dict(kv_lora_rank=12, qk_rope_head_dim=8),  # q/k 16 + 8, v 16
    "value wider": dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6),  # q/k 6 + 4, v 16
    "equal": dict(kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=8),  # q/k 8 + 8, v 16
}


def op_names(fn) -> set[str]:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return {event.key for event in prof.key_averages()}


@pytest.mark.parametrize("shape", SHAPES)
def test_sdpa_equals_eager_forward_and_gradients(shape):
    ids = torch.randint(3, 300, (2, 37), generator=torch.Generator().manual_seed(1))
    results = []
    for implementation in ("eager", "sdpa"):
        model = tiny_mla(implementation, **SHAPES[shape])
        out = model(ids, use_cache=False).logits
        out.square().mean().backward()
        results.append((out.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (eager, eager_grads), (sdpa, sdpa_grads) = results
    torch.testing.assert_close(sdpa, eager, rtol=1e-5, atol=1e-5)
    assert eager_grads.keys() == sdpa_grads.keys()
    for name in eager_grads:
        torch.testing.assert_close(sdpa_grads[name], eager_grads[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("shape", SHAPES)
def test_expanded_attention_runs_the_fused_cpu_kernel(shape):
    model = tiny_mla("sdpa", **SHAPES[shape])
    ids = torch.randint(3, 300, (1, 40))
    with torch.no_grad():
        names = op_names(lambda: model(ids, use_cache=False))
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in names
    assert "aten::_scaled_dot_product_attention_math" not in names


def test_padded_prefill_then_absorbed_decode_matches_one_forward():
    """Prefill in the padded expanded form, decode over the latent cache: the logits of one full forward."""
    model = tiny_mla("sdpa", **SHAPES["value narrower"])
    ids = torch.randint(3, 300, (2, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :12], use_cache=True)
        steps, cache = [out.logits], output_cache(out)
        for t in range(12, 20):
            out = model(ids[:, t : t + 1], **cache_kwargs(cache), use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mask_kind", ["bool", "additive", "per row"])
def test_grouped_sdpa_equals_repeated_keys_forward_and_gradients(mask_kind):
    """The query heads of a kv group stacked as one head's rows: the result and gradients of repeating the group's
    keys and values for each of its heads, for a mask shared by the heads (bool or additive, one per batch row)."""
    from mla_convert.modeling.modeling_mla import grouped_fits, grouped_sdpa

    gen = torch.Generator().manual_seed(3)
    batch, heads, groups, q_len, kv_len, width = 2, 6, 2, 5, 11, 8
    query = torch.randn(batch, heads, q_len, width, generator=gen, requires_grad=True)
    key = torch.randn(batch, groups, kv_len, width, generator=gen, requires_grad=True)
    value = torch.randn(batch, groups, kv_len, width, generator=gen, requires_grad=True)
    rows = torch.tensor([1, 3, 6, 8, 10])  # chosen query positions, as a refinement step takes them
    mask = (rows[:, None] >= torch.arange(kv_len)[None])[None, None]  # [1, 1, T, S]
    if mask_kind == "additive":
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    elif mask_kind == "per row":
        mask = mask.repeat(batch, 1, 1, 1)
        mask[1, 0, :, :2] = False  # the second row's first two keys are padding
    assert grouped_fits(query, key, mask) and not grouped_fits(query, key, None)
    got = grouped_sdpa(query, key, value, mask, scaling=0.3)
    grads = torch.autograd.grad(got.square().sum(), (query, key, value))
    per = heads // groups
    want = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(per, dim=1), value.repeat_interleave(per, dim=1), attn_mask=mask, scale=0.3)
    want_grads = torch.autograd.grad(want.square().sum(), (query, key, value))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_padded_batch_in_grouped_sdpa_equals_eager(shape, monkeypatch):
    """A batch with left padding: its mask is shared by the heads, so sdpa takes the grouped form (where the layers
    expand the latent); the logits at the real positions are eager attention's."""
    from mla_convert.modeling import modeling_mla

    calls = []
    grouped = modeling_mla.grouped_sdpa
    monkeypatch.setattr(modeling_mla, "grouped_sdpa", lambda *a, **k: calls.append(1) or grouped(*a, **k))
    ids = torch.randint(3, 300, (2, 19), generator=torch.Generator().manual_seed(4))
    attention_mask = torch.ones_like(ids)
    attention_mask[1, :6] = 0
    logits = []
    for implementation in ("eager", "sdpa"):
        model = tiny_mla(implementation, **SHAPES[shape])
        for layer in model.model.layers:
            layer.self_attn.use_latent_prefill = lambda *a: False  # the expanded form, as at full rank
        with torch.no_grad():
            logits.append(model(ids, attention_mask=attention_mask, use_cache=False).logits)
    assert len(calls) == TINY["num_hidden_layers"]
    real = attention_mask.bool()
    torch.testing.assert_close(logits[1][real], logits[0][real], rtol=1e-5, atol=1e-5)
