"""A native MLA checkpoint in the cache layout an engine's MLA kernels take, exactly.

Engines' MLA attention (vLLM's `MLAAttention`, SGLang's) knows one kv head per query head and a cache row of
`kv_lora_rank + qk_rope_head_dim` values of a size its kernels were built for (vLLM: 320 = 256 + 64 or 576 = 512 + 64;
its CPU kernel only 576). A native layer maps onto that exactly, tensor by tensor:

    q_proj [H*(d_n+d_r), D]        -> [H*(d_n+d_r'), D]   rope rows of each head padded with zero rows
    (qk_norm calibrated: q_proj [H*d_h, D] and q_norm as they are; q_head_proj [H*(d_n+d_r), d_h] padded likewise)
    kv_a_proj [d_c+d_r, D]         -> [d_c'+d_r', D]      zero latent rows, zero rope rows (bias alike)
    kv_b_proj [G*(d_n+d_v), d_c]   -> [H*(d_n'+d_v'), d_c'] kv groups repeated per query head, zero columns; its bias
                                                          is dropped: the nope-key part adds one constant per query
                                                          to every score (softmax cancels it), the value part ...
    o_proj [D, H*d_v] (+bias)      -> ... is folded into the o_proj bias (softmax rows sum to 1)

On a GPU the nope and value head dims are padded too (d_n', d_v': zero query and key rows, zero value rows and o_proj
columns), to a head layout vLLM's CUDA MLA prefill takes (PREFILL_HEADS). Rope rows stay in rotate_half layout inside
the padded width (pair j: rows j and j + d_r'/2); the padded pairs are zero in query and key, so whatever frequency
they get adds nothing. The result is itself a native MLA model (G = H, ranks d_c', rope dims d_r', `rope_pairs` padded
with `PAD_PAIR`), which is how tests prove the mapping exact in transformers before any engine runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mla_convert.errors import UserError

# (kv_lora_rank, qk_rope_head_dim) splits vLLM's MLA backends take (head sizes 320 and 576; FlashMLA and the CPU
# kernel only 576).
VLLM_LAYOUTS = {"cpu": ((512, 64),), "cuda": ((256, 64), (512, 64))}
SERVED_ROPE_MAX = max(r for layouts in VLLM_LAYOUTS.values() for _, r in layouts)  # 64
SERVED_LATENT_MAX = max(c for layouts in VLLM_LAYOUTS.values() for c, _ in layouts)  # 512
# (qk_nope_head_dim, v_head_dim), with qk_rope_head_dim 64, that vLLM's CUDA MLA prefill takes: its FlashAttention
# prefill backend, the only one on Hopper and older GPUs (vllm/v1/attention/backends/mla/prefill/flash_attn.py,
# supports_mla_dimensions). Any other head layout stops vLLM at start-up ("No valid MLA prefill backend found"). The
# CPU's prefill takes any.
PREFILL_HEADS = {"cpu": None, "cuda": ((64, 128), (128, 128), (192, 256))}
PAD_PAIR = 0  # source frequency index given to padded rope pairs (their rows are zero: any index is exact)
# vLLM picks its AMX MLA backend on every CPU with AMX tiles (Intel Sapphire Rapids and later), whatever the model;
# that backend packs W_uk and W_uv for AMX matrix products, which takes bfloat16/float16 weights whose input dims
# (nope head dim, latent) are multiples of 32, and a cache row of 576. Other layouts need vLLM's reference CPU MLA
# backend (what the AMX one does with them: docs/decisions.md#vllms-cpu-backends).
AMX_MLA_HEAD = 576
AMX_MLA_DTYPES = ("bfloat16", "float16")


@dataclass(frozen=True)
class ServedLayout:
    kv_lora_rank: int  # d_c': kv_lora_rank of the engine's cache (every layer)
    rope_dims: int  # d_r': qk_rope_head_dim of the engine's cache
    nope_dims: int | None = None  # d_n': qk_nope_head_dim of the served heads (None: the model's)
    value_dims: int | None = None  # d_v': v_head_dim of the served heads (None: the model's)

    @property
    def elements_per_token_per_layer(self) -> int:
        return self.kv_lora_rank + self.rope_dims


def check_servable(config, what: str = "vLLM's MLA kernels and the DeepSeek-V3 export",
                   query_norm: bool = False) -> None:
    """Refuse a native config with a sliding attention window (no engine's MLA has one), or one with per-head q/k
    norms (Qwen3 sources) that `what` cannot run. Engines' MLA takes a key
    linear in the latent: qk_norm "exact" (a per-token key norm) never serves. `query_norm`: the engine's query path
    is ours (mla-convert's vLLM model), so "calibrated" (the query's per-head norm, keys linear) serves there."""
    window = config.get("sliding_window") if isinstance(config, dict) else getattr(config, "sliding_window", None)
    if window is not None:
        raise UserError(f"this checkpoint attends within a sliding window of {window} positions, which {what} cannot "
                        "hold: run it in transformers (eval --engine transformers, generate)")
    def field(key):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    if field("norm_layout") not in (None, "pre"):
        raise UserError(f"this checkpoint's blocks normalize their attention and MLP outputs (norm_layout "
                        f"{field('norm_layout')}), which {what} cannot hold: run it in transformers (eval --engine "
                        "transformers, generate)")
    if field("attn_logit_softcapping") or field("final_logit_softcapping") or field("norm_unit_offset"):
        raise UserError(f"this checkpoint soft-caps its logits or scales its norms by (1 + weight) (Gemma), which {what} "
                        "cannot hold: run it in transformers (eval --engine transformers, generate)")
    if field("qk_norm") and field("qk_norm_scope") == "projection":
        raise UserError(f"this checkpoint normalizes the whole query and key projections (qk_norm_scope projection), "
                        f"which {what} cannot hold: run it in transformers (eval --engine transformers, generate)")
    mode = config.get("qk_norm") if isinstance(config, dict) else getattr(config, "qk_norm", None)
    if mode and not (query_norm and mode == "calibrated"):
        fix = ("convert with --qk-norm calibrated to serve it in vLLM, or run it in transformers" if query_norm
               else "run it in transformers (eval --engine transformers, generate), or serve a --qk-norm calibrated "
               "conversion in vLLM through the plugin")
        raise UserError(f"this checkpoint normalizes each query and key head per token (qk_norm {mode}), which {what} "
                        f"cannot hold: {fix}")


def padded_heads(nope: int, value: int, head_layouts) -> tuple[int, int]:
    """The smallest (qk_nope_head_dim, v_head_dim) of `head_layouts` (PREFILL_HEADS) that holds (nope, value)."""
    for nope_out, value_out in head_layouts:
        if nope <= nope_out and value <= value_out:
            return nope_out, value_out
    raise UserError(f"qk_nope_head_dim {nope} / v_head_dim {value} is above every head layout vLLM's CUDA MLA prefill "
                    f"takes ({', '.join(f'{n}/{v}' for n, v in head_layouts)}): serve it on vLLM's CPU build or in "
                    "transformers")


def served_layout(kv_lora_rank: list[int], rope_dims: int, layouts: tuple[tuple[int, int], ...],
                  heads: tuple[int, int] | None = None, head_layouts=None) -> ServedLayout:
    """The smallest layout of `layouts` that holds every layer's latent and the rope key (zero-padded, exact); with
    `heads` (the model's nope and value dims) and `head_layouts` (PREFILL_HEADS), the head dims padded to one too."""
    need = max(kv_lora_rank)
    nope_out, value_out = padded_heads(*heads, head_layouts) if heads and head_layouts else (None, None)
    for kv_lora_rank_out, rope_dims_out in sorted(layouts, key=sum):
        if need <= kv_lora_rank_out and rope_dims <= rope_dims_out:
            return ServedLayout(kv_lora_rank_out, rope_dims_out, nope_out, value_out)
    raise UserError(
        f"no MLA cache layout of the engine ({', '.join(f'{a}+{b}' for a, b in layouts)}) holds this model's latent "
        f"{need} + rope key {rope_dims}: convert with --rank {max(a for a, _ in layouts)} or less and --rope-dims "
        f"{max(b for _, b in layouts)} or less"
    )


def serving_notes(kv_lora_rank: list[int], rope_dims: int) -> list[str]:
    """Warnings for a conversion plan that vLLM's MLA kernels cannot serve (the plugin pads anything smaller)."""
    if max(kv_lora_rank) <= SERVED_LATENT_MAX and rope_dims <= SERVED_ROPE_MAX:
        return []
    return [f"latent {max(kv_lora_rank)} + rope key {rope_dims}: vLLM's MLA kernels take at most {SERVED_LATENT_MAX} + "
            f"{SERVED_ROPE_MAX}, so this model will not serve in vLLM (transformers only); pass --rope-dims "
            f"{SERVED_ROPE_MAX} or less and a --rank / --kv-budget within {SERVED_LATENT_MAX} to serve it"]


def served_config(config, layout: ServedLayout) -> dict:
    """Fields of an MLAConfig that describe the served model (for a native model equal to what the engine runs)."""
    pad = (layout.rope_dims - config.qk_rope_head_dim) // 2
    return {
        "num_key_value_heads": config.num_attention_heads,
        "qk_nope_head_dim": layout.nope_dims or config.qk_nope_head_dim,
        "v_head_dim": layout.value_dims or config.v_head_dim,
        "kv_lora_rank": [layout.kv_lora_rank] * config.num_hidden_layers,
        "qk_rope_head_dim": layout.rope_dims,
        "rope_pairs": [list(p) + [PAD_PAIR] * pad for p in config.rope_pairs],
        "attention_bias": bool(config.attention_bias),
        "o_proj_bias": bool(config.attention_bias or config.o_proj_bias),
    }


def _pad_rope_rows(x: torch.Tensor, rope_dims: int, rope_dims_out: int) -> torch.Tensor:
    """[..., d_r] rotate_half dims -> [..., d_r']: pair j stays at rows (j, j + d_r'/2), the rest zero."""
    half, half_out = rope_dims // 2, rope_dims_out // 2
    out = x.new_zeros(*x.shape[:-1], rope_dims_out)
    out[..., :half] = x[..., :half]
    out[..., half_out : half_out + half] = x[..., half:]
    return out


def served_layer(tensors: dict[str, torch.Tensor], config, layer: int, layout: ServedLayout) -> dict[str, torch.Tensor]:
    """One native layer's attention tensors (keys `q_proj.weight`, `kv_a_proj.bias`, ...) -> the served layer's.

    Computed in float32 (the o_proj bias fold is a matrix product), returned in float32.
    """
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    d_n, d_v, d_r = config.qk_nope_head_dim, config.v_head_dim, config.qk_rope_head_dim
    d_c = config.kv_lora_ranks[layer]
    d_c_out, d_r_out = layout.kv_lora_rank, layout.rope_dims
    d_n_out, d_v_out = layout.nope_dims or d_n, layout.value_dims or d_v
    per_group = heads // groups
    t = {k: v.float() for k, v in tensors.items()}
    out = {}

    def query(x):  # [H*(d_n+d_r), *] -> [H*(d_n'+d_r'), *]
        x = x.reshape(heads, d_n + d_r, -1).transpose(1, 2)  # [H, *, d_n+d_r]
        x = torch.cat((F.pad(x[..., :d_n], (0, d_n_out - d_n)), _pad_rope_rows(x[..., d_n:], d_r, d_r_out)), dim=-1)
        return x.transpose(1, 2).reshape(heads * (d_n_out + d_r_out), -1)

    def latent_rows(x):  # [d_c+d_r, *] -> [d_c'+d_r', *]
        x = x.reshape(d_c + d_r, -1)
        y = x.new_zeros(d_c_out + d_r_out, x.shape[1])
        y[:d_c] = x[:d_c]
        y[d_c_out:] = _pad_rope_rows(x[d_c:].T, d_r, d_r_out).T
        return y

    if "q_head_proj.weight" in t:  # qk_norm calibrated: q_proj and the per-head norm as they are, then per head
        out["q_head_proj.weight"] = query(t["q_head_proj.weight"])
        out["q_norm.weight"] = t["q_norm.weight"]
        out["q_proj.weight"] = t["q_proj.weight"]
        if "q_proj.bias" in t:
            out["q_proj.bias"] = t["q_proj.bias"]
    else:
        out["q_proj.weight"] = query(t["q_proj.weight"])
        if "q_proj.bias" in t:
            out["q_proj.bias"] = query(t["q_proj.bias"])[:, 0]
    out["kv_a_proj.weight"] = latent_rows(t["kv_a_proj.weight"])
    if "kv_a_proj.bias" in t:
        out["kv_a_proj.bias"] = latent_rows(t["kv_a_proj.bias"])[:, 0]
    w_b = t["kv_b_proj.weight"].view(groups, d_n + d_v, d_c).repeat_interleave(per_group, dim=0)  # [H, d_n+d_v, d_c]
    kv_b = w_b.new_zeros(heads, d_n_out + d_v_out, d_c_out)
    kv_b[:, :d_n, :d_c] = w_b[:, :d_n]
    kv_b[:, d_n_out : d_n_out + d_v, :d_c] = w_b[:, d_n:]
    out["kv_b_proj.weight"] = kv_b.reshape(heads * (d_n_out + d_v_out), d_c_out)
    w_o = t["o_proj.weight"]  # [D, H*d_v]
    out["o_proj.weight"] = F.pad(w_o.view(-1, heads, d_v), (0, d_v_out - d_v)).reshape(w_o.shape[0], heads * d_v_out)
    if config.attention_bias or config.o_proj_bias:
        o_bias = t.get("o_proj.bias", w_o.new_zeros(w_o.shape[0]))
        if "kv_b_proj.bias" in t:
            v_bias = t["kv_b_proj.bias"].view(groups, d_n + d_v)[:, d_n:]  # [G, d_v]
            o_bias = o_bias + w_o @ v_bias.repeat_interleave(per_group, dim=0).reshape(-1)
        out["o_proj.bias"] = o_bias
    return out


def amx_mla_runs(kv_lora_rank: int, rope_dims: int, nope_dims: int, dtype: str) -> bool:
    """Whether vLLM's AMX MLA CPU backend can run a served layout (see AMX_MLA_HEAD) in `dtype`."""
    return (kv_lora_rank + rope_dims == AMX_MLA_HEAD and dtype in AMX_MLA_DTYPES and nope_dims % 32 == 0
            and kv_lora_rank % 32 == 0)
