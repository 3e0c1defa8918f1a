"""Configuration of the native MLA model (`model_type: "mla"`).

It is a Llama configuration (embeddings, MLP, norms, RoPE frequencies of the *source* head dim) plus the shape of the
latent attention. Per layer and token the KV cache holds `kv_lora_rank` latent values plus `qk_rope_head_dim` values of
the shared, already-rotated RoPE key; nothing per head.

Latent ranks differ per layer. They are stored the way transformers 5.x stores per-layer values
(`PreTrainedConfig.per_layer_config`): `kv_lora_rank` is one number, the largest rank, and `per_layer_config` maps each
layer whose rank is smaller to `{"kv_lora_rank": rank}`. Per layer read `config.per_layer_config[layer].kv_lora_rank`,
or all at once `config.kv_lora_ranks`; on a config whose ranks differ, transformers refuses `config.kv_lora_rank`
(`AmbiguousGlobalPerLayerAttributeError`), while a reader of config.json gets a number that bounds every layer's
rank. A list (`kv_lora_rank: [r_0, r_1, ...]`, the format before, or a caller's) is read as one rank per layer.

RoPE of the shared key uses rotate_half layout inside the `qk_rope_head_dim` dims: dim `j` pairs with
`j + qk_rope_head_dim/2`, and pair `j` of layer `l` rotates with the source frequency index `rope_pairs[l][j]`
(an index into the source model's `head_dim/2` inverse frequencies, whatever RoPE scaling produced them).

`qk_norm` (sources that RMS-normalize each query and key head before RoPE, e.g. Qwen3): None for none; "exact": the
query is the source's (`q_proj` -> `q_norm` -> `q_head_proj`), the cache holds the latent and the rope key *before*
norm and rotation, and attention rebuilds each group's key, normalizes it (`k_norm`) and rotates it, in its expanded
form only; "calibrated": the query as in "exact", the key's per-token RMS replaced at conversion by a calibration
statistic (folded into the weights), so the key side is plain MLA (absorbed decode).

`latent_cache_type` (not a declared field: set on a loaded model, or passed to from_pretrained, and saved only when
set): the cache type the cached row [latent, rope key] is stored in (mla_convert.kvquant: "q8_0", "q4_0", ... in
ggml's blocks of 32, as llama.cpp's --cache-type-k stores it, the latent zero-padded to whole blocks); absent: the
model's own dtype.

`sliding_window` (sources whose queries see a window of recent positions, e.g. Mistral v0.1): the causal mask is
limited to the window in every form (expanded, latent prefill, absorbed decode), and the cache keeps the window's rows.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig


# Tensor parallelism (`tp_plan="auto"`): each rank keeps a slice of the query heads (q_proj, and q_head_proj with
# qk_norm) and of the kv groups they read (kv_b_proj: per group nope key and value), and o_proj sums the ranks'
# outputs; the latent projection (kv_a_proj) and so the cache are whole on every rank. MLP as Llama's. With gradients,
# attention takes the expanded form under tensor parallelism (MLAAttention.sharded_for_training).
MLP_TP_PLAN = {
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}
ATTENTION_TP_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    # whole on each rank; the rope key's gradient (from this rank's heads only) is summed over the ranks
    "layers.*.self_attn.kv_a_proj": "mla_kv_a_proj",
    "layers.*.self_attn.kv_b_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}


@strict
class MLAConfig(LlamaConfig):
    model_type = "mla"
    base_model_tp_plan = {**ATTENTION_TP_PLAN, **MLP_TP_PLAN}

    kv_lora_rank: int | list[int] = 64  # a list: one per layer, stored as per_layer_config (see above)
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_pairs: list[list[int]] | None = None
    softmax_scale: float | None = None
    o_proj_bias: bool | None = None
    # "auto": absorbed weights for decode steps (one new token over a cache); for several tokens (prefill, training)
    # the cheaper of expanded K/V and attention over the latent (MLAAttention.use_latent_prefill). "expanded" and
    # "absorbed" force one form.
    mla_attention_mode: str = "auto"
    # "auto": the Triton kernel on CUDA when triton is importable, the torch reference elsewhere.
    mla_decode_kernel: str = "auto"
    qk_norm: str | None = None
    # each query attends to the last `sliding_window` positions only, its own included (Mistral's window); None: its
    # whole past. transformers' DynamicCache then keeps only the rows a later query can see.
    sliding_window: int | None = None
    # with qk_norm: "head" (each head's RMS over head_dim, Qwen3) or "projection" (one RMS over the whole query
    # projection H*d_h and one over the whole key projection G*d_h, OLMo 2)
    qk_norm_scope: str = "head"
    # where a block normalizes: "pre" (inputs: input_layernorm, post_attention_layernorm before the MLP; Llama),
    # "post" (outputs: post_attention_layernorm, post_feedforward_layernorm; OLMo 2) or "sandwich" (both:
    # input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm; Gemma 2)
    norm_layout: str = "pre"
    # Gemma: token embeddings multiplied by embed_scale (sqrt(hidden_size), in the weights' dtype); RMS norms that
    # multiply by (1 + weight), in float32, as Gemma's; tanh soft-capping of the attention scores (after the softmax
    # scale) and of the final logits
    embed_scale: float | None = None
    norm_unit_offset: bool = False
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # per layer "sliding_attention" (within `sliding_window`) or "full_attention"; None: every layer as
    # `sliding_window` says. Always a list once built: transformers' caches keep a window's rows in the sliding layers
    # by it, and generation prepares one mask per type wherever a config has the attribute
    layer_types: list[str] | None = None
    # the sliding layers' RoPE where it differs from `rope_parameters` (Gemma 3's local base); None: one RoPE
    local_rope_parameters: dict | None = None

    def __post_init__(self, **kwargs):
        if isinstance(self.kv_lora_rank, (list, tuple)):  # one rank per layer -> the largest + per-layer overrides
            ranks = [int(r) for r in self.kv_lora_rank]
            layers = kwargs.get("num_hidden_layers", self.num_hidden_layers)
            if len(ranks) != layers:
                raise ValueError(f"kv_lora_rank needs one entry per layer ({layers}), got {len(ranks)}")
            self.kv_lora_rank = max(ranks)
            per_layer = {int(i): dict(v) for i, v in (kwargs.get("per_layer_config") or {}).items()}
            for i, rank in enumerate(ranks):
                per_layer.setdefault(i, {})["kv_lora_rank"] = rank
            kwargs["per_layer_config"] = per_layer  # entries equal to the global value are dropped by transformers
        super().__post_init__(**kwargs)
        if self.qk_nope_head_dim is None:
            self.qk_nope_head_dim = self.head_dim
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        if self.softmax_scale is None:
            self.softmax_scale = self.head_dim**-0.5
        if self.o_proj_bias is None:
            self.o_proj_bias = self.attention_bias
        if self.qk_norm == "exact" or (self.qk_norm and self.qk_norm_scope == "projection"):
            # the key norm (and a query norm over the whole projection) rebuilds every group's key from the shared rope key (k_rope_up/k_rope_down span all
            # groups): attention stays whole on each rank
            self.base_model_tp_plan = dict(MLP_TP_PLAN)
        elif self.qk_norm:
            self.base_model_tp_plan = {
                **ATTENTION_TP_PLAN,
                "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",  # sees this rank's heads only
                "layers.*.self_attn.q_head_proj": "colwise",
                **MLP_TP_PLAN,
            }
        if self.layer_types is None:
            kind = "full_attention" if self.sliding_window is None else "sliding_attention"
            self.layer_types = [kind] * self.num_hidden_layers
        if self.rope_pairs is None:
            self.rope_pairs = [list(range(self.qk_rope_head_dim // 2)) for _ in range(self.num_hidden_layers)]

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        # transformers sets most kwargs after construction, checking each with hasattr first, which a per-layer
        # attribute refuses on a heterogeneous config: kv_lora_rank is given to the constructor instead, and a number
        # means that rank in every layer
        if "kv_lora_rank" in kwargs:
            rank = kwargs.pop("kv_lora_rank")
            if not isinstance(rank, (list, tuple)):
                layers = kwargs.get("num_hidden_layers", config_dict.get("num_hidden_layers"))
                rank = [rank] * int(layers if layers is not None else cls().num_hidden_layers)
            config_dict = {**config_dict, "kv_lora_rank": list(rank)}
        return super().from_dict(config_dict, **kwargs)

    def __setattr__(self, key, value):
        if key == "kv_lora_rank" and isinstance(value, (list, tuple)) and self.__dict__.get("_post_init_done"):
            # one rank per layer set on a built config (`config.kv_lora_rank = [r_0, r_1, ...]`)
            ranks = [int(r) for r in value]
            if len(ranks) != self.num_hidden_layers:
                raise ValueError(f"kv_lora_rank needs one entry per layer ({self.num_hidden_layers}), got {len(ranks)}")
            overrides = self._heterogeneity_spec.per_layer_overrides if self.is_heterogeneous else {}
            per_layer = {i: dict(overrides.get(i, {})) for i in range(self.num_hidden_layers)}
            for i, rank in enumerate(ranks):
                per_layer[i]["kv_lora_rank"] = rank
            super().__setattr__("per_layer_config", None)
            super().__setattr__("kv_lora_rank", max(ranks))
            super().__setattr__("per_layer_config", per_layer)
            return
        super().__setattr__(key, value)

    def validate_architecture(self):
        super().validate_architecture()
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if len(self.rope_pairs) != self.num_hidden_layers:
            raise ValueError("rope_pairs needs one entry per layer")
        if any(rank < 1 for rank in self.kv_lora_ranks):
            raise ValueError(f"kv_lora_rank must be positive in every layer, got {self.kv_lora_ranks}")
        for pairs in self.rope_pairs:
            if len(pairs) != self.qk_rope_head_dim // 2 or any(not 0 <= p < self.head_dim // 2 for p in pairs):
                raise ValueError("each rope_pairs entry needs qk_rope_head_dim/2 source frequency indices")
        if self.mla_attention_mode not in ("auto", "expanded", "absorbed"):
            raise ValueError(f"mla_attention_mode must be auto, expanded or absorbed, got {self.mla_attention_mode}")
        if self.qk_norm not in (None, "exact", "calibrated"):
            raise ValueError(f"qk_norm must be null, exact or calibrated, got {self.qk_norm}")
        if self.qk_norm and self.qk_nope_head_dim != self.head_dim:
            raise ValueError("qk_norm needs qk_nope_head_dim == head_dim (the nope key is the source head's)")
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be a positive number of positions or null, got {self.sliding_window}")
        if self.norm_layout not in ("pre", "post", "sandwich"):
            raise ValueError(f"norm_layout must be pre, post or sandwich, got {self.norm_layout}")
        if self.layer_types is not None and (len(self.layer_types) != self.num_hidden_layers or any(
                t not in ("sliding_attention", "full_attention") for t in self.layer_types)):
            raise ValueError("layer_types needs one sliding_attention or full_attention per layer")
        if "sliding_attention" in (self.layer_types or ()) and self.sliding_window is None:
            raise ValueError("sliding_attention layers need a sliding_window")
        if self.qk_norm_scope not in ("head", "projection"):
            raise ValueError(f"qk_norm_scope must be head or projection, got {self.qk_norm_scope}")
        if self.mla_decode_kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"mla_decode_kernel must be auto, torch or triton, got {self.mla_decode_kernel}")

    @property
    def kv_lora_ranks(self) -> list[int]:
        """The latent rank of each layer."""
        return [layer.kv_lora_rank for layer in self.per_layer_config]

    def kv_cache_elements_per_token(self) -> int:
        """Cached values per token summed over layers (latent + rope key)."""
        return sum(r + self.qk_rope_head_dim for r in self.kv_lora_ranks)


def layer_ranks(config: dict) -> list[int]:
    """Each layer's latent rank from a config.json dict, in either format: a list (one per layer) or a number with
    per-layer overrides in `per_layer_config`. [] when the dict has no kv_lora_rank."""
    rank = config.get("kv_lora_rank")
    if rank is None:
        return []
    if isinstance(rank, list):
        return [int(r) for r in rank]
    overrides = {int(i): v for i, v in (config.get("per_layer_config") or {}).items()}
    layers = int(config.get("num_hidden_layers") or 0) or max(overrides, default=0) + 1
    return [int(overrides.get(i, {}).get("kv_lora_rank", rank)) for i in range(layers)]


__all__ = ["MLAConfig", "layer_ranks"]
