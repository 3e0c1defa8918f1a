"""The decode benchmark's models and decode forms: the source and converted models (random SmolLM2-135M-shaped
weights or a converted folder), one attention layer's step in each form (benchmarks/decode/run.py's docstring lists
them)."""

from __future__ import annotations

import torch

import mla_convert.modeling  # noqa: F401  (registers model_type "mla")
from mla_convert.modeling import MLAConfig, MLAForCausalLM
from mla_convert.modeling.compat import cache_kwargs
from mla_convert.modeling.modeling_mla import MLAAttention, rotate

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json); max_position_embeddings raised so 32K contexts are legal.
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, hidden_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-5,
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    bos_token_id=0, eos_token_id=0,
)
MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_pairs", "softmax_scale",
              "o_proj_bias", "mla_attention_mode", "mla_decode_kernel")


# ---------------------------------------------------------------------------------------------- models


def source_config_from(mla_config):
    from transformers import LlamaConfig

    fields = mla_config.to_dict()
    for key in MLA_FIELDS + ("model_type", "architectures", "auto_map", "transformers_version"):
        fields.pop(key, None)
    return LlamaConfig(**fields)


def build_models(args, dtype, device):
    """-> (source LlamaForCausalLM, MLAForCausalLM, description of where the weights came from)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if args.model:
        mla = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        if args.source:
            source = AutoModelForCausalLM.from_pretrained(args.source, dtype=dtype,
                                                          **({"gguf_file": args.gguf_file} if args.gguf_file else {}))
            origin = f"converted folder `{args.model}`, source `{args.source}`"
        else:
            source = LlamaForCausalLM(source_config_from(mla.config)).to(dtype)
            origin = f"converted folder `{args.model}`; source built from its config with random weights"
    else:
        src_cfg = LlamaConfig(**SMOLLM2_135M)
        source = LlamaForCausalLM(src_cfg).to(dtype)
        from mla_convert.conversion.plan import ConvertOptions, default_nope_dims

        d_n = args.d_n or default_nope_dims(ConvertOptions(), SMOLLM2_135M["head_dim"], args.d_r, None)
        mla_cfg = MLAConfig(**SMOLLM2_135M, kv_lora_rank=args.d_c, qk_rope_head_dim=args.d_r, qk_nope_head_dim=d_n)
        mla = MLAForCausalLM(mla_cfg).to(dtype)
        origin = (f"`--from-config`: SmolLM2-135M shapes, random weights; MLA d_c={args.d_c}, d_r={args.d_r}, "
                  f"d_n={d_n} (d_c + d_r = {args.d_c + args.d_r} per layer)")
        head_dim, source_elems = src_cfg.head_dim, 2 * src_cfg.num_key_value_heads * src_cfg.head_dim
        if args.d_r == head_dim // 2:  # the converter's default d_r; d_c is the rest of the budget
            origin += (f", the shape `mla-convert llama --kv-budget {(args.d_c + args.d_r) / source_elems:g}` gives "
                       f"SmolLM2-135M (default d_r = head_dim/2 = {args.d_r}, d_c = budget - d_r)")
    for m in (source, mla):
        m.config._attn_implementation = "sdpa"
        m.eval().to(device)
    return source, mla, origin


# ---------------------------------------------------------------------------------------------- one layer


class SlotCache:
    """A fixed cache of `context + 1` rows for one layer: `update` writes the new row at `context` and returns the
    whole buffers, so the step attends over exactly context + 1 positions. Duck-types the two Cache methods the
    attention layers call."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values  # [B, n, S+1, d_k], [B, n, S+1, d_v]
        self.context = keys.shape[2] - 1

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys[:, :, self.context:].copy_(key_states)
        self.values[:, :, self.context:].copy_(value_states)
        return self.keys, self.values

    def get_seq_length(self, layer_idx=0):
        return self.context


def _attention_interface(config):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)


def _mla_projections(attn: MLAAttention, hidden, position_embeddings):
    """q_nope [B, H, 1, d_n], rotated q_rope [B, H, 1, d_r], latent [B, 1, 1, d_c], rotated k_rope [B, 1, 1, d_r]."""
    bsz = hidden.shape[0]
    d_n, d_r, d_c = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
    q = attn.q_proj(hidden).view(bsz, 1, attn.num_heads, d_n + d_r).transpose(1, 2)
    q_nope, q_rope = q.split([d_n, d_r], dim=-1)
    latent, k_rope = attn.kv_a_proj(hidden).split([d_c, d_r], dim=-1)
    latent, k_rope = latent.unsqueeze(1), k_rope.unsqueeze(1)
    cos, sin = attn._rope_cos_sin(position_embeddings)
    return q_nope, rotate(q_rope, cos, sin), latent, rotate(k_rope, cos, sin)


