"""RoPE plans: merged components reproduce the source's scores, and the attention merge finds what a real PCA misses."""

from __future__ import annotations

import pytest
import torch

from mla_convert import rope

HEADS, GROUPS, HEAD_DIM, HIDDEN = 4, 2, 8, 16
HALF = HEAD_DIM // 2


def _complex_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """[heads*d_h, D] -> [heads, d_h/2, D] complex (rotate_half layout: dims i and i + d_h/2)."""
    w = w.view(heads, 2, -1, w.shape[-1])
    return torch.complex(w[:, 0], w[:, 1])


def _scores(zq: torch.Tensor, zk: torch.Tensor, theta: torch.Tensor, group_of, x, y, distance) -> torch.Tensor:
    """Per head: sum over pairs of Re(q conj(k) e^{j theta d}); zq [H, n, D], zk [H or 1, n, D] complex."""
    q = zq @ x.to(zq.dtype)  # [H, n]
    k = zk @ y.to(zk.dtype)
    k = k[group_of] if k.shape[0] > 1 else k
    return (q * k.conj() * torch.exp(1j * theta * distance)).real.sum(-1)


def _stats(seed: int):
    gen = torch.Generator().manual_seed(seed)
    w_q = torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=gen, dtype=torch.float64)
    w_k = torch.randn(GROUPS * HEAD_DIM, HIDDEN, generator=gen, dtype=torch.float64)
    a = torch.randn(HIDDEN, HIDDEN, generator=gen, dtype=torch.float64)
    cov = a @ a.T / HIDDEN
    phase = torch.polar(torch.rand(HEADS, HALF, generator=gen, dtype=torch.float64),
                        torch.rand(HEADS, HALF, generator=gen, dtype=torch.float64) * 6)  # fmt: skip
    q_energy, k_cov = rope.pair_energies(w_q, w_k, cov, HEADS, GROUPS, HEAD_DIM)
    return w_q, w_k, q_energy, k_cov, phase


@pytest.mark.parametrize("strategy", ["attention", "high", "2-norm"])
@pytest.mark.parametrize("pairs", [3, GROUPS * HALF])
def test_merged_plan_reproduces_scores(strategy, pairs):
    """Rope part + nope part = the source's score at distance 0 for any plan; at every distance when all pairs are
    kept (nothing left in the nope key)."""
    w_q, w_k, q_energy, k_cov, phase = _stats(0)
    plan = rope.plan_rope(2 * pairs, strategy, True, HEADS, GROUPS, HEAD_DIM, q_energy, k_cov, phase)
    q_rope, k_rope, k_nope = rope.split_rope(plan, w_q, w_k, HEADS, GROUPS, HEAD_DIM)
    group_of = torch.arange(HEADS) // (HEADS // GROUPS)
    theta = torch.linspace(1.0, 0.01, HALF, dtype=torch.float64)
    kept_theta = theta[plan.frequencies]
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(HIDDEN, generator=gen, dtype=torch.float64), torch.randn(HIDDEN, generator=gen, dtype=torch.float64)
    source = _complex_pairs(w_q, HEADS), _complex_pairs(w_k, GROUPS)
    rope_q, rope_k = _complex_pairs(q_rope.reshape(-1, HIDDEN), HEADS), _complex_pairs(k_rope, 1)
    nope = (w_q.view(HEADS, HEAD_DIM, HIDDEN) @ x) @ (k_nope.view(GROUPS, HEAD_DIM, HIDDEN) @ y)[group_of].T
    nope = nope.diagonal()  # [H]: each head against its own group's nope key
    distances = [0.0] if pairs < GROUPS * HALF else [0.0, 3.0, 17.0]
    if pairs == GROUPS * HALF:
        assert k_nope.abs().max() < 1e-10
    for d in distances:
        want = _scores(*source, theta, group_of, x, y, d)
        got = _scores(rope_q, rope_k, kept_theta, group_of, x, y, d) + nope
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_attention_merge_finds_phase_shifted_heads():
    """Kv head 1's key is kv head 0's rotated by 90 degrees in every pair: one complex component per frequency carries
    all of the key. The real PCA (TransMLA's RoRoPE) sees the heads as uncorrelated and keeps half of it."""
    gen = torch.Generator().manual_seed(2)
    w_q = torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=gen, dtype=torch.float64)
    k0 = torch.randn(2, HALF, HIDDEN, generator=gen, dtype=torch.float64)
    k1 = torch.stack([-k0[1], k0[0]])  # j * z0
    w_k = torch.stack([k0, k1]).reshape(GROUPS * HEAD_DIM, HIDDEN)
    q_energy, k_cov = rope.pair_energies(w_q, w_k, None, HEADS, GROUPS, HEAD_DIM)
    assert k_cov.real[:, 0, 1].abs().max() < 1e-9 < k_cov.imag[:, 0, 1].abs().min()
    phase = torch.zeros(HEADS, HALF, dtype=torch.complex128)  # every pair's rotation matters fully
    left = {}
    for strategy in ("attention", "high"):
        plan = rope.plan_rope(2 * HALF, strategy, True, HEADS, GROUPS, HEAD_DIM, q_energy, k_cov, phase)
        _, _, k_nope = rope.split_rope(plan, w_q, w_k, HEADS, GROUPS, HEAD_DIM)
        left[strategy] = float(k_nope.pow(2).sum() / w_k.pow(2).sum())
    assert left["attention"] < 1e-12
    assert left["high"] == pytest.approx(0.5, abs=1e-9)
