"""Low-rank factorization of the stacked nope-key / value maps: `W [m, D] ~= W_up [m, r] @ W_down [r, D]`.

All methods share one solver. For an input covariance `C = E[x x^T]` (identity: weight-only) and an invertible row
weighting `A` (identity: plain), the rank-r map minimizing `E||A (W - W_hat) x||^2` is `W_hat = A^-1 P A W`, where `P`
projects onto the top-r eigenvectors `U` of `A W C W^T A^T`. So `W_up = A^-1 U` and `W_down = U^T A W`: no inverse or
square root of `C` is needed, which keeps ill-conditioned covariances harmless. Solved in float64, returned float32.

A calibration covariance is often singular (few distinct tokens reach layer 0). A small ridge (RIDGE x its mean
diagonal) keeps every direction of W visible to the solver, so a full-rank factorization stays exact; it errs towards
weight-only SVD by that relative amount, far below calibration noise.
"""

from __future__ import annotations

import torch

from mla_convert.errors import UserError

METHODS = ("weight", "activation")
OBJECTIVES = ("kv", "attention", "scores")
RIDGE = 1e-4


def ridged(cov: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """cov + ridge x its mean diagonal x I (float64): every direction stays visible to a solver."""
    cov = cov.double()
    return cov + ridge * cov.diagonal().mean().clamp_min(1e-12) * torch.eye(cov.shape[0], dtype=cov.dtype)


def fit_up(w: torch.Tensor, down: torch.Tensor, cov: torch.Tensor) -> torch.Tensor:
    """The up-projection U [m, r] minimizing E||(W - U D) x||^2 for E[x x^T] = cov, given the down-projection D
    [r, D]: U = W C D^T (D C D^T)^-1 (a 1e-12 relative ridge only guards latent dims that D leaves empty). float64."""
    down, cov = down.double(), cov.double()
    gram = ridged(down @ cov @ down.T, 1e-12)  # [r, r]
    return torch.linalg.solve(gram, (w.double() @ cov @ down.T).T).T


def sqrtm_psd(sym: torch.Tensor, ridge: float = RIDGE) -> torch.Tensor:
    """Symmetric square root of a PSD matrix, with `ridge` x its mean eigenvalue added so that it is invertible."""
    sym = 0.5 * (sym.double() + sym.double().T)
    vals, vecs = torch.linalg.eigh(sym)
    vals = vals.clamp_min(0) + ridge * vals.clamp_min(0).mean().clamp_min(1e-30)
    return (vecs * vals.sqrt()) @ vecs.T


def bilinear_reduce(q_gram: torch.Tensor, k_gram: torch.Tensor, dims: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Narrow the scores q . k of n-dim queries and keys to `dims` dims: maps A [n, dims] and B [dims, n] (queries
    A^T q, keys B k) minimizing E[(q^T (I - A B) k)^2] for queries and keys of second moments q_gram and k_gram [n, n]
    taken as independent. With S_q = L_q^2 and S_k = L_k^2 (symmetric roots) the error is ||L_q (I - A B) L_k||_F^2,
    so A B = L_q^-1 [L_q L_k]_dims L_k^-1 (the truncated SVD U S V^T, split evenly: A = L_q^-1 U S^1/2, B = S^1/2 V^T
    L_k^-1). At dims = n, A B = I (exact for any ridge). Returns (A, B, the share of the score energy kept), float64."""
    root_q, root_k = sqrtm_psd(q_gram, 1e-9), sqrtm_psd(k_gram, 1e-9)
    u, s, vh = torch.linalg.svd(root_q @ root_k)
    half = s[:dims].sqrt()
    a = torch.linalg.solve(root_q, u[:, :dims]) * half
    b = half[:, None] * torch.linalg.solve(root_k, vh[:dims].T).T
    kept = float((s[:dims] ** 2).sum() / (s**2).sum().clamp_min(1e-300))
    return a, b, kept


def group_weight(grams: list[torch.Tensor]) -> torch.Tensor:
    """Block-diagonal row weighting from one PSD gram per kv group: blocks sqrt(gram_g)."""
    return torch.block_diag(*[sqrtm_psd(g) for g in grams])


def energy(w: torch.Tensor, cov: torch.Tensor | None, row_weight: torch.Tensor | None = None) -> float:
    """E||A W x||^2 = trace(A W C W^T A^T) (C = I when cov is None)."""
    aw = w.double() if row_weight is None else row_weight.double() @ w.double()
    return float((aw * aw).sum() if cov is None else ((aw @ cov.double()) * aw).sum())


def top_eigvecs(sym: torch.Tensor, rank: int) -> torch.Tensor:
    """The `rank` leading eigenvectors [m, rank] of a symmetric PSD matrix."""
    sym = 0.5 * (sym + sym.T)
    _, vecs = torch.linalg.eigh(sym)
    return vecs[:, -rank:].flip(-1) if rank else vecs[:, :0]


def factorize(
    w: torch.Tensor,
    rank: int,
    cov: torch.Tensor | None = None,
    row_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [m, D], cov [D, D] or None, row_weight [m, m] (invertible) or None -> (up [m, rank], down [rank, D])."""
    m, d = w.shape
    if not 0 <= rank <= min(m, d):
        raise UserError(f"rank {rank} is outside [0, {min(m, d)}] for a [{m} x {d}] map")
    w = w.double()
    aw = w if row_weight is None else row_weight.double() @ w
    if cov is not None:
        cov = ridged(cov)
    gram = aw @ (aw.T if cov is None else cov @ aw.T)  # [m, m]
    u = top_eigvecs(gram, rank)  # [m, r]
    down = u.T @ aw  # [r, D]
    up = u if row_weight is None else torch.linalg.solve(row_weight.double(), u)
    return up.float(), down.float()


def joint_or_split(
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    rank: int,
    split: bool,
    cov: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    v_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Factor the nope-key map w_k [mk, D] and value map w_v [mv, D] into one latent of `rank` dims.

    Joint: one factorization of the stacked map. Split: K and V each get half the latent (block-diagonal up map).
    Returns (up_k [mk, rank], up_v [mv, rank], down [rank, D]).
    """
    mk = w_k.shape[0]
    if not split:
        weight = None
        if k_weight is not None or v_weight is not None:
            weight = torch.block_diag(
                k_weight if k_weight is not None else torch.eye(mk, dtype=torch.float64),
                v_weight if v_weight is not None else torch.eye(w_v.shape[0], dtype=torch.float64),
            )
        up, down = factorize(torch.cat([w_k, w_v]), rank, cov, weight)
        return up[:mk], up[mk:], down
    rank_k = min(rank // 2, w_k.shape[0])
    rank_v = rank - rank_k
    up_k, down_k = factorize(w_k, rank_k, cov, k_weight)
    up_v, down_v = factorize(w_v, rank_v, cov, v_weight)
    zeros = torch.zeros
    up_k = torch.cat([up_k, zeros(up_k.shape[0], rank_v)], dim=1)
    up_v = torch.cat([zeros(up_v.shape[0], rank_k), up_v], dim=1)
    return up_k, up_v, torch.cat([down_k, down_v])


def joint_spectrum(
    w_k: torch.Tensor,
    w_v: torch.Tensor,
    cov: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    v_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """Eigenvalues (descending, float64) of the joint objective's gram A W C W^T A^T for W = [w_k; w_v]: keeping rank
    r leaves the sum of the eigenvalues past r as the error (`factorize`, same ridge)."""
    w = torch.cat([w_k, w_v]).double()
    if k_weight is not None or v_weight is not None:
        weight = torch.block_diag(
            k_weight if k_weight is not None else torch.eye(w_k.shape[0], dtype=torch.float64),
            v_weight if v_weight is not None else torch.eye(w_v.shape[0], dtype=torch.float64),
        )
        w = weight.double() @ w
    if cov is not None:
        cov = ridged(cov)
    gram = w @ (w.T if cov is None else cov @ w.T)
    return torch.linalg.eigvalsh(0.5 * (gram + gram.T)).flip(0).clamp_min(0)


def allocate_ranks(spectra: list[torch.Tensor], total: int, unit: int = 1, floor: int = 1, cap: int | None = None) -> list[int]:
    """Share `total` latent dims among layers: each layer's eigenvalues are scaled by its total (relative error), and
    the dims go, `unit` at a time, to the layer whose next `unit` eigenvalues remove the most relative error.

    Every rank is `floor` plus a multiple of `unit`, and at most `cap` (default: its spectrum's length); the ranks
    sum to `total` (which must exceed the floors by a multiple of `unit` and fit between the floors and caps)."""
    layers = len(spectra)
    caps = [floor + max(0, min(len(s), cap or len(s)) - floor) // unit * unit for s in spectra]
    if (total - layers * floor) % unit or not layers * floor <= total <= sum(caps) or any(
            floor > min(len(s), cap or len(s)) for s in spectra):
        raise ValueError(f"cannot share {total} dims among {layers} layers (unit {unit}, floor {floor}, caps {caps})")
    gains = []  # (relative error removed by the layer's next unit, layer, rank after it)
    for layer, s in enumerate(spectra):
        rel = s.double() / s.sum().clamp_min(1e-300)
        for start in range(floor, caps[layer], unit):
            gains.append((float(rel[start : start + unit].sum()), layer, start + unit))
    ranks = [floor] * layers
    # Each layer's relative eigenvalues decrease, so taking the largest units overall keeps every layer's units
    # contiguous from its floor (ties broken towards the lower rank).
    for _, layer, _ in sorted(gains, key=lambda g: (-g[0], g[2]))[: (total - layers * floor) // unit]:
        ranks[layer] += unit
    return ranks


def refine_shared(blocks: list[tuple], down: torch.Tensor, rounds: int = 3, cg_steps: int = 20) -> tuple[list, torch.Tensor]:
    """Alternating refinement of a shared down-projection when the blocks of the stacked map see different inputs.

    blocks: (w_b [m_b, D], row_weight_b [m_b, m_b] or None, cov_b [D, D] PD); objective
    sum_b E||A_b (W_b - U_b D) x_b||^2 with E[x_b x_b^T] = cov_b. Starting from `down` [r, D], each round takes every
    U_b = W_b C_b D^T (D C_b D^T)^-1 (least squares given D), then improves D given the U_b by conjugate gradient on
    sum_b M_b D C_b = sum_b N_b W_b C_b (M_b = U_b^T A_b^T A_b U_b, N_b = U_b^T A_b^T A_b), warm-started: no round
    increases the objective, and an exact start (full rank) stays exact. Returns ([U_b], D), float64.
    """
    d = down.double().clone()
    blocks = [(w.double(), None if a is None else a.double(), c.double()) for w, a, c in blocks]

    def ups(d):
        return [fit_up(w, d, c) for w, _, c in blocks]

    for _ in range(rounds):
        us = ups(d)
        ms, rhs = [], torch.zeros_like(d)
        for (w, a, c), u in zip(blocks, us):
            au = u if a is None else a @ u
            ms.append(au.T @ au)
            rhs += (au.T @ (w if a is None else a @ w)) @ c

        def apply(x):
            return sum(m @ x @ c for m, (_, _, c) in zip(ms, blocks))

        resid = rhs - apply(d)
        direction = resid.clone()
        norm = (resid * resid).sum()
        stop = 1e-20 * (rhs * rhs).sum()
        for _ in range(cg_steps):
            if norm <= stop:
                break
            step_dir = apply(direction)
            alpha = norm / (direction * step_dir).sum().clamp_min(1e-300)
            d += alpha * direction
            resid -= alpha * step_dir
            new_norm = (resid * resid).sum()
            direction = resid + (new_norm / norm) * direction
            norm = new_norm
    return ups(d), d
