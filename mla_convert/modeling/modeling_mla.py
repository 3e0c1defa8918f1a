"""The native MLA model: Llama blocks whose attention caches one latent per token.

Per layer (shapes at the point of use; H query heads, G kv groups, d_c latent, d_r rope key, d_n nope, d_v value):

    q_proj     [H*(d_n+d_r), D]   query per head: nope part, then rope part
    kv_a_proj  [d_c+d_r, D]       latent c (cached) and the shared rope key k_r (cached after rotation)
    kv_b_proj  [G*(d_n+d_v), d_c] per kv group: nope key and value from the latent
    o_proj     [D, H*d_v]

Prefill and training expand the latent to per-group K/V and run the usual attention (sdpa/eager; for sdpa the value
is zero-padded to the query/key width so the fused kernel runs; under a mask shared by the heads, a kv group's query
heads go in as rows of one head over its keys, `grouped_sdpa`), except in layers whose latent is narrower than the
nope key (d_c < d_n): there sdpa attends over the latent itself, the key [c, k_r] one kv head shared by every query
head (`use_latent_prefill`, `_latent_prefill`), which is fewer multiply-adds. Decode uses the absorbed form (A_CC_ME in the design
notes): the query's nope part is multiplied into `W_uk`, scores are taken against the latent and the rope key apart
and added, and values are read from the latent then mapped by `W_uv`.
With per-head q/k norms (`config.qk_norm`, e.g. Qwen3) the query is the source's: `q_proj` [H*d_h, D] -> RMS norm
per head (`q_norm`) -> `q_head_proj` [H*(d_n+d_r), d_h] per head. In "exact" mode the cached rope key is the
pre-norm, unrotated one: attention rebuilds each group's source key k_g = k_nope_g + R_g k_r (`k_rope_up` R), applies
`k_norm`, splits it again into nope part and rope key (`k_rope_down` K, K R = I) and rotates the rope key at the key
positions; this runs in the expanded form only (every step, decode included).
The cache (`DynamicCache`, or a preallocated `StaticCache`: `generate(..., cache_implementation="static")`) holds per
layer `keys = c [B, 1, S, d_c]` and `values = k_r [B, 1, S, d_r]`. Over a static cache the decode step reads no
length on the host (the Triton kernel takes the cache's counter on the device), so it can be captured in a CUDA graph.
"""

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, StaticLayer
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from mla_convert.modeling.latent_cache import hold_latent_typed, rows_as_cached
from mla_convert.modeling.compat import cache_kwargs, output_cache, renamed_cache_kwarg, take_cache
from mla_convert.modeling.configuration_mla import MLAConfig

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch without distributed support: no tensor parallelism, no DTensor weights
    DTensor = type("DTensor", (), {})  # a class nothing is an instance of


