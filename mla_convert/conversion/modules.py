"""Tensors and modules around the per-layer method: a source layer's tensors as read, transformers decoder layers and
MLA decoder layers built on given tensors, and the native MLA config of a plan."""

from __future__ import annotations

import torch

from mla_convert import rope
from mla_convert.sources import Source
from mla_convert.conversion.plan import Plan
from mla_convert.errors import UserError
from mla_convert.families import Family


# Config keys carried from the source into the MLA config unchanged.
CARRIED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters",
    "attention_dropout", "mlp_bias",
)  # fmt: skip


def gemma_fields(source_config, plan: Plan | None = None) -> dict:
    """The native config's fields a Gemma source needs: its scaled embeddings, (1+w) norms, activation, softmax
    scale, soft-capping and which layers attend within the window."""
    windowed = getattr(source_config, "sliding_window", None) is not None
    head_dim = getattr(source_config, "head_dim", None) or source_config.hidden_size // source_config.num_attention_heads
    scalar = getattr(source_config, "query_pre_attn_scalar", None) or head_dim  # Gemma 1: head_dim's
    return dict(
        embed_scale=float(source_config.hidden_size) ** 0.5,
        norm_unit_offset=True,
        hidden_act=getattr(source_config, "hidden_activation", None) or source_config.hidden_act,
        softmax_scale=float(scalar) ** -0.5,
        attn_logit_softcapping=getattr(source_config, "attn_logit_softcapping", None),
        final_logit_softcapping=getattr(source_config, "final_logit_softcapping", None),
        sliding_window=source_config.sliding_window if windowed else None,
        layer_types=list(source_config.layer_types) if windowed else None,
        # Gemma 3: the global layers' RoPE as the model's, the sliding layers' apart
        **({"rope_parameters": dict(source_config.rope_parameters["full_attention"]),
            "local_rope_parameters": dict(source_config.rope_parameters["sliding_attention"])}
           if rope.per_type_rope(source_config) else {}),
    )


def mla_config(source_config, plan: Plan, family: Family, rope_pairs: list[list[int]], dtype: str):
    from mla_convert.modeling import MLAConfig

    qkv_bias, o_bias = family.attention_biases(source_config)
    carried = {k: getattr(source_config, k) for k in CARRIED_KEYS if getattr(source_config, k, None) is not None}
    carried["head_dim"] = plan.head_dim
    carried["num_key_value_heads"] = plan.groups
    fields = dict(
        carried,
        attention_bias=qkv_bias,
        o_proj_bias=o_bias,
        kv_lora_rank=list(plan.kv_lora_rank),
        qk_rope_head_dim=plan.rope_dims,
        qk_nope_head_dim=plan.nope_dims,
        v_head_dim=plan.head_dim,
        rope_pairs=rope_pairs,
        softmax_scale=plan.head_dim**-0.5,
        qk_norm=plan.qk_norm,
        sliding_window=family.sliding_window(source_config),
        qk_norm_scope=plan.qk_norm_scope,
        norm_layout=family.norm_layout(source_config),
    )
    if family.gemma(source_config):
        fields.update(gemma_fields(source_config, plan))
    config = MLAConfig(**fields)
    if plan.latent_cache_type and plan.latent_cache_type != "f16":  # eval and generate read the cache so
        config.latent_cache_type = plan.latent_cache_type
    config.architectures = ["MLAForCausalLM"]
    config.dtype = dtype
    return config



def layer_names(source: Source, layer: int, family: Family) -> list[str]:
    prefix = family.layer_prefix.format(i=layer)
    return [k for k in source.keys() if k.startswith(prefix)]


def raw_layer(source: Source, layer: int, family: Family) -> dict[str, torch.Tensor]:
    """One layer's tensors as stored (the source's dtype, on the CPU), named within the layer."""
    prefix = family.layer_prefix.format(i=layer)
    return {n[len(prefix) :]: source.get_raw(n) for n in layer_names(source, layer, family)}


def float32_on(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """float32 copies on `device` (the tensors themselves where they already are)."""
    return {n: t.to(device=device, dtype=torch.float32) for n, t in tensors.items()}


def module_from(cls_or_factory, tensors: dict[str, torch.Tensor]):
    with torch.device("meta"):
        module = cls_or_factory()
    module.load_state_dict(tensors, assign=True, strict=True)
    return module.eval()


def attention_tensors(layer_tensors: dict, family: Family, layer: int, prefix: str, plan_qk_norm: str | None = None
                       ) -> dict[str, torch.Tensor]:
    out = {}
    for proj in ("q", "k", "v", "o"):
        local = getattr(family, proj)
        weight = layer_tensors.get(f"{local}.weight")
        if weight is None:
            raise UserError(f"tensor {prefix}{local}.weight is missing: is the checkpoint complete?")
        out[proj] = weight
        bias = layer_tensors.get(f"{local}.bias")
        if bias is not None:
            out[f"{proj}_bias"] = bias
    if plan_qk_norm:
        for norm in ("q_norm", "k_norm"):
            weight = layer_tensors.get(f"{getattr(family, norm)}.weight")
            if weight is None:
                raise UserError(f"tensor {prefix}{getattr(family, norm)}.weight is missing: is the checkpoint complete?")
            out[norm] = weight
    return out


def source_decoder_layer(config, family: Family, i: int, layer_tensors: dict[str, torch.Tensor]):
    """Layer i of the source as a transformers decoder layer (float32 inference module) on `layer_tensors`."""
    cls = family.decoder_layer_class(config.model_type)
    return module_from(lambda: cls(config, i), layer_tensors)


def converted_decoder_layer(config, plan, family, rope_pairs, i, layer_tensors, mla_tensors):
    from mla_convert.modeling.modeling_mla import MLADecoderLayer

    cfg = mla_config(config, plan, family, rope_pairs, "float32")
    cfg._attn_implementation = "sdpa"
    tensors = {k: v for k, v in layer_tensors.items() if not k.startswith("self_attn.")}
    tensors.update({f"self_attn.{k}": v for k, v in mla_tensors.items()})
    return module_from(lambda: MLADecoderLayer(cfg, i), tensors)




def other_tensor_names(source: Source, family: Family) -> list[str]:
    """The source's tensors outside its decoder layers (embeddings, final norm, head), which pass through as read."""
    layer_prefix = family.layer_prefix.split("{")[0]
    return [name for name in source.keys() if not name.startswith(layer_prefix) and "rotary_emb" not in name]
