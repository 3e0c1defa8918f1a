"""The per-layer method: one layer's source attention -> MLA attention tensors (RoPE split, joint low-rank K/V with
the calibration statistics, the narrowed nope key) and the spectrum the rank allocation shares dims by.

state flow of a layer: source tensors -> [calibration statistics] -> RoPE plan -> split q/k into rope and nope parts
-> low-rank factorization of [k_nope; v] -> MLA tensors
"""

from __future__ import annotations

import logging

import torch

from mla_convert import lowrank, rope
from mla_convert.conversion.options import ConvertOptions
from mla_convert.conversion.plan import Plan
from mla_convert.errors import UserError

log = logging.getLogger(__name__)


def convert_attention(
    tensors: dict[str, torch.Tensor],
    plan: Plan,
    layer: int,
    options: ConvertOptions,
    attention_scaling: float,
    cov: torch.Tensor | None,
    phase: torch.Tensor | None = None,
    attended: torch.Tensor | None = None,
    keyed: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One layer's source attention -> MLA attention tensors.

    tensors: {"q", "k", "v", "o"} weights and optional {"q_bias", "k_bias", "v_bias", "o_bias"} (float32);
    cov: augmented input second moment [D+1, D+1] (None: weight-only proxies);
    phase: [H, d_h/2] complex E[e^{j theta d}] under each head's attention (None: dropped pairs stay unrotated);
    attended: [G, D+1, D+1] second moment of the attention-averaged inputs per kv group (None: values are fit on
    token inputs like keys). Given the latent, each group's value up-projection is then the least-squares map on the
    inputs values are consumed through: U_v = W_v C~ D^T (D C~ D^T)^-1 (exact at full rank, as any left inverse);
    keyed: [D+1, D+1] second moment of the inputs weighted by the attention each token's key receives (None: `cov`),
    the input statistics of the low-rank factorization and of the key pairs in the RoPE merge.
    Returns ({"q_proj.weight", ...} named as in MLAAttention, rope frequency index of each rope-key pair, the share of
    the nope score energy the narrowed nope key keeps (None: not narrowed)).
    """
    heads, groups, head_dim, hidden = plan.heads, plan.groups, plan.head_dim, plan.hidden
    rank = plan.kv_lora_rank[layer]
    nope_kept = None
    maps = _layer_maps(tensors, plan, options, attention_scaling, cov, phase, keyed)
    k_nope, w_v = maps["k_nope"], maps["v"]
    up_k, up_v, down = lowrank.joint_or_split(
        k_nope[:, :hidden], w_v[:, :hidden], rank, options.factorization == "split", *maps["objective"]
    )
    if attended is not None and options.factorization == "joint":
        covs = _attended_covs(attended[:, :hidden, :hidden], maps["objective"][0], hidden)
        if options.latent_rounds:
            up_k, up_v, down = _refine_latent(
                k_nope[:, :hidden], w_v[:, :hidden], down, covs, maps["objective"], options.latent_rounds, head_dim
            )
        else:
            up_v = _attended_values(w_v[:, :hidden], down, covs, head_dim)
    up_k, k_bias = up_k.double().view(groups, head_dim, rank), k_nope[:, hidden].view(groups, head_dim)
    q_all, k_rope = maps["q"].view(heads, head_dim + plan.rope_dims, hidden + 1), maps["k_rope"]
    if plan.nope_dims < head_dim:
        q_all, up_k, k_bias, nope_kept = narrow_nope(q_all, up_k, k_bias, down, cov, plan, layer)
    kv_b = torch.cat([up_k, up_v.double().view(groups, head_dim, rank)], dim=1)
    kv_b_bias = torch.cat([k_bias, w_v[:, hidden].view(groups, head_dim)], dim=1)
    q_all = q_all.reshape(-1, hidden + 1)
    out = {
        "q_proj.weight": q_all[:, :hidden],
        "kv_a_proj.weight": torch.cat([down.double(), k_rope[:, :hidden]]),
        "kv_b_proj.weight": kv_b.reshape(groups * (plan.nope_dims + head_dim), rank),
        "o_proj.weight": tensors["o"],
    }
    if plan.qk_norm:  # the source's query and norm; per head to the nope and rope parts
        out["q_proj.weight"] = tensors["q"]
        out["q_norm.weight"] = tensors["q_norm"]
        out["q_head_proj.weight"] = maps["q_head"].reshape(heads * (head_dim + plan.rope_dims), head_dim)
        if plan.qk_norm == "exact":
            out.update({"k_norm.weight": tensors["k_norm"], "k_rope_up": maps["k_rope_up"],
                        "k_rope_down": maps["k_rope_down"]})  # fmt: skip
    if "q_bias" in tensors or "k_bias" in tensors:
        out["q_proj.bias"] = tensors.get("q_bias", torch.zeros(heads * head_dim)) if plan.qk_norm else q_all[:, hidden]
        out["kv_a_proj.bias"] = torch.cat([torch.zeros(rank, dtype=torch.float64), k_rope[:, hidden]])
        out["kv_b_proj.bias"] = kv_b_bias.reshape(-1)
    if "o_bias" in tensors:
        out["o_proj.bias"] = tensors["o_bias"]
    return {k: v.float() for k, v in out.items()}, maps["rope_plan"].frequencies, nope_kept


NOPE_KEPT_WARN = 0.98  # below what the default's layers keep (docs/decisions.md#nope-key-width)


def narrow_nope(q_all, up_k, k_bias, down, cov, plan: Plan, layer: int):
    """Each head's nope query and its group's nope key narrowed from head_dim to plan.nope_dims dims
    (`lowrank.bilinear_reduce` per kv group: the group's heads' nope queries under the calibration inputs against
    the keys the latent gives). q_all [H, d_h + d_r, D+1] (nope rows first), up_k [G, d_h, d_c], k_bias [G, d_h] ->
    the same with d_n nope dims, and the share of the nope score energy kept (the smallest of the groups')."""
    heads, groups, head_dim, hidden, d_n = plan.heads, plan.groups, plan.head_dim, plan.hidden, plan.nope_dims
    per = heads // groups
    q_nope = q_all[:, :head_dim]  # [H, d_h, D+1]
    q_gram = _group_query_grams(q_nope, cov, plan)
    # the latent's second moment under the inputs (weight-only: unit inputs)
    x_cov = torch.eye(hidden, dtype=torch.float64) if cov is None else cov[:hidden, :hidden].double()
    latent_cov = down.double() @ x_cov @ down.double().T
    queries, keys, biases, kept = [], [], [], []
    for g in range(groups):
        a, b, share = lowrank.bilinear_reduce(q_gram[g], up_k[g] @ latent_cov @ up_k[g].T, d_n)
        queries.append(torch.einsum("nd,hnx->hdx", a, q_nope[g * per : (g + 1) * per]))
        keys.append(b @ up_k[g])
        biases.append(b @ k_bias[g])
        kept.append(share)
    if min(kept) < NOPE_KEPT_WARN:
        log.warning("the %d-dim nope query/key keeps %.1f%% of layer %d's nope score energy: --nope-dims %d keeps all",
                    d_n, 100 * min(kept), layer, head_dim)
    q_all = torch.cat([torch.cat(queries), q_all[:, head_dim:]], dim=1)  # [H, d_n + d_r, D+1]
    return q_all, torch.stack(keys), torch.stack(biases), min(kept)


def _attended_covs(attended, token_cov, dim: int, blend: float = 0.05) -> list[torch.Tensor]:
    """Per kv group, the input second moment a value map is judged on: the attended inputs' (trace-normalized) plus
    `blend` x the token inputs' and the factorization's ridge, scaled to the token inputs' trace. Attended inputs from a
    small calibration set are often rank-deficient (layer 0 sees few distinct tokens); the token term keeps every
    direction of W_v determined, so full rank stays exact.

    Computed in place in `attended` (float64; a layer's statistics are used once): at 8B shapes each group's matrix is
    134 MB, and a second set of them would be the largest part of the layer's working set."""
    token = torch.eye(dim, dtype=torch.float64) if token_cov is None else token_cov.double()
    scale = token.diagonal().sum().clamp_min(1e-300)
    mixed = blend * token / scale
    covs = []
    for a in attended:  # = lowrank.ridged(a / trace(a) + mixed) * scale, without the copies
        a = a.double()
        a.div_(a.diagonal().sum().clamp_min(1e-300)).add_(mixed)
        a.diagonal().add_(lowrank.RIDGE * a.diagonal().mean().clamp_min(1e-12))
        covs.append(a.mul_(scale))
    return covs


def _attended_values(w_v, down, covs: list[torch.Tensor], head_dim: int):
    """Per kv group, the value up-projection [d_h, r] minimizing E||(W_v - U D) x~||^2 under the group's `covs`."""
    return torch.cat([lowrank.fit_up(w_v[g * head_dim : (g + 1) * head_dim], down, c) for g, c in enumerate(covs)]).float()


def _refine_latent(k_nope, w_v, down, covs, objective, rounds: int, head_dim: int):
    """The shared latent refined for keys on their inputs and each group's values on its attended inputs
    (`lowrank.refine_shared`). Returns (up_k, up_v, down), float32."""
    x_cov, k_weight, v_weight = objective
    token = lowrank.ridged(torch.eye(down.shape[1], dtype=torch.float64) if x_cov is None else x_cov)
    blocks = [(k_nope, k_weight, token)]
    for g, c in enumerate(covs):
        rows = slice(g * head_dim, (g + 1) * head_dim)
        blocks.append((w_v[rows], None if v_weight is None else v_weight[rows, rows], c))
    ups, down = lowrank.refine_shared(blocks, down, rounds=rounds)
    return ups[0].float(), torch.cat(ups[1:]).float(), down.float()


def layer_spectrum(
    tensors, plan: Plan, options: ConvertOptions, attention_scaling: float, cov, phase=None, attended=None, keyed=None
) -> torch.Tensor:
    """The eigenvalues (descending) of one layer's joint low-rank objective: the error left at rank r is the sum of
    those past r. What `--rank-allocation energy` shares the latent dims by."""
    hidden = plan.hidden
    maps = _layer_maps(tensors, plan, options, attention_scaling, cov, phase, keyed)
    return lowrank.joint_spectrum(maps["k_nope"][:, :hidden], maps["v"][:, :hidden], *maps["objective"])


def _layer_maps(tensors, plan: Plan, options: ConvertOptions, attention_scaling: float, cov, phase, keyed=None) -> dict:
    """The maps a layer's factorization starts from: the RoPE plan applied to q/k (query with the rope and nope parts,
    the shared rope key, the nope key), the value map (weights with the bias as last column, float64), and the
    objective (input covariance, key and value row weights) that `lowrank.joint_or_split` takes."""
    heads, groups, head_dim, hidden = plan.heads, plan.groups, plan.head_dim, plan.hidden
    d_r = plan.rope_dims

    def aug(name: str, rows: int) -> torch.Tensor:  # [rows, D+1]: weight with the bias as last column
        bias = tensors.get(f"{name}_bias")
        bias = torch.zeros(rows) if bias is None else bias
        return torch.cat([tensors[name].double(), bias.double()[:, None]], dim=1)

    w_q, w_k, w_v = aug("q", heads * head_dim), aug("k", groups * head_dim), aug("v", groups * head_dim)
    w_k_cached = w_k  # the key map the latent and the rope key carry
    if plan.qk_norm:
        # Per-head norms: score = RoPE(w_q . q)·RoPE(w_k . k) / (rms(q) rms(k)). The pairs are chosen on the weighted
        # maps (1/rms is a per-token scale). "exact" caches the pre-norm key (the model normalizes it per token);
        # "calibrated" replaces rms(k) by its calibration value per kv group, a linear key cached like any other.
        # A norm over the whole projection (OLMo 2) has one weight per row already, and one RMS per token.
        whole = plan.qk_norm_scope == "projection"
        offset = 1.0 if plan.norm_unit_offset else 0.0  # Gemma 3's norms multiply by (1 + weight)
        w_q = w_q * (tensors["q_norm"].double() + offset).repeat(1 if whole else heads)[:, None]
        w_k = w_k * (tensors["k_norm"].double() + offset).repeat(1 if whole else groups)[:, None]
        if plan.qk_norm == "calibrated":
            rms_groups, rms_dim = (1, groups * head_dim) if whole else (groups, head_dim)
            w_k = w_k_cached = w_k / key_rms(w_k_cached, cov, rms_groups, rms_dim, plan.norm_eps).repeat_interleave(
                rms_dim)[:, None]
    if cov is None:
        q_energy, k_cov = rope.pair_energies(w_q[:, :hidden], w_k[:, :hidden], None, heads, groups, head_dim)
    else:
        q_energy, k_cov = rope.pair_energies(w_q, w_k, cov, heads, groups, head_dim)
        if keyed is not None:  # key pairs judged on the tokens whose keys get attended
            k_cov = rope.pair_energies(w_q, w_k, keyed, heads, groups, head_dim)[1]
    rope_plan = rope.plan_rope(
        d_r, options.rope_strategy, options.rope_merge, heads, groups, head_dim, q_energy, k_cov, phase
    )
    q_all, k_rope, k_nope = _split_maps(rope_plan, w_q, w_k_cached, plan, options, phase, attention_scaling)
    q_nope = q_all[:, :head_dim]  # [H, d_h, D+1]
    q_all = q_all.reshape(heads * (head_dim + d_r), hidden + 1)
    extra = {}
    if plan.qk_norm:  # the same maps on the normalized query and key: identities in, per-head / per-key maps out
        eye_q = torch.eye(head_dim, dtype=torch.float64).repeat(heads, 1)  # [H*d_h, d_h]
        eye_k = torch.eye(groups * head_dim, dtype=torch.float64)
        q_head, down, nope = _split_maps(rope_plan, eye_q, eye_k, plan, options, phase, attention_scaling)
        # nope = I - R K and K R = I, so R = (I - nope) K^T (K K^T)^-1
        up = torch.linalg.solve(down @ down.T, down @ (eye_k - nope).T).T
        extra = {"q_head": q_head, "k_rope_down": down, "k_rope_up": up}

    fit_cov = cov if keyed is None else keyed
    x_cov = None if (fit_cov is None or options.method == "weight") else fit_cov[:hidden, :hidden]
    k_weight, v_weight = _row_weights(options, q_nope, tensors["o"], cov, plan)
    if options.kv_balance is not None:
        e_k = lowrank.energy(k_nope[:, :hidden], x_cov, k_weight)
        e_v = lowrank.energy(w_v[:, :hidden], x_cov, v_weight)
        scale = (options.kv_balance * e_v / max(e_k, 1e-30)) ** 0.5
        eye = torch.eye(groups * head_dim, dtype=torch.float64)
        k_weight = scale * (eye if k_weight is None else k_weight)
    return {"q": q_all, "k_rope": k_rope, "k_nope": k_nope, "v": w_v, "rope_plan": rope_plan,
            "objective": (x_cov, k_weight, v_weight), **extra}  # fmt: skip


def _split_maps(rope_plan, w_q, w_k, plan: Plan, options: ConvertOptions, phase, attention_scaling: float):
    """A rope plan applied to query and key maps w_q [H*d_h, D'], w_k [G*d_h, D''] -> (the query per head: nope part,
    then rope part [H, d_h+d_r, D'], the shared rope key [d_r, D''], the nope key [G*d_h, D''])."""
    heads, groups, head_dim = plan.heads, plan.groups, plan.head_dim
    q_rope, k_rope, k_nope = rope.split_rope(rope_plan, w_q, w_k, heads, groups, head_dim)
    # Dims that lose their rotation also lose the RoPE type's cos/sin scaling (s on q and on k): keep it on the query.
    # A dropped pair's query takes the expected rotation under the head's attention (kept pairs meet no nope key).
    w_q_nope = w_q if phase is None or options.dropped_rope != "expected" else rope.apply_phases(w_q, phase, heads, head_dim)
    q_nope = w_q_nope.view(heads, head_dim, -1) * attention_scaling**2
    return torch.cat([q_nope, q_rope], dim=1), k_rope, k_nope


def key_rms(w_k: torch.Tensor, cov: torch.Tensor | None, groups: int, head_dim: int, eps: float) -> torch.Tensor:
    """Each kv group's key RMS over the calibration tokens, sqrt(E[mean_d k_d^2] + eps), from the augmented input
    second moment (w_k [G*d_h, D+1] with the bias as last column, cov [D+1, D+1]) -> [G] float64."""
    if cov is None:
        raise UserError("--qk-norm calibrated needs calibration statistics: pass --calib-data (or --qk-norm exact)")
    energy = ((w_k @ cov.double()) * w_k).sum(-1)  # E[k_d^2] per key dim, [G*d_h]
    return (energy.view(groups, head_dim).mean(-1) + eps).sqrt()


def _group_query_grams(q_nope: torch.Tensor, cov, plan: Plan) -> torch.Tensor:
    """Per kv group, the second moment of its heads' nope queries summed over them, sum_h E[q_h q_h^T] [G, d_h, d_h],
    from the query maps q_nope [H, d_h, D+1] (bias last) under the augmented input moment `cov` (None: unit inputs,
    bias dropped)."""
    q = q_nope if cov is not None else q_nope[..., : plan.hidden]
    q_gram = q @ cov @ q.transpose(-1, -2) if cov is not None else q @ q.transpose(-1, -2)  # [H, d_h, d_h]
    return q_gram.view(plan.groups, plan.heads // plan.groups, plan.head_dim, plan.head_dim).sum(1)


def _row_weights(options: ConvertOptions, q_nope: torch.Tensor, w_o: torch.Tensor, cov, plan: Plan):
    """Row weightings (k_weight, v_weight) of the low-rank objective, or (None, None) for plain K/V error.

    attention: a key error e of kv group g costs sum_h E[(q_h . e)^2] / d_h in scores (queries of the group's heads,
    nope part, under the calibration inputs); a value error e costs sum_h ||W_o,h e||^2 after o_proj.
    scores: keys as in attention, values by their own error (as in kv).
    """
    if options.objective not in ("attention", "scores"):
        return None, None
    heads, groups, head_dim = plan.heads, plan.groups, plan.head_dim
    per = heads // groups
    q_gram = _group_query_grams(q_nope, cov, plan) / head_dim
    w_o = w_o.double().view(-1, heads, head_dim).transpose(0, 1)  # [H, D, d_h]
    o_gram = (w_o.transpose(-1, -2) @ w_o).view(groups, per, head_dim, head_dim).sum(1)  # [G, d_h, d_h]
    if options.objective == "scores":
        return lowrank.group_weight(list(q_gram)), None
    return lowrank.group_weight(list(q_gram)), lowrank.group_weight(list(o_gram))