def local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A weight read directly (not through its module's forward): under tensor parallelism (`tp_plan`) a DTensor,
    of which this rank's shard is what its heads use."""
    return t.to_local() if isinstance(t, DTensor) else t


class UnitOffsetRMSNorm(nn.Module):
    """Gemma's RMS norm: x / rms(x) * (1 + weight), in float32, cast back to x's dtype (`config.norm_unit_offset`).
    Not folded into a plain weight: 1 + w rounded to a bfloat16 checkpoint's dtype would change the model."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).type_as(x)


def rms_norm(config, dim: int) -> nn.Module:
    """The RMS norm of a native config: Llama's, or Gemma's (1 + weight) one."""
    cls = UnitOffsetRMSNorm if config.norm_unit_offset else LlamaRMSNorm
    return cls(dim, eps=config.rms_norm_eps)


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma's logit soft-capping); x itself when cap is None."""
    return x if not cap else torch.tanh(x / cap) * cap


def capped_attention(query, key, value, attention_mask, scaling: float, cap: float) -> torch.Tensor:
    """Attention with soft-capped scores (Gemma 2), materialised: query [B, H, T, d], key [B, G, S, d] and value
    [B, G, S, d_v] (G divides H); attention_mask None (causal, queries at the last positions), bool (True = attend) or
    additive. -> [B, H, T, d_v]. The scores are scaled, capped, then masked, as Gemma 2's eager attention does."""
    bsz, heads, q_len, _ = query.shape
    groups, kv_len = key.shape[1], key.shape[2]
    q = query.view(bsz, groups, heads // groups, q_len, -1)
    scores = soft_cap(torch.einsum("bgrtd,bgsd->bgrts", q, key) * scaling, cap)  # [B, G, H/G, T, S]
    if attention_mask is None:
        attention_mask = offset_causal_mask(q_len, kv_len, query.device)
    mask = attention_mask[..., :kv_len]
    mask = mask.view(mask.shape[0], 1, 1, *mask.shape[-2:]) if mask.dim() == 4 else mask
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask.to(scores.dtype)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.einsum("bgrts,bgsv->bgrtv", weights, value)
    return out.reshape(bsz, heads, q_len, -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE on the last dim of `x` [B, *, T, d]; cos/sin [B, T, d]."""
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


class MLAAttention(nn.Module):
    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.groups = config.num_key_value_heads  # G
        self.per_group = self.num_heads // self.groups  # H/G query heads per kv group
        self.num_key_value_groups = self.per_group  # alias only: transformers' sdpa/eager attention reads this name
        self.kv_lora_rank = config.per_layer_config[layer_idx].kv_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.v_head_dim = config.v_head_dim
        self.scaling = config.softmax_scale
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        hidden = config.hidden_size
        bias = config.attention_bias
        d_q = self.qk_nope_head_dim + self.qk_rope_head_dim
        self.qk_norm = config.qk_norm
        self.layer_type = layer_type = config.layer_types[layer_idx]
        # the window this layer's queries look back over (None: the whole past); MLAModel masks by it
        self.sliding_window = config.sliding_window if layer_type == "sliding_attention" else None
        # which of MLAModel's rotary tables this layer takes (Gemma 3: the sliding layers have their own base)
        self.local_rope = layer_type == "sliding_attention" and config.local_rope_parameters is not None
        self.softcap = config.attn_logit_softcapping
        # with qk_norm_scope "projection" the q/k norms span every head at once (OLMo 2), else each head
        self.whole_norm = bool(self.qk_norm) and config.qk_norm_scope == "projection"
        if self.qk_norm:  # the source's query and its per-head norm, then per head to the nope and rope parts
            head_dim = config.head_dim
            self.q_proj = nn.Linear(hidden, self.num_heads * head_dim, bias=bias)
            self.q_norm = rms_norm(config, head_dim * (self.num_heads if self.whole_norm else 1))
            self.q_head_proj = nn.Linear(head_dim, self.num_heads * d_q, bias=False)  # used per head: [H, d_q, d_h]
        else:
            self.q_proj = nn.Linear(hidden, self.num_heads * d_q, bias=bias)
        if self.qk_norm == "exact":
            self.k_norm = rms_norm(config, config.head_dim * (self.groups if self.whole_norm else 1))
            keys = self.groups * config.head_dim
            self.register_buffer("k_rope_up", torch.zeros(keys, self.qk_rope_head_dim))  # R [G*d_h, d_r]
            self.register_buffer("k_rope_down", torch.zeros(self.qk_rope_head_dim, keys))  # K [d_r, G*d_h]
        self.kv_a_proj = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, self.groups * (self.qk_nope_head_dim + self.v_head_dim), bias=bias
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, hidden, bias=config.o_proj_bias)
        # A plain list, not a buffer: from_pretrained does not restore non-persistent buffers of custom modules.
        self.rope_pairs = list(config.rope_pairs[layer_idx])
        self._rope_index: dict[torch.device, torch.Tensor] = {}

    def sharded_for_training(self) -> bool:
        """Tensor parallel with gradients: the expanded form, whose kv_b_proj (colwise) sums the latent's gradient
        over the ranks; the latent forms read its weight directly, so each rank's latent gradient would cover only
        its own heads."""
        return isinstance(self.kv_b_proj.weight, DTensor) and torch.is_grad_enabled()

    def _rope_cos_sin(self, position_embeddings):
        cos, sin = position_embeddings  # [B, T, d_h] in rotate_half layout: frequency i at dims i and i + d_h/2
        index = self._rope_index.get(cos.device)
        if index is None:  # each kept pair's two dims: [p_0 .. p_k, p_0 + d_h/2 .. p_k + d_h/2] (one gather, no cat)
            half = cos.shape[-1] // 2
            dims = self.rope_pairs + [p + half for p in self.rope_pairs]
            index = self._rope_index[cos.device] = torch.tensor(dims, dtype=torch.long, device=cos.device)
        return cos[..., index], sin[..., index]  # [B, T, d_r]

    def use_absorbed(self, q_len: int, cache: Cache | None) -> bool:
        """"auto": the absorbed form for one new token with a cache (decode). Decided from shapes only: asking a
        static cache its length would wait on the device and break a captured step (a one-token prompt takes the
        absorbed form over its one cached row, which is exact too)."""
        mode = self.config.mla_attention_mode
        if self.qk_norm == "exact":
            return False  # the per-token key norm needs each group's key: expanded form only
        if self.sharded_for_training():
            return False
        if mode == "auto":
            return q_len == 1 and cache is not None
        return mode == "absorbed"

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> (output [B, T, D], attention weights [B, H, T, S] where the attention function gives them (eager), else
        None). Head and group counts are read from the weights' shapes, so a tensor-parallel shard (a slice of the
        heads and their kv groups) runs the same code."""
        cache = take_cache(cache, kwargs)
        bsz, q_len, _ = hidden_states.shape
        d_n, d_r, d_c = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        absorbed = self.use_absorbed(q_len, cache)  # decided before the cache grows

        # the rotary embeddings of every key's position (qk_norm exact); without a past, the step's own
        key_position_embeddings = kwargs.pop("key_position_embeddings", None)
        if key_position_embeddings is None and cache is None:
            key_position_embeddings = position_embeddings
        if self.qk_norm:
            q = self.q_proj(hidden_states)
            if self.whole_norm:
                q = self.q_norm(q)
            q = q.view(bsz, q_len, -1, self.config.head_dim)
            q = (q if self.whole_norm else self.q_norm(q)).transpose(1, 2)
            head_map = local(self.q_head_proj.weight).view(-1, d_n + d_r, self.config.head_dim)  # [H, d_n+d_r, d_h]
            q = torch.einsum("bhtd,hed->bhte", q, head_map)  # [B, H, T, d_n+d_r]
        else:
            q = self.q_proj(hidden_states).view(bsz, q_len, -1, d_n + d_r).transpose(1, 2)
        q_nope, q_rope = q.split([d_n, d_r], dim=-1)  # [B, H, T, d_n], [B, H, T, d_r]
        latent, k_rope = self.kv_a_proj(hidden_states).split([d_c, d_r], dim=-1)  # [B, T, d_c], [B, T, d_r]
        latent, k_rope = latent.unsqueeze(1), k_rope.unsqueeze(1)  # [B, 1, T, d_c], [B, 1, T, d_r]
        if d_r:
            cos, sin = self._rope_cos_sin(position_embeddings)
            q_rope = rotate(q_rope, cos, sin)
            if self.qk_norm != "exact":  # exact qk norm: cached before norm and rotation (see _normalized_keys)
                k_rope = rotate(k_rope, cos, sin)
        latent, k_rope = rows_as_cached(latent, k_rope, self.config, cache, self.layer_idx)  # latent_cache_type
        filled = None  # a static cache's count of written rows (0-d tensor on the cache's device), else None
        capacity = None  # a static cache's row count where only its written rows are attended to
        if cache is not None:
            latent, k_rope = cache.update(latent, k_rope, self.layer_idx)  # [B, 1, S, d_c], [B, 1, S, d_r]
            layers = getattr(cache, "layers", None)  # None: a duck-typed cache (benchmarks)
            layer = layers[self.layer_idx] if layers is not None else None
            if isinstance(layer, StaticLayer) and not layer.is_sliding:
                # The buffers hold the cache's capacity; rows at or past `filled` are unwritten. Where reading the
                # count costs no wait (CPU), or in prefill (not captured), attend to the written rows only.
                filled = layer.cumulative_length
                if not torch.compiler.is_compiling() and (not absorbed or filled.device.type == "cpu"):
                    rows, capacity = int(filled), latent.shape[2]
                    latent, k_rope, filled = latent[:, :, :rows], k_rope[:, :, :rows], None
                    if attention_mask is not None:
                        attention_mask = attention_mask[..., :rows]
                        if absorbed and attention_mask.dtype == torch.bool and bool(attention_mask.all()):
                            attention_mask = None  # no padding: the unmasked fast path (a CPU check, no wait)

        weights = None
        if absorbed:
            out, weights = self._absorbed(q_nope, q_rope, latent, k_rope, attention_mask, filled)
        elif self.use_latent_prefill(q_len, latent.shape[2], attention_mask):
            out = self._latent_prefill(q_nope, q_rope, latent, k_rope, attention_mask)
        else:
            out, weights = self._expanded(
                q_nope, q_rope, latent, k_rope, attention_mask, key_position_embeddings, **kwargs
            )
        if weights is not None and capacity is not None and weights.shape[-1] < capacity:
            # transformers' convention: with a static cache the weights span its every row, the unwritten ones
            # (masked) with weight 0, as attention over the whole buffer gives them
            weights = nn.functional.pad(weights, (0, capacity - weights.shape[-1]))
        out = out.transpose(1, 2).reshape(bsz, q_len, -1)
        return self.o_proj(out), weights

    def _expanded(self, q_nope, q_rope, latent, k_rope, attention_mask, key_position_embeddings=None, **kwargs):
        bsz, _, kv_len, _ = latent.shape
        d_n, d_r = self.qk_nope_head_dim, self.qk_rope_head_dim
        kv = self.kv_b_proj(latent[:, 0]).view(bsz, kv_len, -1, d_n + self.v_head_dim)
        k_nope, value = kv.transpose(1, 2).split([d_n, self.v_head_dim], dim=-1)  # [B, G, S, d_n], [B, G, S, d_v]
        if self.qk_norm == "exact":
            if key_position_embeddings is None:
                raise ValueError("qk_norm exact needs the key positions' rotary embeddings (MLAModel passes them)")
            k_nope, k_rope = self._normalized_keys(k_nope, k_rope, key_position_embeddings)
        key = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)  # [B, G, S, d_n+d_r]
        query = torch.cat((q_nope, q_rope), dim=-1)  # [B, H, T, d_n+d_r]
        if self.softcap:  # no fused kernel caps scores
            return capped_attention(query, key, value, attention_mask, self.scaling, self.softcap), None
        implementation = self.config._attn_implementation
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
        d_qk, d_v = d_n + d_r, self.v_head_dim
        if implementation == "sdpa" and d_qk != d_v:
            # sdpa's fused kernels (CPU flash, CUDA flash/cuDNN) need one head dim for query, key and value; with
            # d_n + d_r != d_v it falls back to the math kernel, which materialises every [T, S] score matrix
            # (several times slower: docs/decisions.md#attention-forms-in-the-model). Zero columns make the widths
            # equal without changing the result: zeros in the value give zero output columns (sliced off below),
            # zeros in query and key add nothing to a score.
            if d_qk < d_v:
                query, key = nn.functional.pad(query, (0, d_v - d_qk)), nn.functional.pad(key, (0, d_v - d_qk))
            else:
                value = nn.functional.pad(value, (0, d_qk - d_v))  # [B, G, S, d_n+d_r]
        dropout = 0.0 if not self.training else self.attention_dropout
        if implementation == "sdpa" and grouped_fits(query, key, attention_mask):
            return grouped_sdpa(query, key, value, attention_mask, self.scaling, dropout)[..., :d_v], None
        out, weights = attention(self, query, key, value, attention_mask, dropout=dropout, scaling=self.scaling,
                                 **kwargs)  # [B, T, H, d_v] (or padded width); weights [B, H, T, S] or None
        return out[..., :d_v].transpose(1, 2), weights

    def use_latent_prefill(self, q_len: int, kv_len: int, attention_mask: torch.Tensor | None) -> bool:
        """"auto", several query tokens: attention over the latent (`_latent_prefill`) where it takes fewer
        multiply-adds than the expanded form, i.e. in layers whose latent is narrower than the nope key (d_c < d_n,
        as the budget's low end and rank allocation give). Counted per batch row, fused sdpa kernel in both forms:
        expanded = kv_b for every key (S G d_c (d_n+d_v)) + the scores and weighted sum at the padded width
        max(d_n+d_r, d_v); latent = the query's and output's maps through W_uk / W_uv (T H d_c (d_n+d_v)) + both
        products at width d_c+d_r. At full rank (d_c = G (d_n+d_v)) the expanded form always wins: the exactness
        anchor keeps its path."""
        if self.config.mla_attention_mode != "auto" or self.qk_norm == "exact" or q_len == 1 or self.softcap:
            return False
        if self.sharded_for_training():
            return False
        if self.config._attn_implementation != "sdpa":
            return False
        if attention_mask is not None and attention_mask.dtype != torch.bool:
            return False
        d_c, d_n, d_r, d_v = self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        heads, groups = self.num_heads, self.groups
        scores = q_len * kv_len - q_len * (q_len - 1) // 2  # causal (query-key) pairs
        expanded = kv_len * groups * d_c * (d_n + d_v) + heads * scores * 2 * max(d_n + d_r, d_v)
        latent = q_len * heads * d_c * (d_n + d_v) + heads * scores * 2 * (d_c + d_r)
        return latent < expanded

    def _latent_prefill(self, q_nope, q_rope, latent, k_rope, attention_mask):
        """The absorbed form for many queries, on sdpa's fused kernel: each head's query is mapped into the latent
        (W_uk^T q_nope) and joined with its rope part; the key [c, k_r] is one kv head shared by every query head and
        also serves as the value (the same width as the key, which the fused kernels need), of whose output only the
        latent columns are kept and mapped by W_uv. Exact like `_absorbed` (same products, regrouped)."""
        q_len, kv_len = q_nope.shape[2], latent.shape[2]
        query = torch.cat((self._query_latent(q_nope), q_rope), dim=-1)  # [B, H, T, d_c+d_r]
        key = torch.cat((latent, k_rope), dim=-1).expand(-1, query.shape[1], -1, -1)  # [B, H, S, d_c+d_r], a view
        causal = attention_mask is None
        if causal and q_len != kv_len:  # queries at the last positions: sdpa's is_causal aligns to the first
            attention_mask, causal = offset_causal_mask(q_len, kv_len, latent.device), False
        out = nn.functional.scaled_dot_product_attention(
            query, key, key, attn_mask=attention_mask, is_causal=causal, scale=self.scaling,
            dropout_p=self.attention_dropout if self.training else 0.0,
        )  # [B, H, T, d_c+d_r]
        return self._from_latent(out[..., : self.kv_lora_rank])

    def _normalized_keys(self, k_nope, k_rope, key_position_embeddings):
        """Exact per-head key norm: k_nope [B, G, S, d_h] and the cached pre-norm, unrotated rope key k_rope
        [B, 1, S, d_r] -> the normalized key's nope part [B, G, S, d_h] and its rope key [B, 1, S, d_r], rotated at
        the key positions (`key_position_embeddings`: cos/sin [B|1, S, d_h] of the source head dim)."""
        groups, d_r = self.groups, self.qk_rope_head_dim
        up = self.k_rope_up.view(groups, -1, d_r)  # R_g [G, d_h, d_r]
        key = k_nope + torch.einsum("bsr,gdr->bgsd", k_rope[:, 0], up)  # each group's source key, before its norm
        if self.whole_norm:  # one RMS over every group's key of a token
            bsz, _, kv_len, head_dim = key.shape
            key = self.k_norm(key.transpose(1, 2).reshape(bsz, kv_len, -1)).view(bsz, kv_len, groups, head_dim)
            key = key.transpose(1, 2)
        else:
            key = self.k_norm(key)
        rope = torch.einsum("bgsd,rgd->bsr", key, self.k_rope_down.view(d_r, groups, -1))  # K n: [B, S, d_r]
        nope = key - torch.einsum("bsr,gdr->bgsd", rope, up)
        kv_len = key.shape[2]  # a sliding layer's cache holds the last rows: the positions' tail
        cos, sin = self._rope_cos_sin(tuple(t[..., -kv_len:, :] for t in key_position_embeddings))
        return nope, rotate(rope.unsqueeze(1), cos, sin)

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`W_uk` [G, d_n, d_c] and `W_uv` [G, d_v, d_c], views of `kv_b_proj.weight`."""
        w = local(self.kv_b_proj.weight).view(-1, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]

    def _absorbed(self, q_nope, q_rope, latent, k_rope, attention_mask, filled=None):
        """-> (output [B, H, T, d_v], attention weights [B, H, T, S] with eager attention, else None)."""
        bsz, _, q_len, _ = q_nope.shape
        q_latent = self._query_latent(q_nope)  # [B, H, T, d_c]
        weights = None
        if self.config._attn_implementation == "eager" or self.softcap:  # weights asked for, or scores capped
            out_latent, weights = latent_attention_eager(q_latent, q_rope, latent, k_rope, attention_mask, self.scaling,
                                                         self.softcap)
        elif self._use_kernel(q_len, attention_mask):
            from mla_convert.kernels import mla_decode

            if filled is None:
                lengths = torch.full((bsz,), latent.shape[2], dtype=torch.int32, device=latent.device)
            else:
                lengths = filled.expand(bsz)  # the static cache's counter, read on the device
            valid = None
            if attention_mask is not None:  # bool [B|1, 1, 1, S']: padding, and a static cache's unwritten rows
                valid = attention_mask[:, 0, 0, : latent.shape[2]]  # [B|1, S]
            # "triton" forces the kernel even off CUDA (Triton's interpreter, for tests); "auto" is CUDA-only here.
            backend = "triton" if self.config.mla_decode_kernel == "triton" else "auto"
            out_latent = mla_decode(
                q_latent[:, :, 0], q_rope[:, :, 0], latent[:, 0], k_rope[:, 0], lengths, self.scaling, valid=valid,
                backend=backend,
            ).unsqueeze(2)  # [B, H, 1, d_c]
        else:
            out_latent = latent_attention(q_latent, q_rope, latent, k_rope, attention_mask, self.scaling)
        return self._from_latent(out_latent), weights

    def _query_latent(self, q_nope: torch.Tensor) -> torch.Tensor:
        """Each head's nope query [B, H, T, d_n] mapped into the latent through its group's W_uk: [B, H, T, d_c].
        The nope key bias adds a per-query constant to every score, which softmax cancels: it is left out."""
        bsz, heads, q_len, _ = q_nope.shape
        w_uk, _ = self.absorbed_weights()
        q_latent = torch.einsum("bgrtn,gnc->bgrtc", q_nope.view(bsz, -1, self.per_group, q_len, q_nope.shape[-1]), w_uk)
        return q_latent.reshape(bsz, heads, q_len, self.kv_lora_rank)

    def _from_latent(self, out_latent: torch.Tensor) -> torch.Tensor:
        """Attention output in the latent [B, H, T, d_c] -> each head's value space through W_uv [B, H, T, d_v]."""
        bsz, heads, q_len, _ = out_latent.shape
        per_group = self.per_group
        _, w_uv = self.absorbed_weights()
        out = torch.einsum("bgrtc,gvc->bgrtv", out_latent.reshape(bsz, -1, per_group, q_len, self.kv_lora_rank), w_uv)
        out = out.reshape(bsz, heads, q_len, self.v_head_dim)
        if self.kv_b_proj.bias is not None:  # softmax weights sum to one: the value bias passes through unchanged
            v_bias = local(self.kv_b_proj.bias).view(-1, self.qk_nope_head_dim + self.v_head_dim)[:, self.qk_nope_head_dim :]
            out = out + v_bias.repeat_interleave(per_group, dim=0)[None, :, None, :]
        return out  # [B, H, T, d_v]

    def _use_kernel(self, q_len: int, attention_mask: torch.Tensor | None) -> bool:
        choice = self.config.mla_decode_kernel
        if choice == "torch" or q_len != 1:
            return False
        if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.shape[1] != 1):
            return False  # additive (eager) masks take the torch path
        if choice == "triton":
            return True
        from mla_convert.kernels import triton_available

        return self.kv_b_proj.weight.is_cuda and triton_available()


def grouped_fits(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """Whether `grouped_sdpa` takes this attention: kv groups shared by several query heads, and an explicit mask
    that is the same for every head (with no mask, sdpa's causal kernel needs each row at its own position)."""
    return (attention_mask is not None and attention_mask.dim() == 4 and attention_mask.shape[1] == 1
            and key.shape[1] < query.shape[1])


def grouped_sdpa(query, key, value, attention_mask, scaling: float, dropout: float = 0.0) -> torch.Tensor:
    """sdpa over query [B, H, T, d] and one kv head per group (key, value [B, G, S, d]) with the H / G query heads of
    a group stacked as rows of one head, their mask rows repeated: the fused kernel reads each group's keys once and no
    per-head copy of keys and values is made (or summed back in the backward). The same products as repeating each
    group's keys for its heads. -> [B, H, T, d_v]."""
    bsz, heads, q_len, width = query.shape
    groups = key.shape[1]
    per = heads // groups
    mask = attention_mask[:, :, None].expand(-1, -1, per, q_len, -1).reshape(attention_mask.shape[0], 1, per * q_len, -1)
    out = nn.functional.scaled_dot_product_attention(query.reshape(bsz, groups, per * q_len, width), key, value,
                                                     attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.view(bsz, heads, q_len, -1)


def offset_causal_mask(q_len: int, kv_len: int, device) -> torch.Tensor:
    """bool [T, S], True = attend: query t sits at position S - T + t and sees the keys up to it."""
    return torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)


def latent_attention(q_latent, q_rope, latent, k_rope, attention_mask, scaling):
    """Attention over the latent cache, rope and nope scores taken apart (torch reference of the decode kernel).

    q_latent [B, H, T, d_c], q_rope [B, H, T, d_r], latent [B, 1, S, d_c], k_rope [B, 1, S, d_r];
    attention_mask: None (causal: query t sits at position S - T + t), bool [B, 1, T, S] (True = attend) or
    additive float. -> [B, H, T, d_c]
    """
    # An MQA over the latent: the heads are folded into the query rows of one kv head whose keys and values are both
    # the cached latent, so one fused sdpa call reads each cached row once for the scores and the weighted sum (a
    # broadcast over the head dim would make matmul copy the whole cache once per head, far slower; separate
    # score and value matmuls read the latent twice). The rope score is taken apart, one [B, H*T, d_r] @ [B, d_r, S]
    # bmm over the rope key, and enters sdpa as its additive mask (already scaled, as sdpa adds it after scaling).
    bsz, heads, q_len, d_c = q_latent.shape
    d_r = q_rope.shape[-1]
    kv_len = latent.shape[-2]
    rows = heads * q_len
    bias = None
    if d_r:
        bias = torch.bmm(q_rope.reshape(bsz, rows, d_r), k_rope[:, 0].transpose(1, 2)).mul_(scaling)  # [B, H*T, S]
        bias = bias.view(bsz, 1, rows, kv_len)
    if attention_mask is None and q_len > 1:
        attention_mask = offset_causal_mask(q_len, kv_len, latent.device)
    if attention_mask is not None:  # [B|1, 1, T|1, S'] or [T, S] -> one row per (head, query): [B|1, 1, H*T, S]
        mask = attention_mask[..., :kv_len]
        mask = mask.expand(*mask.shape[:-2], q_len, kv_len).reshape(-1, 1, 1, q_len, kv_len)
        mask = mask.expand(-1, 1, heads, q_len, kv_len).reshape(-1, 1, rows, kv_len)
        if bias is None:
            bias = mask if mask.dtype == torch.bool else mask.to(latent.dtype)
        elif mask.dtype == torch.bool:
            bias = bias.masked_fill(~mask, float("-inf"))
        else:
            bias = bias + mask.to(bias.dtype)
    query = q_latent.reshape(bsz, 1, rows, d_c)  # [B, 1, H*T, d_c]
    out = nn.functional.scaled_dot_product_attention(query, latent, latent, attn_mask=bias, scale=scaling)
    return out.view(bsz, heads, q_len, d_c)


def latent_attention_eager(q_latent, q_rope, latent, k_rope, attention_mask, scaling, softcap: float | None = None):
    """`latent_attention` with its scores materialised: -> (output [B, H, T, d_c], softmax weights [B, H, T, S]).

    The same products (nope scores against the latent, rope scores against the rope key, weighted sum of the latent),
    so the same result; used under eager attention, whose callers read the weights (`output_attentions`).
    """
    q_len, kv_len = q_latent.shape[2], latent.shape[2]
    scores = torch.matmul(q_latent, latent.transpose(-1, -2))  # [B, H, T, S]
    if q_rope.shape[-1]:
        scores = scores + torch.matmul(q_rope, k_rope.transpose(-1, -2))
    scores = soft_cap(scores * scaling, softcap)
    if attention_mask is None and q_len > 1:
        attention_mask = offset_causal_mask(q_len, kv_len, latent.device)
    if attention_mask is not None:
        mask = attention_mask[..., :kv_len]
        if mask.dtype == torch.bool:  # as eager attention masks: the dtype's minimum, so a fully masked row stays finite
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + mask.to(scores.dtype)
    weights = nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(q_latent.dtype)
    return torch.matmul(weights, latent), weights


class MLADecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: MLAConfig, layer_idx: int):
        super().__init__()
        self.self_attn = MLAAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.norm_layout = layout = config.norm_layout
        hidden = config.hidden_size
        if layout != "post":  # the attention's input normalized (Llama, Gemma 2)
            self.input_layernorm = rms_norm(config, hidden)
        # "pre": the MLP's input; "post" and "sandwich": the attention's output
        self.post_attention_layernorm = rms_norm(config, hidden)
        if layout == "sandwich":
            self.pre_feedforward_layernorm = rms_norm(config, hidden)
        if layout != "pre":  # the MLP's output normalized (OLMo 2, Gemma 2)
            self.post_feedforward_layernorm = rms_norm(config, hidden)

    @renamed_cache_kwarg
    def forward(self, hidden_states, attention_mask=None, cache=None, position_embeddings=None, **kwargs):
        cache = take_cache(cache, kwargs)
        residual = hidden_states
        attention, _ = self.self_attn(
            hidden_states if self.norm_layout == "post" else self.input_layernorm(hidden_states),
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            cache=cache,
            **kwargs,
        )
        if self.norm_layout == "post":
            hidden_states = residual + self.post_attention_layernorm(attention)
            return hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))
        if self.norm_layout == "sandwich":
            hidden_states = residual + self.post_attention_layernorm(attention)
            return hidden_states + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden_states)))
        hidden_states = residual + attention
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class MLAPreTrainedModel(PreTrainedModel):
    config_class = MLAConfig
    config: MLAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MLADecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False  # nope+rope and value head dims differ
    _supports_flex_attn = False
    _can_compile_fullgraph = True
    # the expanded form calls the attention function registered under config._attn_implementation
    _supports_attention_backend = True
    _can_record_outputs = {"hidden_states": MLADecoderLayer, "attentions": MLAAttention}


