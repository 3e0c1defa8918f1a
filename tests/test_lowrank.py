"""Low-rank solvers on small random problems."""

from __future__ import annotations

import torch

from mla_convert import lowrank


def _objective(blocks, ups, down):
    total = 0.0
    for (w, a, c), u in zip(blocks, ups):
        err = w - u @ down
        err = err if a is None else a @ err
        total += float(((err @ c) * err).sum())
    return total


def test_refine_shared_lowers_the_objective_when_blocks_see_different_inputs():
    gen = torch.Generator().manual_seed(0)
    dim, rank = 24, 6

    def pd(scale):
        a = torch.randn(dim, dim, generator=gen, dtype=torch.float64) * scale
        return a @ a.T / dim + 1e-3 * torch.eye(dim, dtype=torch.float64)

    w_k = torch.randn(10, dim, generator=gen, dtype=torch.float64)
    w_v = torch.randn(10, dim, generator=gen, dtype=torch.float64)
    token, attended = pd(1.0), pd(torch.logspace(0, -2, dim, dtype=torch.float64))  # values see a different spread
    up_k, up_v, down = lowrank.joint_or_split(w_k, w_v, rank, False, token)
    blocks = [(w_k, None, token), (w_v, 2 * torch.eye(10, dtype=torch.float64), attended)]
    start = _objective(blocks, [up_k.double(), up_v.double()], down.double())
    one = _objective(blocks, *lowrank.refine_shared(blocks, down, rounds=1))
    three = _objective(blocks, *lowrank.refine_shared(blocks, down, rounds=3))
    assert three <= one < 0.9 * start


def test_refine_shared_keeps_an_exact_factorization_exact():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(8, 5, generator=gen, dtype=torch.float64) @ torch.randn(5, 12, generator=gen, dtype=torch.float64)
    up, down = lowrank.factorize(w, 5)
    c = torch.eye(12, dtype=torch.float64)
    ups, refined = lowrank.refine_shared([(w[:4], None, c), (w[4:], None, 3 * c)], down, rounds=2)
    torch.testing.assert_close(torch.cat(ups) @ refined, w, rtol=1e-7, atol=1e-7)


def _psd(gen, dim, rank=None):
    a = torch.randn(dim, rank or dim, generator=gen, dtype=torch.float64)
    return a @ a.T


def test_bilinear_reduce_is_exact_at_full_width_and_where_the_keys_span_fewer_dims():
    gen = torch.Generator().manual_seed(1)
    q_gram = _psd(gen, 12)
    a, b, kept = lowrank.bilinear_reduce(q_gram, _psd(gen, 12), 12)
    assert torch.allclose(a @ b, torch.eye(12, dtype=torch.float64), atol=1e-8) and kept == 1.0
    # keys confined to 5 dims (a latent of rank 5): 5 dims of score carry every q . k exactly
    basis = torch.randn(12, 5, generator=gen, dtype=torch.float64)
    a, b, kept = lowrank.bilinear_reduce(q_gram, basis @ _psd(gen, 5) @ basis.T, 5)
    q, k = torch.randn(7, 12, generator=gen, dtype=torch.float64), torch.randn(9, 5, generator=gen, dtype=torch.float64) @ basis.T
    assert torch.allclose((q @ a) @ (k @ b.T).T, q @ k.T, rtol=1e-6, atol=1e-6) and kept > 1 - 1e-9


def test_bilinear_reduce_error_is_what_it_drops_and_beats_keeping_coordinates():
    """At width d < n the expected squared score error is the dropped singular values' energy, below what keeping
    the d best-scoring coordinates of q and k leaves."""
    gen = torch.Generator().manual_seed(2)
    n, d = 10, 4
    q_gram, k_gram = _psd(gen, n), _psd(gen, n)
    a, b, kept = lowrank.bilinear_reduce(q_gram, k_gram, d)

    def error(m):  # E[(q^T (I - M) k)^2] for independent q, k of these second moments
        e = torch.eye(n, dtype=torch.float64) - m
        return float(torch.trace(e.T @ q_gram @ e @ k_gram))

    total = float(torch.trace(q_gram @ k_gram))
    assert abs(error(a @ b) - (1 - kept) * total) < 1e-6 * total
    coords = torch.diagonal(q_gram) * torch.diagonal(k_gram)
    keep = torch.zeros(n, dtype=torch.float64)
    keep[coords.topk(d).indices] = 1
    assert error(a @ b) < error(torch.diag(keep))
