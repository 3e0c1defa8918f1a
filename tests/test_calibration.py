"""Calibration statistics against plain reference computations."""

from __future__ import annotations

import pytest
import torch

from mla_convert.conversion.statistics import LayerRunner, by_distance


def _reference_profile(runner: LayerRunner, layer) -> torch.Tensor:
    """The attention profile the slow way: full causal attention per sample, then weight[t, t - d] summed over t."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = layer.self_attn
    heads, groups, head_dim = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    n, seq, _ = runner.hidden.shape
    cos, sin = runner.position_embeddings
    profile = torch.zeros(heads, seq, dtype=torch.float64)
    x = layer.input_layernorm(runner.hidden)
    q = attn.q_proj(x).view(n, seq, heads, head_dim).transpose(1, 2)
    k = attn.k_proj(x).view(n, seq, groups, head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(heads // groups, dim=1)
    scores = (q @ k.transpose(-1, -2)).double() * attn.scaling
    probs = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    for t in range(seq):
        for d in range(t + 1):
            profile[:, d] += probs[:, :, t, t - d].sum(0)
    return profile / (n * seq)


@pytest.mark.parametrize("seq,block", [(37, 8), (16, 16), (20, 64), (9, 1)])
@torch.no_grad()
def test_attention_profile_matches_reference(seq, block):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=50, head_dim=8)  # fmt: skip
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).eval()
    for p in layer.parameters():  # sharp attention, so that the profile is far from uniform
        p.mul_(4)
    runner = LayerRunner(config, torch.randn(50, 32), torch.randint(0, 50, (3, seq)), batch=2)
    fast = runner.attention_profile(layer, block=block)
    slow = _reference_profile(runner, layer)
    assert fast.shape == (4, seq)
    torch.testing.assert_close(fast, slow, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fast.sum(-1), torch.ones(4, dtype=torch.float64), rtol=1e-6, atol=0)


@torch.no_grad()
def test_attended_inputs_second_moment_matches_reference():
    """attended[g] = mean over the group's query heads and the sampled queries of [p x, 1][p x, 1]^T; keyed = the
    inputs' second moment with every token weighted by the attention its key receives."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, apply_rotary_pos_emb

    torch.manual_seed(1)
    config = LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=30, head_dim=4)  # fmt: skip
    config._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(config, 0).eval()
    seq, block, every = 20, 4, 2
    runner = LayerRunner(config, torch.randn(30, 16), torch.randint(0, 30, (2, seq)))
    _, attended, keyed = runner.attention_statistics(layer, block=block, attended_every=every)
    attn = layer.self_attn
    x = layer.input_layernorm(runner.hidden)  # [N, T, D]
    cos, sin = runner.position_embeddings
    q = attn.q_proj(x).view(2, seq, 4, 4).transpose(1, 2)
    k = attn.k_proj(x).view(2, seq, 2, 4).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    scores = (q @ k.repeat_interleave(2, dim=1).transpose(-1, -2)).double() * attn.scaling
    probs = scores.masked_fill(~torch.ones(seq, seq, dtype=torch.bool).tril(), float("-inf")).softmax(-1)  # [N,H,T,T]
    xa = torch.cat([x.double(), torch.ones(2, seq, 1, dtype=torch.float64)], dim=-1)  # [N, T, D+1]
    received = probs.sum(dim=(1, 2))  # [N, T]: attention each key gets, over heads and queries
    torch.testing.assert_close(keyed, torch.einsum("nt,nti,ntj->ij", received, xa, xa) / (2 * seq * 4))
    mixed = probs @ x.double()[:, None]  # [N, H, T, D]
    mixed = torch.cat([mixed, torch.ones(*mixed.shape[:-1], 1, dtype=torch.float64)], dim=-1)
    rows = torch.tensor([t for t in range(seq) if (t // block) % every == 0])
    mixed = mixed[:, :, rows]  # the sampled query blocks
    want = torch.stack([
        torch.einsum("nhti,nhtj->ij", mixed[:, 2 * g : 2 * g + 2], mixed[:, 2 * g : 2 * g + 2]) / (2 * 2 * len(rows))
        for g in range(2)
    ])  # fmt: skip
    torch.testing.assert_close(attended, want, rtol=1e-5, atol=1e-7)


def test_by_distance_reads_each_query_row_back_from_its_own_position():
    # 2 queries (positions 2 and 3) over 4 keys in reversed order: column c holds key 3 - c
    probs = torch.tensor([[[0.0, 0.5, 0.3, 0.2], [0.4, 0.3, 0.2, 0.1]]])  # row 0: key 3 is future (zero)
    # row 0 (query 2): d=0 -> key 2 (0.5), d=1 -> key 1 (0.3), d=2 -> key 0 (0.2)
    # row 1 (query 3): d=0 -> key 3 (0.4), d=1 -> 0.3, d=2 -> 0.2, d=3 -> 0.1
    torch.testing.assert_close(by_distance(probs), torch.tensor([[0.9, 0.6, 0.4, 0.1]]))


@torch.no_grad()
def test_advance_a_window_at_a_time_is_the_batched_advance_bit_for_bit():
    """A CPU's runner advances one window at a time (`CPU_BATCH`, so that the layer's temporaries stay in the heap), a
    GPU's `BATCH` at once: the hidden states are the same bits either way, so a conversion writes the same weights."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from mla_convert.conversion.statistics import BATCH, CPU_BATCH, advance_batch

    assert advance_batch("cpu") == CPU_BATCH == 1 and advance_batch("cuda:1") == advance_batch("cuda") == BATCH > 1
    torch.manual_seed(2)
    config = LlamaConfig(hidden_size=64, intermediate_size=176, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=60, head_dim=16)  # fmt: skip
    config._attn_implementation = "sdpa"
    layers = [LlamaDecoderLayer(config, i).eval() for i in range(2)]
    embed, tokens = torch.randn(60, 64), torch.randint(0, 60, (10, 48))
    streams = [LayerRunner(config, embed, tokens, batch=batch) for batch in (CPU_BATCH, BATCH, 3)]
    for layer in layers:
        for runner in streams:
            runner.advance(layer)
        assert all(torch.equal(streams[0].hidden, runner.hidden) for runner in streams[1:])
    assert streams[0].hidden.shape == (10, 48, 64)


def test_echo_windows_repeat_an_earlier_span_of_their_own_window_at_the_end():
    from mla_convert.conversion.calibration import echo_windows

    windows = torch.arange(4 * 64).view(4, 64)  # every token distinct: a repeated token can only be a copy
    echoed = echo_windows(windows, 0.25, seed=3)
    assert torch.equal(echo_windows(windows, 0.0, seed=3), windows)
    assert torch.equal(echoed, echo_windows(windows, 0.25, seed=3))  # seeded
    assert torch.equal(echoed[:, :48], windows[:, :48])  # the first 3/4 as they were
    starts = set()
    for row, tail in zip(windows, echoed[:, 48:]):
        start = int(tail[0] - row[0])
        assert 0 <= start <= 64 - 2 * 16 and torch.equal(tail, row[start:start + 16])  # 16 to 48 tokens back
        starts.add(start)
    assert len(starts) > 1  # each window draws its own span
    odd = echo_windows(torch.arange(3).view(1, 3), 0.5, seed=0)  # half of 3 rounds to 2: one token fits
    assert odd[0, :2].tolist() == [0, 1] and odd[0, 2].item() in (0, 1)
