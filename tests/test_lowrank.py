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
