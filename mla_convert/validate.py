"""The source validator: every tensor a conversion reads is present, has the shape the config says, and is finite,
checked before any work, so a damaged or mismatched source is refused in one line instead of converting into an
output that does not load (or loads with weights initialised at random)."""

from __future__ import annotations

import torch

from mla_convert.errors import UserError


def expected_shapes(config, family) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of every tensor a source of `family` with `config` must hold."""
    hidden, layers, vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    qkv_bias, o_bias = family.attention_biases(config)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not getattr(config, "tie_word_embeddings", False):
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(layers):
        p = family.layer_prefix.format(i=i)
        shapes.update({
            f"{p}post_attention_layernorm.weight": (hidden,),
            family.tensor(i, "q"): (heads * head_dim, hidden), family.tensor(i, "k"): (kv * head_dim, hidden),
            family.tensor(i, "v"): (kv * head_dim, hidden), family.tensor(i, "o"): (hidden, heads * head_dim),
            f"{p}mlp.gate_proj.weight": (inter, hidden), f"{p}mlp.up_proj.weight": (inter, hidden),
            f"{p}mlp.down_proj.weight": (hidden, inter),
        })  # fmt: skip
        if qkv_bias:
            shapes.update({family.tensor(i, "q", "bias"): (heads * head_dim,),
                           family.tensor(i, "k", "bias"): (kv * head_dim,),
                           family.tensor(i, "v", "bias"): (kv * head_dim,)})
        if o_bias:
            shapes[family.tensor(i, "o", "bias")] = (hidden,)
        layout = family.norm_layout(config)
        norms = {"pre": ["input_layernorm"], "post": ["post_feedforward_layernorm"],
                 "sandwich": ["input_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]}[layout]
        shapes.update({f"{p}{norm}.weight": (hidden,) for norm in norms})
        if family.has_qk_norm(config):
            whole = family.qk_norm_scope(config) == "projection"
            shapes[f"{p}{family.q_norm}.weight"] = (head_dim * (heads if whole else 1),)
            shapes[f"{p}{family.k_norm}.weight"] = (head_dim * (kv if whole else 1),)
    return shapes


def check_source_shapes(source, family) -> None:
    """Refuse a source that lacks a tensor the config implies or holds one of another shape (headers only)."""
    config = source.config
    expected = expected_shapes(config, family)
    held = set(source.keys())
    missing = [n for n in expected if n not in held]
    where = source.origin
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise UserError(f"the source {where} lacks tensor {missing[0]}{more}, which its config.json implies: "
                        "re-download the checkpoint (or fix config.json)")
    for name, shape in expected.items():
        found = tuple(source.shape(name))
        if found != shape:
            raise UserError(f"tensor {name} has shape {list(found)} in {where}, but config.json implies {list(shape)} "
                            "(hidden_size, heads, head_dim, intermediate_size, vocab_size): fix config.json or "
                            "re-download the checkpoint")


def check_source_finite(source, family) -> None:
    """Refuse a source with a NaN or infinite weight (read tensor by tensor, one in memory at a time)."""
    check_finite_tensors(((name, source.get_raw(name)) for name in expected_shapes(source.config, family)),
                         source.origin, "the checkpoint is damaged; re-download it or convert a healthy one")


def check_finite_tensors(tensors, where: str, fix: str) -> None:
    """Refuse, in one line naming `fix`, when any floating tensor of `tensors` (an iterable of (name, tensor), read
    one at a time) holds a NaN or infinite value."""
    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise UserError(f"tensor {name} of {where} holds {bad} NaN or infinite values: {fix}")


def check_checkpoint_finite(source, what: str) -> None:
    """Refuse a native checkpoint (a SafetensorsSource) with a NaN or infinite weight before `what` writes anything:
    every tensor it holds, one in memory at a time."""
    check_finite_tensors(((name, source.get_raw(name)) for name in source.keys()), source.origin,
                         f"the checkpoint is damaged, and {what} of it would be too; convert it again (or fine-tune "
                         "it again from its last good step)")