class MLAModel(MLAPreTrainedModel):
    def __init__(self, config: MLAConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([MLADecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = rms_norm(config, config.hidden_size)
        self.rotary_emb = LlamaRotaryEmbedding(config=config)  # the source head_dim's frequencies
        if config.local_rope_parameters is not None:  # the sliding layers' own (Gemma 3)
            import copy

            local = copy.copy(config)
            local.rope_parameters = dict(config.local_rope_parameters)
            self.rotary_emb_local = LlamaRotaryEmbedding(config=local)
        self.gradient_checkpointing = False
        self.post_init()

    @renamed_cache_kwarg
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache: Cache | None = None,
        inputs_embeds=None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        cache = take_cache(cache, kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
            if self.config.embed_scale is not None:  # Gemma: the scale in the weights' dtype, as the source rounds it
                inputs_embeds = inputs_embeds * torch.tensor(self.config.embed_scale, dtype=inputs_embeds.dtype)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        hold_latent_typed(cache, self.config)
        if position_ids is None:
            past_seen = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen).unsqueeze(0)
        # one mask per layer type (Gemma 2 alternates windowed and full layers); generation may pass them prepared
        masks = attention_mask if isinstance(attention_mask, dict) else {}
        for kind in {layer.self_attn.layer_type for layer in self.layers} - set(masks):
            make_mask = create_causal_mask if kind == "full_attention" else create_sliding_window_causal_mask
            masks[kind] = make_mask(self.config, inputs_embeds, attention_mask, cache, position_ids=position_ids)
        hidden_states = inputs_embeds
        rotaries = {False: self.rotary_emb}
        if self.config.local_rope_parameters is not None:
            rotaries[True] = self.rotary_emb_local
        position_embeddings = {local: rotary(hidden_states, position_ids=position_ids) for local, rotary in rotaries.items()}
        key_embeddings = {}
        if self.config.qk_norm == "exact":  # the keys are rotated at attention time: their positions, every step
            keys_at = key_positions(position_ids, cache)
            key_embeddings = {local: rotary(hidden_states, position_ids=keys_at) for local, rotary in rotaries.items()}
        for layer in self.layers:
            local = layer.self_attn.local_rope
            if key_embeddings:
                kwargs["key_position_embeddings"] = key_embeddings[local]
            hidden_states = layer(
                hidden_states,
                attention_mask=masks[layer.self_attn.layer_type],
                position_embeddings=position_embeddings[local],
                **cache_kwargs(cache),  # the installed release's name: gradient checkpointing drops it by name
                position_ids=position_ids,
                **kwargs,
            )
        return BaseModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **cache_kwargs(cache))


def key_positions(position_ids: torch.Tensor, cache: Cache | None) -> torch.Tensor:
    """Positions of every key a step attends to [B|1, S]: the step's own without a past; with one, the cached keys
    are taken to precede the step's last token contiguously (as in generation, left padding included: padded rows
    are masked, and RoPE scores depend on position differences only)."""
    past = cache.get_seq_length() if cache is not None else 0
    if past == 0:
        return position_ids
    total = past + position_ids.shape[1]
    return position_ids[:, -1:] - (total - 1) + torch.arange(total, device=position_ids.device)


class MLAForCausalLM(MLAPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # the head sharded over the vocabulary, as the embedding it may be tied to (`embedding_rowwise`)
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: MLAConfig):
        super().__init__(config)
        self.model = MLAModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @renamed_cache_kwarg
    @can_return_tuple
    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache: Cache | None = None,
        inputs_embeds=None,
        labels=None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast:
        cache = take_cache(cache, kwargs)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = soft_cap(self.lm_head(hidden_states[:, keep, :]), self.config.final_logit_softcapping)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **cache_kwargs(output_cache(outputs)),
        )


AutoConfig.register("mla", MLAConfig, exist_ok=True)
AutoModel.register(MLAConfig, MLAModel, exist_ok=True)
AutoModelForCausalLM.register(MLAConfig, MLAForCausalLM, exist_ok=True)
