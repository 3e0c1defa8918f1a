"""A latent basis made to be block-quantized, folded into the weights exactly.

The cached latent c = W_a x (kv_a_proj's first d_c rows) is read only through kv_b_proj (W_b c: each group's nope key
and value), so any invertible T changes nothing in exact arithmetic: cache c' = T c, read it with W_b T^-1. A block
cache type (mla_convert.kvquant) adds an error e to c' that reaches the model as W_b T^-1 e, and e is about as large
as the values sharing its block. So T decides what a 4-bit cache costs:

- `rotation`: T = Q, a seeded random orthogonal matrix. Every channel then carries a share of every direction, so no
  block holds one large direction beside small ones; the error stays as large in the directions that matter least as
  in those that matter most.
- `balanced`: T = Q M, where M makes the latent's second moment Sigma = E[c c^T] and the error's cost
  G (E|change of the layer's output|^2 = e^T G e) equal, M Sigma M^T = M^-T G M^-1 = Lambda^1/2 (the eigenvalues of
  Sigma G). This is the basis in which an error of a given size costs the least for the spread of values it has to
  cover (tr(M Sigma M^T) tr(M^-T G M^-1) at its minimum, (sum sqrt(eig(Sigma G)))^2), then Q spreads it evenly.
  G sums over the heads the value error through o_proj and the score error through the nope query's second moment,
  weighted by the spread of the head's values the score moves between (`_error_cost`).
  The rope key takes the same balance pair by pair (`rope_scales`: a scale per RoPE pair, its inverse in the query;
  a pair's rotation commutes with it), since no rotation may mix its pairs.

Both are measured, not assumed: docs/decisions.md#latent-basis-for-quantized-caches.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


BASES = ("native", "rotation", "balanced")


def random_orthogonal(n: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))  # a uniformly drawn orthogonal matrix (Haar), fixed by the seed


def _heads(attn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W_uk [G, d_n, d_c], W_uv [G, d_v, d_c], W_o [H, D, d_v]) of one attention, in float64."""
    d_n, d_v, d_c = attn.qk_nope_head_dim, attn.v_head_dim, attn.kv_lora_rank
    w_b = attn.kv_b_proj.weight.detach().double().view(attn.groups, d_n + d_v, d_c)
    w_o = attn.o_proj.weight.detach().double().view(-1, attn.num_heads, d_v).transpose(0, 1)
    return w_b[:, :d_n], w_b[:, d_n:], w_o


def _error_cost(attn, sigma: torch.Tensor, query_moment: torch.Tensor) -> torch.Tensor:
    """G [d_c, d_c]: the squared change of the attention's output per latent error e is about e^T G e, summed over
    heads: the value error through W_o W_uv, and the score error (q_nope . W_uk e, times the softmax scale) times the
    spread of the values it shifts weight between, tr(W_o W_uv Sigma W_uv^T W_o^T)."""
    w_uk, w_uv, w_o = _heads(attn)
    cost = torch.zeros_like(sigma)
    for h in range(attn.num_heads):
        g = h // attn.per_group
        out = w_o[h] @ w_uv[g]  # [D, d_c]
        spread = torch.trace(out @ sigma @ out.T)
        cost += out.T @ out + attn.scaling**2 * spread * (w_uk[g].T @ query_moment[h] @ w_uk[g])
    return cost


def _sqrt_psd(a: torch.Tensor, floor: float) -> tuple[torch.Tensor, torch.Tensor]:
    vals, vecs = torch.linalg.eigh((a + a.T) / 2)
    vals = vals.clamp_min(floor * vals.max().clamp_min(1e-300))
    return vecs * vals.sqrt(), vecs / vals.sqrt()  # L (L L^T = a) and L^-T


def balanced_map(sigma: torch.Tensor, cost: torch.Tensor, floor: float = 1e-8) -> torch.Tensor:
    """M with M sigma M^T = M^-T cost M^-1 (both Lambda^1/2), from sigma = L L^T and L^T cost L = U Lambda U^T:
    M = Lambda^1/4 U^T L^-1. Eigenvalues below `floor` times the largest are raised to it (a latent direction that
    never varies, or one nothing reads)."""
    root, inv_root_t = _sqrt_psd(sigma, floor)
    inner = root.T @ cost @ root
    lam, u = torch.linalg.eigh((inner + inner.T) / 2)
    lam = lam.clamp_min(floor * lam.max().clamp_min(1e-300))
    return lam.pow(0.25)[:, None] * (u.T @ inv_root_t.T)


