"""RoPE: source frequencies, which frequency pairs keep their rotation, and merging pairs across kv heads.

Layout facts (Hugging Face "rotate_half"): inside a head of `d_h` dims, frequency `i` in `[0, d_h/2)` rotates dims
`i` and `i + d_h/2`; `i = 0` is the fastest rotation.

A *rope plan* says, for one layer, which (component, frequency) pairs keep RoPE in the shared rope key:

- Per frequency `i`, the G kv heads' pairs (complex numbers z_g = x_{g,i} + j x_{g,i+d_h/2}) are re-expressed in a
  basis: components `c_m = sum_g mix[i][m, g] z_g` and back `z_g = sum_m basis[i][g, m] c_m` (basis = mix^-1).
  Every kv head's pair `i` rotates by the same angle, so any complex mix commutes with RoPE; the query of head `h`
  (kv group `g`) meets component `m` as `conj(basis[i][g, m]) z_q`. Without merging the basis is the identity
  (component `m` is kv head `m`); TransMLA-style merging takes the real PCA of the key pairs (orthogonal mix); the
  "attention" strategy takes the complex basis that minimizes the score variance lost (`plan_rope`).
- `kept` lists the (m, i) pairs that keep their rotation, in the order of the rope key's pairs.

Everything else (the part of each kv head's key not carried by a kept pair) becomes position-free "nope" key.

Dropping the rotation of a pair: in complex form (z = x_i + j x_{i+d_h/2}) a pair's score is Re(z_q conj(z_k) e^{j theta d})
for a key d positions back. Without rotation the best fixed stand-in for e^{j theta d} is its expectation under the
head's attention over distances, `phase = E_p[e^{j theta d}]` (`attention_phases`): slow pairs keep |phase| ~ 1 (an
unrotated pair is nearly right), fast pairs average out (|phase| ~ 0: the unrotated pair would be noise). Multiplying
the query pair by `phase` (`apply_phases`) is that substitution, and `1 - |phase|^2` is the fraction of the pair's
score variance lost by dropping it: the "attention" strategy keeps the pairs that would lose most.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_convert.errors import UserError

STRATEGIES = ("high", "low", "uniform", "2-norm", "attention")


def per_type_rope(config) -> bool:
    """Whether a config gives RoPE parameters per layer type (Gemma 3: `rope_parameters` = {"full_attention": {...},
    "sliding_attention": {...}}, two bases)."""
    rope = getattr(config, "rope_parameters", None)
    return isinstance(rope, dict) and isinstance(rope.get("full_attention"), dict)


def layer_type(config, layer: int) -> str:
    """"sliding_attention" or "full_attention": the config's `layer_types` entry, else full."""
    types = getattr(config, "layer_types", None)
    return types[layer] if types else "full_attention"


def rope_config(config, kind: str = "full_attention"):
    """`config` with the RoPE parameters of layer type `kind` (a shallow copy where they are given per type; else
    `config` itself): what a Llama rotary embedding of that layer type is built from."""
    if not per_type_rope(config):
        return config
    import copy

    out = copy.copy(config)
    out.rope_parameters = dict(config.rope_parameters[kind])
    return out


