"""Configuration of the native MLA model (`model_type: "mla"`).

It is a Llama configuration (embeddings, MLP, norms, RoPE frequencies of the *source* head dim) plus the shape of the
latent attention. Per layer and token the KV cache holds `kv_lora_rank[layer]` latent values plus `qk_rope_head_dim`
values of the shared, already-rotated RoPE key; nothing per head.

RoPE of the shared key uses rotate_half layout inside the `qk_rope_head_dim` dims: dim `j` pairs with
`j + qk_rope_head_dim/2`, and pair `j` of layer `l` rotates with the source frequency index `rope_pairs[l][j]`
(an index into the source model's `head_dim/2` inverse frequencies, whatever RoPE scaling produced them).

`qk_norm` (sources that RMS-normalize each query and key head before RoPE, e.g. Qwen3): None for none; "exact": the
query is the source's (`q_proj` -> `q_norm` -> `q_head_proj`), the cache holds the latent and the rope key *before*
norm and rotation, and attention rebuilds each group's key, normalizes it (`k_norm`) and rotates it, in its expanded
form only; "calibrated": the query as in "exact", the key's per-token RMS replaced at conversion by a calibration
statistic (folded into the weights), so the key side is plain MLA (absorbed decode).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers.models.llama.configuration_llama import LlamaConfig


@strict
class MLAConfig(LlamaConfig):
    model_type = "mla"

    kv_lora_rank: int | list[int] = 64
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

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        if self.qk_nope_head_dim is None:
            self.qk_nope_head_dim = self.head_dim
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim
        if self.softmax_scale is None:
            self.softmax_scale = self.head_dim**-0.5
        if self.o_proj_bias is None:
            self.o_proj_bias = self.attention_bias
        if isinstance(self.kv_lora_rank, int):
            self.kv_lora_rank = [self.kv_lora_rank] * self.num_hidden_layers
        if self.rope_pairs is None:
            self.rope_pairs = [list(range(self.qk_rope_head_dim // 2)) for _ in range(self.num_hidden_layers)]

    def validate_architecture(self):
        super().validate_architecture()
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if len(self.kv_lora_rank) != self.num_hidden_layers or len(self.rope_pairs) != self.num_hidden_layers:
            raise ValueError("kv_lora_rank and rope_pairs need one entry per layer")
        for pairs in self.rope_pairs:
            if len(pairs) != self.qk_rope_head_dim // 2 or any(not 0 <= p < self.head_dim // 2 for p in pairs):
                raise ValueError("each rope_pairs entry needs qk_rope_head_dim/2 source frequency indices")
        if self.mla_attention_mode not in ("auto", "expanded", "absorbed"):
            raise ValueError(f"mla_attention_mode must be auto, expanded or absorbed, got {self.mla_attention_mode}")
        if self.qk_norm not in (None, "exact", "calibrated"):
            raise ValueError(f"qk_norm must be null, exact or calibrated, got {self.qk_norm}")
        if self.qk_norm and self.qk_nope_head_dim != self.head_dim:
            raise ValueError("qk_norm needs qk_nope_head_dim == head_dim (the nope key is the source head's)")
        if self.mla_decode_kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"mla_decode_kernel must be auto, torch or triton, got {self.mla_decode_kernel}")

    def kv_cache_elements_per_token(self) -> int:
        """Cached values per token summed over layers (latent + rope key)."""
        return sum(r + self.qk_rope_head_dim for r in self.kv_lora_rank)


__all__ = ["MLAConfig"]