def cd_step(attn: MLAAttention, cache: SlotCache, hidden, position_embeddings):
    """CD: converted weights, the expanded per-group K [B, G, S, d_n+d_r] and V [B, G, S, d_v] cached."""
    bsz = hidden.shape[0]
    groups, d_n, d_v = attn.groups, attn.qk_nope_head_dim, attn.v_head_dim
    q_nope, q_rope, latent, k_rope = _mla_projections(attn, hidden, position_embeddings)
    kv = attn.kv_b_proj(latent[:, 0]).view(bsz, 1, groups, d_n + d_v).transpose(1, 2)  # [B, G, 1, d_n+d_v]
    k_nope, value = kv.split([d_n, d_v], dim=-1)
    key = torch.cat((k_nope, k_rope.expand(-1, groups, -1, -1)), dim=-1)  # [B, G, 1, d_n+d_r]
    key, value = cache.update(key, value, attn.layer_idx)
    out, _ = _attention_interface(attn.config)(attn, torch.cat((q_nope, q_rope), dim=-1), key, value, None,
                                               dropout=0.0, scaling=attn.scaling)  # [B, 1, H, d_v]
    return attn.o_proj(out.reshape(bsz, 1, -1))


def a_cc_step(attn: MLAAttention, cache: SlotCache, hidden, position_embeddings):
    """A_CC: absorbed, with the query and the cached key concatenated ([q_latent, q_rope] . [c, k_r]): one score
    matmul, but the cache is copied into a concatenated key every step."""
    bsz, heads, d_c = hidden.shape[0], attn.num_heads, attn.kv_lora_rank
    groups, per_group = attn.groups, attn.per_group
    q_nope, q_rope, latent, k_rope = _mla_projections(attn, hidden, position_embeddings)
    latent, k_rope = cache.update(latent, k_rope, attn.layer_idx)  # [B, 1, S, d_c], [B, 1, S, d_r]
    w_uk, w_uv = attn.absorbed_weights()
    q_latent = torch.einsum("bgrn,gnc->bgrc", q_nope.view(bsz, groups, per_group, -1), w_uk).reshape(bsz, heads, d_c)
    query = torch.cat((q_latent, q_rope[:, :, 0]), dim=-1)  # [B, H, d_c+d_r]
    key = torch.cat((latent[:, 0], k_rope[:, 0]), dim=-1)  # [B, S, d_c+d_r]: the per-step copy
    probs = torch.softmax(torch.bmm(query, key.transpose(1, 2)).float() * attn.scaling, dim=-1).to(latent.dtype)
    out_latent = torch.bmm(probs, latent[:, 0])  # [B, H, d_c]
    out = torch.einsum("bgrc,gvc->bgrv", out_latent.view(bsz, groups, per_group, d_c), w_uv)
    return attn.o_proj(out.reshape(bsz, 1, -1))


def module_step(attn, cache, hidden, position_embeddings):
    return attn(hidden, position_embeddings=position_embeddings, attention_mask=None, **cache_kwargs(cache))[0]


def layer_variants(source, mla, device):
    """name -> (attention module, cache layout, step function). Cache layouts: (heads, key dim, value dim)."""
    import copy

    src_attn = source.model.layers[0].self_attn
    cfg = source.config
    src_layout = (cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
    attn = mla.model.layers[0].self_attn
    groups, d_n, d_r, d_v, d_c = (attn.groups, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim,
                                  attn.kv_lora_rank)

    def with_config(**changes):
        clone = copy.copy(attn)  # shares the weights; its own config
        clone.config = copy.copy(attn.config)
        for key, value in changes.items():
            setattr(clone.config, key, value)
        return clone

    variants = {
        "source": (src_attn, src_layout, module_step),
        "CD": (attn, (groups, d_n + d_r, d_v), cd_step),
        "CC": (with_config(mla_attention_mode="expanded"), (1, d_c, d_r), module_step),
        "A_CC": (attn, (1, d_c, d_r), a_cc_step),
        "A_CC_ME": (with_config(mla_attention_mode="auto", mla_decode_kernel="torch"), (1, d_c, d_r), module_step),
    }
    if device.type == "cuda":
        from mla_convert.kernels import triton_available

        if triton_available():
            variants["triton"] = (with_config(mla_attention_mode="auto", mla_decode_kernel="auto"), (1, d_c, d_r),
                                  module_step)
    return variants


def cache_bytes(layout, context, batch, element_size):
    heads, d_k, d_v = layout
    return batch * context * heads * (d_k + d_v) * element_size
