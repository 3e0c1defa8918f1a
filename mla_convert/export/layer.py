"""Layer mapping: one native attention layer's tensors -> DeepSeek-V3 tensors, with the identity latent norm.

DeepSeek-V3 always applies `kv_a_layernorm` (and `q_a_layernorm` on the q_lora path) to the latent. `export_layer`
scales the latent rows by a tiny power of two `a` and sets the norm weight to sqrt(eps)/a, so that the norm is the
identity up to a relative error below float32 rounding (`identity_norm_scale`); the rope rows are interleaved and
reordered onto the fitted frequencies (rope_fit.place_rope_rows), the softmax scale is folded into the query, kv
groups are repeated per query head and the value biases are folded into o_proj's bias.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from mla_convert.export.plan import EXPORT_EPS, ExportPlan
from mla_convert.rope_fit import place_rope_rows

# Relative error allowed on the latent (and on the query under the q_lora path) by the identity-norm trick. Below
# float32's resolution of 6e-8 per element after rounding the scale down to a power of two.
NORM_TOLERANCE = 1e-7


def identity_norm_scale(max_mean_square: float, eps: float = EXPORT_EPS, tolerance: float = NORM_TOLERANCE) -> float:
    """The power of two `a` for which RMSNorm_eps(a*c) * (sqrt(eps)/a) equals c within relative `tolerance`.

    RMSNorm_eps(a c) * sqrt(eps)/a = c / sqrt(1 + a^2 mean(c^2)/eps), so the relative error is at most
    a^2 M / (2 eps) for every c with mean(c^2) <= M. A power of two keeps `a * W` exact in any float format.
    """
    if max_mean_square <= 0:
        return 1.0
    a = math.sqrt(2 * tolerance * eps / max_mean_square)
    return 2.0 ** math.floor(math.log2(a))


def _latent_bound(w: torch.Tensor, norm_weight: torch.Tensor, bias: torch.Tensor | None, dims: int) -> float:
    """Bound on mean(y^2) over `dims` outputs for y = w x + bias, x = the decoder input RMSNorm's output.

    x = norm_weight * h / rms(h) has ||h/rms(h)|| <= sqrt(D) for every h, so ||y|| <= ||w diag(norm_weight)||_2
    sqrt(D) + ||bias||.
    """
    sigma = float(torch.linalg.matrix_norm(w.double() * norm_weight.double(), ord=2))
    bound = sigma * math.sqrt(w.shape[1]) + (float(bias.double().norm()) if bias is not None else 0.0)
    return bound * bound / dims


def _round_to(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).double())


def _fold_query(w_q: torch.Tensor, b_q: torch.Tensor | None, plan: ExportPlan, layer: int):
    """The query's weight [H*(d_n+d_r_out), D] and bias with the softmax scale folded in and the rope rows placed on
    the fitted frequencies."""
    H, d_n, d_r, d_r_out = plan.heads, plan.nope, plan.rope_dims, plan.rope_dims_out
    order, stride = plan.fit.order[layer], plan.rope_stride
    hidden = w_q.shape[1]
    w_q = w_q.view(H, d_n + d_r, hidden)
    b_q = (b_q if b_q is not None else w_q.new_zeros(H * (d_n + d_r))).view(H, d_n + d_r)
    rope_q = plan.q_scale * plan.rope_score_scale
    w_q_out = torch.cat(
        (F.pad(plan.q_scale * w_q[:, :d_n], (0, 0, 0, plan.nope_out - d_n)),  # padded nope rows: zero
         rope_q * place_rope_rows(w_q[:, d_n:], order, d_r_out, stride)), dim=1
    ).reshape(H * (plan.nope_out + d_r_out), hidden)
    b_q_out = torch.cat(
        (F.pad(plan.q_scale * b_q[:, :d_n], (0, plan.nope_out - d_n)),
         rope_q * place_rope_rows(b_q[:, d_n:, None], order, d_r_out, stride)[..., 0]),
        dim=1,
    ).reshape(-1)
    return w_q_out, b_q_out


def _output_bias(w_b: torch.Tensor, b_b: torch.Tensor | None, b_c: torch.Tensor | None, w_o: torch.Tensor,
                 b_o: torch.Tensor | None, plan: ExportPlan) -> torch.Tensor:
    """o_proj's bias [D] with the value biases folded in; `w_b` is kv_b_proj viewed [G, d_n+d_v, d_c]."""
    G, d_n, d_v = plan.groups, plan.nope, plan.value
    w_uv = w_b[:, d_n:]  # [G, d_v, d_c]
    # Value bias seen by the output: kv_b's value bias plus the latent bias mapped through W_uv (softmax rows sum to
    # 1). The nope-key parts of both biases add one constant per query to every score, which softmax cancels.
    v_bias = w_b.new_zeros(G, d_v)
    if b_b is not None:
        v_bias += b_b.view(G, d_n + d_v)[:, d_n:]
    if b_c is not None:
        v_bias += torch.einsum("gvc,c->gv", w_uv, b_c)
    o_bias = w_o @ v_bias.repeat_interleave(plan.heads // G, dim=0).reshape(-1)  # [D]
    if b_o is not None:
        o_bias = o_bias + b_o
    return o_bias


def _latent_tensors(w_a: torch.Tensor, w_b: torch.Tensor, norm_weight: torch.Tensor, plan: ExportPlan,
                    layer: int) -> tuple[dict, dict]:
    """kv_a_proj_with_mqa, the identity kv_a_layernorm and kv_b_proj (groups repeated per head), and the stats of
    the identity norm; `w_b` is kv_b_proj viewed [G, d_n+d_v, d_c]."""
    H, d_n, d_v = plan.heads, plan.nope, plan.value
    d_c, d_c_out, d_r_out = plan.kv_lora_rank[layer], plan.kv_lora_rank_out, plan.rope_dims_out
    w_c, w_r = w_a[:d_c], w_a[d_c:]  # [d_c, D], [d_r, D]
    # Identity kv_a_layernorm: latent rows scaled by a power of two a (exact in any format), norm weight sqrt(eps)/a
    # rounded to bfloat16 precision so that a float32 export served in bfloat16 keeps it exactly; kv_b_proj absorbs
    # the rounding.
    latent_ms = _latent_bound(w_c, norm_weight, None, d_c_out)
    a = identity_norm_scale(latent_ms)
    norm_w = _round_to(math.sqrt(EXPORT_EPS) / a, torch.bfloat16)  # exact in float32 and bfloat16 alike
    correction = math.sqrt(EXPORT_EPS) / a / norm_w
    kv_a = w_a.new_zeros(d_c_out + d_r_out, w_a.shape[1])
    kv_a[:d_c] = a * w_c
    kv_a[d_c_out:] = place_rope_rows(w_r[None], plan.fit.order[layer], d_r_out, plan.rope_stride)[0]
    kv_b = w_b.new_zeros(H, plan.nope_out + plan.value_out, d_c_out)
    per_head = correction * w_b.repeat_interleave(H // plan.groups, dim=0)  # [H, d_n+d_v, d_c]
    kv_b[:, :d_n, :d_c] = per_head[:, :d_n]
    kv_b[:, plan.nope_out:plan.nope_out + d_v, :d_c] = per_head[:, d_n:]
    out = {
        "kv_a_proj_with_mqa.weight": kv_a,
        "kv_a_layernorm.weight": torch.full((d_c_out,), norm_w, dtype=torch.float64),
        "kv_b_proj.weight": kv_b.reshape(H * (plan.nope_out + plan.value_out), d_c_out),
    }
    return out, {"kv_a_scale": a, "latent_mean_square_bound": latent_ms}


def _q_lora_tensors(w_q_out: torch.Tensor, b_q_out: torch.Tensor, norm_weight: torch.Tensor,
                    plan: ExportPlan) -> tuple[dict, float]:
    """A query with a bias as q = W x + b through q_a_proj (+bias) -> identity q_a_layernorm -> q_b_proj; returns
    those tensors and the identity norm's scale."""
    f64 = torch.float64
    rows, hidden = w_q_out.shape
    if plan.q_lora_mode == "input":  # q_a = a [x; 1], q_b = [W | b]
        ms = (float(norm_weight.double().abs().max()) ** 2 * hidden + 1.0) / (hidden + 1)
        a_q = identity_norm_scale(ms)
        q_a = torch.cat((torch.eye(hidden, dtype=f64), w_q_out.new_zeros(1, hidden)), dim=0) * a_q
        q_a_bias = w_q_out.new_zeros(hidden + 1)
        q_a_bias[-1] = a_q
        q_b = torch.cat((w_q_out, b_q_out[:, None]), dim=1)
    else:  # q_a = a (W x + b), q_b = identity
        ms = _latent_bound(w_q_out, norm_weight, b_q_out, rows)
        a_q = identity_norm_scale(ms)
        q_a, q_a_bias, q_b = a_q * w_q_out, a_q * b_q_out, torch.eye(rows, dtype=f64)
    q_norm_w = _round_to(math.sqrt(EXPORT_EPS) / a_q, torch.bfloat16)
    out = {
        "q_a_proj.weight": q_a,
        "q_a_proj.bias": q_a_bias,
        "q_a_layernorm.weight": torch.full((q_a.shape[0],), q_norm_w, dtype=f64),
        "q_b_proj.weight": q_b * (math.sqrt(EXPORT_EPS) / a_q / q_norm_w),
    }
    return out, a_q


def export_layer(t: dict[str, torch.Tensor], plan: ExportPlan, layer: int, norm_weight: torch.Tensor) -> tuple[dict, dict]:
    """One layer's attention tensors (names relative to `self_attn.`) -> DeepSeek tensors and per-layer stats.

    `t` holds the native q_proj/kv_a_proj/kv_b_proj/o_proj weights and biases (float32); `norm_weight` is the
    layer's input_layernorm weight, which bounds the latent for the identity norm.
    """
    d_c, d_c_out, d_r_out = plan.kv_lora_rank[layer], plan.kv_lora_rank_out, plan.rope_dims_out

    def get(name):
        x = t.get(name)
        return None if x is None else x.to(torch.float64)

    w_q_out, b_q_out = _fold_query(get("q_proj.weight"), get("q_proj.bias"), plan, layer)
    w_a, b_a = get("kv_a_proj.weight"), get("kv_a_proj.bias")
    b_c = b_a[:d_c] if b_a is not None else None
    b_r = b_a[d_c:] if b_a is not None else w_a.new_zeros(plan.rope_dims)
    w_b = get("kv_b_proj.weight").view(plan.groups, plan.nope + plan.value, d_c)
    w_o = get("o_proj.weight")
    o_bias = _output_bias(w_b, get("kv_b_proj.bias"), b_c, w_o, get("o_proj.bias"), plan)

    out, stats = _latent_tensors(w_a, w_b, norm_weight, plan, layer)
    w_o_out = F.pad(w_o.view(w_o.shape[0], plan.heads, plan.value), (0, plan.value_out - plan.value))  # zero columns
    out["o_proj.weight"] = plan.residual_scale * w_o_out.reshape(w_o.shape[0], -1)
    if plan.attention_bias:
        k_bias = w_a.new_zeros(d_c_out + d_r_out)
        if plan.k_rope_bias:
            k_bias[d_c_out:] = place_rope_rows(b_r[None, :, None], plan.fit.order[layer], d_r_out,
                                               plan.rope_stride)[0, :, 0]
        out["kv_a_proj_with_mqa.bias"] = k_bias
        out["o_proj.bias"] = plan.residual_scale * o_bias if plan.o_bias else torch.zeros_like(o_bias)
    if plan.q_lora_rank is None:
        out["q_proj.weight"] = w_q_out
        return out, stats
    q_tensors, stats["q_a_scale"] = _q_lora_tensors(w_q_out, b_q_out, norm_weight, plan)
    out.update(q_tensors)
    return out, stats
