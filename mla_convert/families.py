"""Source model families as data: tensor names, biases, the decoder layer class, and what is refused and why.

Code elsewhere looks a family up here and never branches on model types itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from mla_convert.errors import UserError


@dataclass(frozen=True)
class Family:
    name: str  # the CLI command that converts it
    model_types: tuple[str, ...]
    qkv_bias: bool | None  # True: q/k/v always have biases; None: follow `config.attention_bias`
    o_bias: bool | None  # as above, for o_proj
    decoder_layers: dict[str, str]  # model_type -> "module:Class" of its transformers decoder layer (calibration)
    # model types whose q/k/v biases follow `config.attention_bias` whatever `qkv_bias` says (Qwen3 within Qwen)
    declared_bias_types: tuple[str, ...] = ()
    # model types that RMS-normalize every query and key head over head_dim (with a learned [head_dim] weight) before
    # RoPE, and the tensors of those weights
    qk_norm_types: tuple[str, ...] = ()
    # of those, the model types whose q/k norm spans the whole projection (one RMS over H*d_h for the query and over
    # G*d_h for the key, weights of that length: OLMo 2) instead of each head
    projection_norm_types: tuple[str, ...] = ()
    # model types whose blocks normalize the attention's and the MLP's outputs (post_attention_layernorm,
    # post_feedforward_layernorm) and not their inputs (no input_layernorm): OLMo 2
    post_norm_types: tuple[str, ...] = ()
    # model types whose blocks normalize both inputs and outputs (input_layernorm, post_attention_layernorm,
    # pre_feedforward_layernorm, post_feedforward_layernorm): Gemma 2
    sandwich_norm_types: tuple[str, ...] = ()
    # Gemma: embeddings scaled by sqrt(hidden_size), RMS norms that multiply by (1 + weight), the MLP's activation in
    # `hidden_activation`, attention and final logit soft-capping, `query_pre_attn_scalar`, windows on the layers
    # `layer_types` names
    gemma_types: tuple[str, ...] = ()
    activations: tuple[str, ...] = ("silu", "swish")
    # model types whose attention may look back over a sliding window only (`config.sliding_window`), which the native
    # model keeps (mask and cache); no engine the checkpoint exports to or serves in holds one
    sliding_window_types: tuple[str, ...] = ()
    # model types that store q/k/v as one `qkv_proj` tensor and the MLP's gate and up as one `gate_up_proj` (Phi-3):
    # the source is read as if they were apart (`fused_parts`), which is exact (row slices)
    fused_types: tuple[str, ...] = ()
    q_norm: str = "self_attn.q_norm"
    k_norm: str = "self_attn.k_norm"
    layer_prefix: str = "model.layers.{i}."
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"

    def attention_biases(self, config) -> tuple[bool, bool]:
        """(q/k/v have biases, o_proj has a bias) for a source config of this family."""
        declared = bool(getattr(config, "attention_bias", False))
        follows = self.qkv_bias is None or getattr(config, "model_type", None) in self.declared_bias_types
        qkv = declared if follows else self.qkv_bias
        o = declared if self.o_bias is None else self.o_bias
        return qkv, o

    def has_qk_norm(self, config) -> bool:
        """Whether a source config of this family normalizes each query and key head before RoPE."""
        return getattr(config, "model_type", None) in self.qk_norm_types

    def qk_norm_scope(self, config) -> str | None:
        """"head" (each head's RMS), "projection" (the whole projection's) or None (no q/k norm)."""
        if not self.has_qk_norm(config):
            return None
        return "projection" if getattr(config, "model_type", None) in self.projection_norm_types else "head"

    def norm_layout(self, config) -> str:
        """"pre" (Llama), "post" (OLMo 2) or "sandwich" (Gemma 2): MLAConfig.norm_layout."""
        model_type = getattr(config, "model_type", None)
        return "post" if model_type in self.post_norm_types else "sandwich" if model_type in self.sandwich_norm_types else "pre"

    def gemma(self, config) -> bool:
        return getattr(config, "model_type", None) in self.gemma_types

    def sliding_window(self, config) -> int | None:
        """The window (in tokens, the query's own included) a source config of this family attends within, or None
        where every query sees its whole past (no window, or one no shorter than the context)."""
        window = getattr(config, "sliding_window", None)
        if window is None or not getattr(config, "use_sliding_window", True):
            return None
        if window >= getattr(config, "max_position_embeddings", 0):
            return None
        return window

    def engine_limits(self, config) -> list[str]:
        """What in a source config of this family no engine can run (vLLM's MLA kernels, the DeepSeek-V3 and GGUF
        exports): the converted checkpoint runs in transformers only."""
        window = self.sliding_window(config)
        limits = [f"a sliding attention window ({window} tokens)"] if window is not None else []
        if self.norm_layout(config) == "post":
            limits.append("post-norm blocks (the attention's and MLP's outputs normalized)")
        if self.gemma(config):
            limits.append("scaled embeddings and (1 + weight) norms")
        if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
            limits.append("logit soft-capping")
        if self.qk_norm_scope(config) == "projection":
            limits.append("q/k norms over the whole projection")
        return limits

    def fused_parts(self, config) -> dict[str, list[tuple[str, int, int]]]:
        """{fused tensor (within a layer): [(the part's name, first row, end row), ...]} of a source config of this
        family, {} where nothing is fused. Rows in the order the source's forward splits them: q, k, v; gate, up."""
        if getattr(config, "model_type", None) not in self.fused_types:
            return {}
        heads = config.num_attention_heads
        groups = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        q, kv, inter = heads * head_dim, groups * head_dim, config.intermediate_size
        return {
            "self_attn.qkv_proj.weight": [("self_attn.q_proj.weight", 0, q), ("self_attn.k_proj.weight", q, q + kv),
                                          ("self_attn.v_proj.weight", q + kv, q + 2 * kv)],
            "mlp.gate_up_proj.weight": [("mlp.gate_proj.weight", 0, inter), ("mlp.up_proj.weight", inter, 2 * inter)],
        }

    def tensor(self, layer: int, proj: str, kind: str = "weight") -> str:
        return f"{self.layer_prefix.format(i=layer)}{getattr(self, proj)}.{kind}"

    def decoder_layer_class(self, model_type: str):
        import importlib

        module, cls = self.decoder_layers[model_type].split(":")
        return getattr(importlib.import_module(module), cls)


FAMILIES = {
    "llama": Family(
        name="llama",
        model_types=("llama", "mistral"),
        qkv_bias=None,
        o_bias=None,
        decoder_layers={
            "llama": "transformers.models.llama.modeling_llama:LlamaDecoderLayer",
            "mistral": "transformers.models.mistral.modeling_mistral:MistralDecoderLayer",
        },
        sliding_window_types=("mistral",),
    ),
    "phi3": Family(
        name="phi3",
        model_types=("phi3",),
        qkv_bias=False,
        o_bias=False,
        # read apart (fused_parts), a Phi-3 layer is a Llama layer: calibration runs it as one
        decoder_layers={"phi3": "mla_convert.families:llama_layer"},
        sliding_window_types=("phi3",),
        fused_types=("phi3",),
    ),
    "olmo2": Family(
        name="olmo2",
        model_types=("olmo2",),
        qkv_bias=None,
        o_bias=None,
        decoder_layers={"olmo2": "transformers.models.olmo2.modeling_olmo2:Olmo2DecoderLayer"},
        qk_norm_types=("olmo2",),
        projection_norm_types=("olmo2",),
        post_norm_types=("olmo2",),
    ),
    "gemma": Family(
        name="gemma",
        model_types=("gemma", "gemma2", "gemma3_text"),
        qkv_bias=None,
        o_bias=None,
        decoder_layers={"gemma": "transformers.models.gemma.modeling_gemma:GemmaDecoderLayer",
                        "gemma2": "transformers.models.gemma2.modeling_gemma2:Gemma2DecoderLayer",
                        "gemma3_text": "transformers.models.gemma3.modeling_gemma3:Gemma3DecoderLayer"},
        sliding_window_types=("gemma2", "gemma3_text"),
        sandwich_norm_types=("gemma2", "gemma3_text"),
        gemma_types=("gemma", "gemma2", "gemma3_text"),
        qk_norm_types=("gemma3_text",),
        activations=("gelu_pytorch_tanh",),
    ),
    "qwen": Family(
        name="qwen",
        model_types=("qwen2", "qwen3"),
        qkv_bias=True,
        o_bias=False,
        decoder_layers={
            "qwen2": "transformers.models.qwen2.modeling_qwen2:Qwen2DecoderLayer",
            "qwen3": "transformers.models.qwen3.modeling_qwen3:Qwen3DecoderLayer",
        },
        declared_bias_types=("qwen3",),
        qk_norm_types=("qwen3",),
    ),
}

# Known model types we refuse, with the reason the user sees.
REFUSED = {
    "qwen3_moe": "Qwen3-MoE has per-head q/k norms before RoPE (and experts); not supported",
    "gemma3": "this is Gemma 3's multimodal checkpoint; only its text model (model_type gemma3_text) converts",
    "deepseek_v3": "this is already an MLA model",
    "deepseek_v2": "this is already an MLA model",
    "mla": "this is already an MLA model converted by mla-convert",
}

SUPPORTED_TYPES = sorted(t for f in FAMILIES.values() for t in f.model_types)


def family_for(config, requested: str | None = None) -> Family:
    """The family of a source config; `requested` is the CLI command used ("llama", "qwen", "phi3", "olmo2", "gemma"
    or None to detect)."""
    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED:
        raise UserError(f"model_type '{model_type}' is refused: {REFUSED[model_type]}")
    found = next((f for f in FAMILIES.values() if model_type in f.model_types), None)
    if found is None:
        raise UserError(
            f"model_type '{model_type}' is not supported; supported: {', '.join(SUPPORTED_TYPES)} "
            "(Llama, SmolLM, Mistral, Qwen2/2.5, Qwen3, Phi-3/Phi-4, OLMo 2, Gemma 1-3)"
        )
    if requested is not None and requested != found.name:
        raise UserError(
            f"this is a '{model_type}' model: run `mla-convert {found.name}` (or `mla-convert convert` to detect the family)"
        )
    check_config(config, found)
    return found


REQUIRED_KEYS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size")


def check_config(config, family: Family) -> None:
    """Refuse configs our model cannot reproduce, with the fix in the message."""
    missing = [k for k in REQUIRED_KEYS if getattr(config, k, None) is None]
    if missing:
        raise UserError(f"config.json is missing {', '.join(missing)}: fix or re-download the source's config.json")
    for key in REQUIRED_KEYS + ("num_key_value_heads", "head_dim"):
        value = getattr(config, key, None)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise UserError(f"{key} in config.json must be a positive whole number, got {value!r}: fix config.json")
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if heads % kv:
        raise UserError(f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv}) in config.json")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if head_dim % 2:
        raise UserError(f"head_dim {head_dim} is odd; RoPE needs an even head dim")
    activation = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if activation not in family.activations:
        raise UserError(f"the MLP's activation '{activation}' is not supported for model_type "
                        f"'{getattr(config, 'model_type', None)}' (only {', '.join(family.activations)})")
    raw = getattr(config, "sliding_window", None)
    if raw is not None and (not isinstance(raw, int) or isinstance(raw, bool) or raw < 1):
        raise UserError(f"sliding_window in config.json must be a positive whole number or null, got {raw!r}: "
                        "fix config.json")
    window = family.sliding_window(config)
    if window is not None and getattr(config, "model_type", None) not in family.sliding_window_types:
        raise UserError(
            f"sliding-window attention (window {window}) is not supported for model_type "
            f"'{getattr(config, 'model_type', None)}'; use a checkpoint without a sliding window"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    if not isinstance(rope, dict):
        raise UserError(f"rope_parameters in config.json must be an object, got {type(rope).__name__}: fix config.json")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = sorted({"default", *ROPE_INIT_FUNCTIONS} - {"dynamic"})
    # Gemma 3 gives RoPE parameters per layer type: each is checked
    for params in ([p for p in rope.values() if isinstance(p, dict)] if isinstance(rope.get("full_attention"), dict)
                   else [rope]):
        partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise UserError(f"partial_rotary_factor {partial}: RoPE on part of each head (e.g. Phi-4-mini) is not "
                            "supported; convert a model whose RoPE spans the whole head")
        if params.get("rope_type", "default") == "dynamic":
            raise UserError("dynamic NTK RoPE changes frequencies with the sequence length; not supported")
        if params.get("rope_type", "default") not in known:
            raise UserError(f"rope_type {params.get('rope_type')!r} in config.json is not a RoPE type transformers "
                            f"knows ({', '.join(known)}): fix config.json")


def llama_layer(config, layer_idx: int):
    """A transformers Llama decoder layer with `config`'s shapes: the source layer of a family whose layer, read with
    its fused tensors apart, computes what Llama's does (Phi-3). Calibration loads the split tensors into it."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "num_hidden_layers")
    llama = LlamaConfig(**{k: getattr(config, k) for k in keys if getattr(config, k, None) is not None},
                        attention_bias=False, mlp_bias=False)
    llama._attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    llama.sliding_window = FAMILIES["phi3"].sliding_window(config)  # read by the calibration's window mask
    return LlamaDecoderLayer(llama, layer_idx)


def fused_parts(config) -> dict[str, list[tuple[str, int, int]]]:
    """`Family.fused_parts` of the family a config's model type belongs to; {} for any other model type."""
    found = next((f for f in FAMILIES.values() if getattr(config, "model_type", None) in f.model_types), None)
    return found.fused_parts(config) if found is not None else {}