def source_frequencies(config) -> tuple[torch.Tensor, float]:
    """The source's inverse frequencies [d_h/2] (float64, after its RoPE type's scaling) and the attention scaling its
    RoPE type applies to cos/sin. The conversion and the DeepSeek export (rope_fit.py) both read them here."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.double(), float(rotary.attention_scaling)


@dataclass
class RopePlan:
    mix: torch.Tensor  # [d_h/2, G(m), G(g)] complex128: component m of frequency i = sum_g mix[i, m, g] z_g
    kept: list[tuple[int, int]]  # (component m, frequency i), one per rope-key pair
    basis: torch.Tensor | None = None  # [d_h/2, G(g), G(m)] complex128, mix^-1 (None: mix^H, a unitary mix)

    def __post_init__(self):
        self.mix = self.mix.to(torch.complex128)
        self.basis = self.mix.conj().transpose(-1, -2) if self.basis is None else self.basis.to(torch.complex128)

    @property
    def rope_dims(self) -> int:
        return 2 * len(self.kept)

    @property
    def frequencies(self) -> list[int]:
        return [i for _, i in self.kept]


def pair_energies(w_q: torch.Tensor, w_k: torch.Tensor, cov: torch.Tensor | None, heads: int, groups: int, head_dim: int):
    """Second moments of the query and key pairs from the (augmented) input covariance.

    w_q [H*d_h, D'], w_k [G*d_h, D'] (D' = D, or D+1 with the bias as last column to match an augmented `cov`);
    cov [D', D'] = E[x x^T] (None: identity, a weight-only proxy).
    Returns q_energy [H, d_h/2] = E|z_{q,h,i}|^2 and k_cov [d_h/2, G, G] complex128 = E[z_{g,i} conj(z_{g',i})]
    (z = the pair as a complex number; the real part is the dot product of the two pairs).
    """
    half = head_dim // 2
    wq = w_q.double().view(heads, 2, half, -1)  # [H, 2 (dims i and i+half), d_h/2, D']
    wk = w_k.double().view(groups, 2, half, -1)
    cq = wq if cov is None else wq @ cov.double()
    ck = wk if cov is None else wk @ cov.double()
    q_energy = (cq * wq).sum(dim=(1, 3))  # [H, d_h/2]
    real = torch.einsum("gcid,ecid->ige", ck, wk)  # E[x_g x_e + y_g y_e]
    imag = torch.einsum("gid,eid->ige", ck[:, 1], wk[:, 0]) - torch.einsum("gid,eid->ige", ck[:, 0], wk[:, 1])
    return q_energy, torch.complex(real, imag)  # [d_h/2, G, G]: E[y_g x_e - x_g y_e] is the imaginary part


def attention_phases(profile: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """profile [H, T] (attention weight per distance, from calibration), inv_freq [d_h/2] -> phase [H, d_h/2] complex128:
    E_p[e^{j theta_i d}] per query head and frequency."""
    distance = torch.arange(profile.shape[1], dtype=torch.float64)
    angle = inv_freq.double()[:, None] * distance[None, :]  # [d_h/2, T]
    return torch.complex(profile.double() @ angle.cos().T, profile.double() @ angle.sin().T)


def apply_phases(w_q: torch.Tensor, phase: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Multiply every query pair by its complex phase: w_q [H*d_h, D'] -> [H*d_h, D'] (rotate_half layout)."""
    half = head_dim // 2
    wq = w_q.double().view(heads, 2, half, -1)
    re, im = phase.real[:, :, None], phase.imag[:, :, None]  # [H, d_h/2, 1]
    out = torch.stack([re * wq[:, 0] - im * wq[:, 1], im * wq[:, 0] + re * wq[:, 1]], dim=1)
    return out.reshape(heads * head_dim, -1)


def _ordered(strategy: str, half: int, count: int) -> list[int]:
    """`count` frequency indices in [0, half) for a data-free strategy."""
    if strategy == "high":
        return list(range(count))
    if strategy == "low":
        return list(range(half - count, half))
    if strategy == "uniform":  # every (half/count)-th pair starting at the fastest: a geometric set
        return sorted({int(k * half / count) for k in range(count)})
    raise ValueError(strategy)


def plan_rope(
    rope_dims: int,
    strategy: str,
    merge: bool,
    heads: int,
    groups: int,
    head_dim: int,
    q_energy: torch.Tensor | None = None,
    k_cov: torch.Tensor | None = None,
    phase: torch.Tensor | None = None,
) -> RopePlan:
    """Choose the kept pairs of one layer. `q_energy`/`k_cov` (from `pair_energies`) are needed for 2-norm, attention
    and merging; `phase` [H, d_h/2] (from `attention_phases`) for attention."""
    half = head_dim // 2
    pairs = rope_dims // 2
    if rope_dims % 2 or not 0 <= rope_dims <= groups * head_dim:
        raise UserError(f"--rope-dims must be even and at most {groups * head_dim} (kv heads x head_dim), got {rope_dims}")
    if strategy not in STRATEGIES:
        raise UserError(f"--rope-strategy must be one of {', '.join(STRATEGIES)}, got {strategy}")
    group_of = torch.arange(heads) // (heads // groups)
    if strategy == "attention":
        if q_energy is None or k_cov is None or phase is None:
            raise ValueError("the attention strategy needs query/key statistics and attention phases")
        loss = q_energy * (1 - phase.abs() ** 2).clamp_min(0)  # [H, d_h/2]: query energy lost per pair if dropped
    if merge:
        if k_cov is None:
            raise ValueError("merging needs key statistics")
        k_cov = k_cov.to(torch.complex128)
        if strategy == "attention":
            return _attention_merge(k_cov, loss, group_of, groups, pairs)
        # TransMLA's RoRoPE: a real PCA across kv heads per frequency, components sorted by key energy, largest first.
        evals, evecs = torch.linalg.eigh(k_cov.real)  # ascending, [half, G], [half, G, G]
        mix = evecs.flip(-1).transpose(-1, -2).contiguous()  # [half, G(m), G(g)], orthogonal
        if strategy == "2-norm":
            k_energy = evals.flip(-1).clamp_min(0).sqrt()  # [half, G(m)]
            q_norm = q_energy.clamp_min(0).sqrt()  # [H, half]
            # query of head h on component m: |mix[i][m, g(h)]| * ||q_{h,i}||, summed over heads
            q_comp = torch.einsum("img,hg,hi->im", mix.abs(), torch.nn.functional.one_hot(group_of, groups).double(), q_norm)
            score = (k_energy * q_comp).T.reshape(-1)  # [G*half], index m*half + i
            top = sorted(torch.topk(score, pairs).indices.tolist())
            kept = [(t // half, t % half) for t in top]
        else:
            kept = []
            for m in range(groups):
                take = min(half, pairs - len(kept))
                if take <= 0:
                    break
                kept += [(m, i) for i in _ordered(strategy, half, take)]
        return RopePlan(mix=mix, kept=kept)
    # Without merging each kv head keeps the same number of its own pairs.
    if pairs % groups:
        raise UserError(
            f"--rope-dims {rope_dims} without --rope-merge must be a multiple of 2 x kv heads ({2 * groups}); "
            "pass --rope-merge or change --rope-dims"
        )
    per_head = pairs // groups
    mix = torch.eye(groups, dtype=torch.float64).expand(half, groups, groups).contiguous()
    kept = []
    for g in range(groups):
        if strategy == "2-norm":
            if q_energy is None or k_cov is None:
                raise ValueError("2-norm needs query/key statistics")
            q_norm = q_energy[group_of == g].clamp_min(0).sqrt().sum(0)  # [half]
            score = q_norm * k_cov[:, g, g].real.clamp_min(0).sqrt()
            kept += [(g, i) for i in sorted(torch.topk(score, per_head).indices.tolist())]
        elif strategy == "attention":
            score = loss[group_of == g].sum(0) * k_cov[:, g, g].real.clamp_min(0)
            kept += [(g, i) for i in sorted(torch.topk(score, per_head).indices.tolist())]
        else:
            kept += [(g, i) for i in _ordered(strategy, half, per_head)]
    return RopePlan(mix=mix, kept=kept)


def _attention_merge(k_cov: torch.Tensor, loss: torch.Tensor, group_of: torch.Tensor, groups: int, pairs: int) -> RopePlan:
    """The merge that loses least score variance, and the pairs it keeps.

    Model: dropping component m of frequency i replaces its rotation by the expected one, losing (per query head h of
    group g) E|query on m|^2 E|c_m|^2 (1 - |phase_{h,i}|^2). With D_i = diag over groups of w_g = sum_{h in g}
    E|z_{q,h,i}|^2 (1 - |phase_{h,i}|^2) and uncorrelated components, the loss of a basis is sum over dropped m of
    E|c_m|^2 sum_g w_g |basis[g, m]|^2, minimized by the eigenvectors V of D^1/2 C_i D^1/2 (C_i the complex key
    covariance): c = V^H D^1/2 z, basis = D^-1/2 V, and the loss of dropping m is its eigenvalue. Exact at full rope
    (any invertible basis is); with one kv group (MHA) or uniform weights it is the complex PCA of the keys.
    """
    half = k_cov.shape[0]
    weight = torch.zeros(half, groups, dtype=torch.float64).index_add_(1, group_of, loss.T.double())  # [half, G]
    weight = weight.clamp_min(1e-9 * float(weight.max().clamp_min(1e-300)))  # every group stays invertible
    root = weight.sqrt()  # [half, G]
    scaled = root[:, :, None] * k_cov * root[:, None, :]  # D^1/2 C D^1/2, [half, G, G] Hermitian
    evals, evecs = torch.linalg.eigh(scaled)  # ascending
    evals, evecs = evals.flip(-1), evecs.flip(-1)  # [half, G(m)], [half, G(g), G(m)]
    mix = evecs.conj().transpose(-1, -2) * root[:, None, :]  # [half, G(m), G(g)]: V^H D^1/2
    basis = evecs / root[:, :, None]  # [half, G(g), G(m)]: D^-1/2 V
    score = evals.clamp_min(0).T.reshape(-1)  # [G*half], index m*half + i
    kept = [(t // half, t % half) for t in sorted(torch.topk(score, pairs).indices.tolist())]
    return RopePlan(mix=mix, kept=kept, basis=basis)


def split_rope(plan: RopePlan, w_q: torch.Tensor, w_k: torch.Tensor, heads: int, groups: int, head_dim: int):
    """Apply a rope plan to one layer's q/k maps (weights, or weights with the bias as an extra column).

    w_q [H*d_h, D'], w_k [G*d_h, D'] -> (
        q_rope [H, d_r, D']: per head, rotate_half layout over the kept pairs,
        k_rope [d_r, D']: the shared rope key, same layout,
        k_nope [G*d_h, D']: each kv head's key with the kept components removed (unrotated),
    )
    """
    half = head_dim // 2
    n = len(plan.kept)
    wq = w_q.double().view(heads, 2, half, -1)
    wk = w_k.double().view(groups, 2, half, -1)
    zq = torch.complex(wq[:, 0], wq[:, 1])  # [H, half, D']
    zk = torch.complex(wk[:, 0], wk[:, 1])  # [G, half, D']
    group_of = torch.arange(heads) // (heads // groups)
    q_rope = torch.zeros(heads, n, wq.shape[-1], dtype=torch.complex128)
    k_rope = torch.zeros(n, wk.shape[-1], dtype=torch.complex128)
    z_nope = zk.clone()
    for j, (m, i) in enumerate(plan.kept):
        comp = plan.mix[i, m] @ zk[:, i]  # [D']: component m of frequency i
        k_rope[j] = comp
        z_nope[:, i] -= plan.basis[i, :, m, None] * comp
        q_rope[:, j] = plan.basis[i, group_of, m].conj()[:, None] * zq[:, i]
    q_rope = torch.stack([q_rope.real, q_rope.imag], dim=1)  # [H, 2, n, D']: rotate_half layout
    k_rope = torch.stack([k_rope.real, k_rope.imag])  # [2, n, D']
    k_nope = torch.stack([z_nope.real, z_nope.imag], dim=1)  # [G, 2, half, D']
    return q_rope.reshape(heads, 2 * n, -1), k_rope.reshape(2 * n, -1), k_nope.reshape(groups * head_dim, -1)