@torch.no_grad()
def latent_moments(model, windows: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Per layer (E[c c^T] [d_c, d_c], each head's E[q_nope q_nope^T] [H, d_n, d_n], the rope key's pair energies
    E[|k_r,j|^2] [d_r/2], each head's rope query pair energies [H, d_r/2]) over token windows [W, T], in float64, from
    one forward per window (the model's own latents and queries, before any cache type)."""
    layers = [layer.self_attn for layer in model.model.layers]
    if any(attn.qk_norm for attn in layers):
        raise ValueError("the balanced basis reads the nope query from q_proj, which a qk-norm layer normalizes after")
    sums: list[list] = [[0.0, 0.0, 0.0, 0.0] for _ in layers]
    hooks = []
    for i, attn in enumerate(layers):
        d_c, d_n, d_r = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim

        def latent_hook(module, args, out, i=i, d_c=d_c, d_r=d_r):
            c = out[..., :d_c].reshape(-1, d_c).double()
            sums[i][0] = sums[i][0] + c.T @ c
            sums[i][2] = sums[i][2] + _pair_energy(out[..., d_c:].reshape(-1, d_r).double()).sum(0)

        def query_hook(module, args, out, i=i, d_n=d_n, d_r=d_r):
            q = out.reshape(-1, out.shape[-1] // (d_n + d_r), d_n + d_r).double()  # [N, H, d_n+d_r]
            sums[i][1] = sums[i][1] + torch.einsum("nhd,nhe->hde", q[..., :d_n], q[..., :d_n])
            sums[i][3] = sums[i][3] + _pair_energy(q[..., d_n:]).sum(0)  # [H, d_r/2]

        hooks += [attn.kv_a_proj.register_forward_hook(latent_hook), attn.q_proj.register_forward_hook(query_hook)]
    try:
        for window in windows:
            model(input_ids=window[None], use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    count = windows.numel()
    return [tuple(part / count for part in layer) for layer in sums]


def _pair_energy(x: torch.Tensor) -> torch.Tensor:
    """[..., d_r] in rotate_half layout (pair j at dims j and j + d_r/2) -> each pair's squared norm [..., d_r/2],
    which RoPE's rotation leaves unchanged."""
    half = x.shape[-1] // 2
    return x[..., :half] ** 2 + x[..., half:] ** 2


def basis_maps(model, basis: str, moments=None, seed: int = 0) -> list[torch.Tensor]:
    """One map T [d_c, d_c] (float64) per layer for `basis` (see the module's docstring)."""
    if basis not in BASES:
        raise ValueError(f"unknown latent basis {basis!r}: use one of {', '.join(BASES)}")
    maps = []
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        d_c = attn.kv_lora_rank
        if basis == "native":
            maps.append(torch.eye(d_c, dtype=torch.float64))
            continue
        q = random_orthogonal(d_c, seed + i)
        if basis == "rotation":
            maps.append(q)
            continue
        sigma, query_moment = moments[i][:2]
        maps.append(q @ balanced_map(sigma, _error_cost(attn, sigma, query_moment)))
    return maps


def rope_scales(model, moments) -> list[torch.Tensor]:
    """Per layer a scale s_j [d_r/2] of each rope key pair (the query's pair j takes 1/s_j: the score is unchanged,
    and a pair's RoPE rotation commutes with a scale): s_j^4 = (what an error in pair j costs) / E[|k_r,j|^2], so that
    every pair's spread and cost are equal in its block, the balanced basis of the latent taken pair by pair."""
    scales = []
    for i, layer in enumerate(model.model.layers):
        _, _, key_energy, query_energy = moments[i]
        cost = query_energy.sum(0)  # the rope score error through every head's query (values' spread: a common factor)
        floor = 1e-12 * max(float(key_energy.max()), float(cost.max()), 1e-300)
        scales.append(((cost + floor) / (key_energy + floor)).pow(0.25))
    return scales


@torch.no_grad()
def fold_rope_scales(model, scales: list[torch.Tensor]) -> None:
    """Cache s_j k_r,j for every rope pair j: kv_a_proj's rope rows (and bias) by s, each head's rope query rows of
    q_proj (and bias) by 1/s. Exact in exact arithmetic."""
    for layer, s in zip(model.model.layers, scales):
        attn = layer.self_attn
        d_c, d_n, d_r = attn.kv_lora_rank, attn.qk_nope_head_dim, attn.qk_rope_head_dim
        both = torch.cat((s, s))  # rotate_half layout: pair j at dims j and j + d_r/2
        key_rows = slice(d_c, d_c + d_r)
        for p in (attn.kv_a_proj.weight, attn.kv_a_proj.bias):
            if p is not None:
                p[key_rows] = (p[key_rows].double() * (both[:, None] if p.dim() == 2 else both)).to(p.dtype)
        for p in (attn.q_proj.weight, attn.q_proj.bias):
            if p is not None:
                rows = p.view(attn.num_heads, d_n + d_r, *p.shape[1:])[:, d_n:]  # [H, d_r(, D)], a view
                factor = (1 / both).view(1, d_r, *([1] * (p.dim() - 1)))
                rows.copy_((rows.double() * factor).to(p.dtype))


@torch.no_grad()
def fold_maps(model, maps: list[torch.Tensor]) -> None:
    """Cache T c instead of c in every layer: kv_a_proj's latent rows (and bias) by T, kv_b_proj by T^-1. Exact in
    exact arithmetic; the weights keep their dtype (computed in float64)."""
    for layer, t in zip(model.model.layers, maps):
        attn = layer.self_attn
        if attn.qk_norm == "exact":
            raise ValueError("a latent basis cannot be folded into an exact qk-norm layer (its key is rebuilt from "
                             "the latent before a norm)")
        d_c = attn.kv_lora_rank
        a, b = attn.kv_a_proj, attn.kv_b_proj
        a.weight[:d_c] = (t @ a.weight[:d_c].double()).to(a.weight.dtype)
        if a.bias is not None:
            a.bias[:d_c] = (t @ a.bias[:d_c].double()).to(a.bias.dtype)
        b.weight.copy_((b.weight.double() @ torch.linalg.inv(t)).to(b.weight.dtype))


def apply_basis(model, basis: str, moments=None) -> None:
    """Fold `basis` into every layer of `model` (the balanced one with its rope key's pair scales); `moments` from
    `latent_moments` for the balanced basis."""
    fold_maps(model, basis_maps(model, basis, moments))
    if basis == "balanced":
        fold_rope_scales(model, rope_scales(model, moments))


def change_basis(model, basis: str, windows: torch.Tensor | None) -> float:
    """Fold `basis` into `model` (the balanced one fitted on `windows`, token ids [W, T]) and measure what it changed:
    the largest logit change over the largest logit on the first window (or 64 fixed ids without windows), in the
    model's arithmetic, with its latent read unquantized."""
    kind, model.config.latent_cache_type = getattr(model.config, "latent_cache_type", None), None
    check = windows[:1] if windows is not None else torch.arange(64)[None] % model.config.vocab_size
    with torch.no_grad():
        before = model(input_ids=check, use_cache=False).logits
        apply_basis(model, basis, latent_moments(model, windows) if basis == "balanced" else None)
        error = ((model(input_ids=check, use_cache=False).logits - before).abs().max() / before.abs().max()).item()
    model.config.latent_cache_type = kind
    return error


def rebase_in_place(folder: Path, windows: torch.Tensor | None) -> float:
    """Store the native checkpoint a conversion is writing in `folder` with its latent in the balanced basis fitted
    on `windows` (None: a seeded rotation, which needs no text), in place: its weight files are rewritten, the config
    keeps its latent_cache_type. -> `change_basis`'s measure in 32-bit arithmetic."""
    from transformers import AutoModelForCausalLM

    import mla_convert  # noqa: F401  (registers the MLA model with the Auto classes)

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, use_safetensors=True).eval()
    error = change_basis(model, "balanced" if windows is not None else "rotation", windows)
    dtype = json.loads((folder / "config.json").read_text()).get("dtype") or "float32"
    for old in [*folder.glob("*.safetensors"), *folder.glob("*.safetensors.index.json")]:
        old.unlink()  # this conversion's own shards, rewritten below
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return error


def cache_kept(config) -> float:
    """The share of its source's KV cache an MLA config keeps (elements per token, all layers)."""
    return config.kv_cache_elements_per_token() / (2 * config.num_key_value_heads * config.head_dim
                                                   * config.num_hidden_layers)
