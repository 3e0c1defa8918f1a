"""The export driver: `export` reads a native MLA checkpoint, plans, maps every layer, writes the DeepSeek-V3 folder
atomically, verifies it and records provenance and the model card.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from mla_convert.errors import UserError
from mla_convert.export.layer import export_layer
from mla_convert.export.plan import ExportOptions, deepseek_config, make_export_plan, native_config, out_dtype
from mla_convert.export.verify import verify_export

log = logging.getLogger(__name__)

LAYER_ATTENTION = ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj")


def _layer_biases(source, config) -> list[dict]:
    """Per layer, the attention biases as the export plan sees them: the query's, the rope key's and what folds into
    the output (o_proj's, the value's through kv_b, the latent's through kv_a), None where there is none."""
    prefix = "model.layers.{i}."

    def bias(i: int, name: str) -> torch.Tensor | None:
        key = f"{prefix.format(i=i)}self_attn.{name}.bias"
        return source.get(key) if source.has(key) else None

    layer_biases = []
    for i in range(config.num_hidden_layers):
        d_c = config.kv_lora_ranks[i]
        kv_a, kv_b = bias(i, "kv_a_proj"), bias(i, "kv_b_proj")
        v_part = kv_b.view(config.num_key_value_heads, -1)[:, config.qk_nope_head_dim :] if kv_b is not None else None
        o_parts = [x for x in (bias(i, "o_proj"), v_part, kv_a[:d_c] if kv_a is not None else None) if x is not None]
        layer_biases.append({
            "q": bias(i, "q_proj"),
            "k_rope": kv_a[d_c:] if kv_a is not None else None,
            "o": torch.cat([x.reshape(-1) for x in o_parts]) if o_parts else None,
        })  # fmt: skip
    return layer_biases


def _export_record(plan) -> dict:
    """What the export did (provenance.json's "export"), before the layers' identity norm scales are added."""
    return {
        "format": "deepseek_v3",
        "rope_theta": plan.rope_theta,
        "rope_order": plan.fit.order,
        "rope_exact": plan.fit.exact,
        "rope_max_freq_rel_error": plan.fit.max_freq_rel_error,
        "kv_lora_rank": plan.kv_lora_rank_out,
        "qk_rope_head_dim": plan.rope_dims_out,
        "q_lora_rank": plan.q_lora_rank,
        "attention_bias": plan.attention_bias,
        "residual_scale": plan.residual_scale,
        "approximations": plan.approximations,
        "warnings": plan.warnings,
    }


def _write_weights(writer, source, plan, options: ExportOptions, layers: int) -> list:
    """Add every tensor of the DeepSeek-V3 model to `writer` (embeddings, head, norm, then each layer's exported
    attention, norms and MLP); returns each layer's identity norm scales."""
    s = plan.residual_scale
    writer.add("model.embed_tokens.weight", s * source.get("model.embed_tokens.weight"))
    lm_head = "lm_head.weight" if source.has("lm_head.weight") else "model.embed_tokens.weight"
    writer.add("lm_head.weight", source.get(lm_head))
    writer.add("model.norm.weight", source.get("model.norm.weight"))
    scales = []
    for i in range(layers):
        p = f"model.layers.{i}."
        norm_weight = source.get(p + "input_layernorm.weight")
        attn = {}
        for name in LAYER_ATTENTION:
            for kind in ("weight", "bias"):
                key = f"{p}self_attn.{name}.{kind}"
                if source.has(key):
                    attn[f"{name}.{kind}"] = source.get(key)
        if options.drop_biases:
            attn = {k: v for k, v in attn.items() if not k.endswith(".bias")}
        tensors, stats = export_layer(attn, plan, i, norm_weight)
        scales.append(stats)
        for name, tensor in tensors.items():
            writer.add(f"{p}self_attn.{name}", tensor)
        writer.add(p + "input_layernorm.weight", norm_weight)
        writer.add(p + "post_attention_layernorm.weight", source.get(p + "post_attention_layernorm.weight"))
        for name in ("gate_proj", "up_proj"):
            writer.add(f"{p}mlp.{name}.weight", source.get(f"{p}mlp.{name}.weight"))
        writer.add(f"{p}mlp.down_proj.weight", s * source.get(f"{p}mlp.down_proj.weight"))
    return scales


def _measure(folder: Path, stage: Path, options: ExportOptions, plan, dtype: torch.dtype) -> dict:
    """With options.verify, the stock DeepseekV3ForCausalLM's logits against the native model's (a warning where
    an export without approximations differs); {} without."""
    if not options.verify:
        return {}
    measurements = verify_export(folder, stage, options, plan.attention_bias)
    err = measurements["export_max_rel_logit_error"]
    log.info("stock DeepseekV3ForCausalLM vs native: max relative logit error %.3g", err)
    if not plan.approximations and err > 1e-3:
        log.warning("the export differs from the native model by %.3g although no approximation was made "
                    "(dtype %s rounding?)", err, str(dtype).replace("torch.", ""))
    return measurements


def _save_provenance(stage: Path, folder: Path, options: ExportOptions, plan, dtype: torch.dtype, layers: int,
                     record: dict, measurements: dict, copied: list[str]) -> None:
    """Write the export's provenance.json into `stage`, chained to the native model's."""
    from mla_convert import provenance

    parent = provenance.load(folder)
    kv_before = sum(plan.kv_lora_rank) / layers + plan.rope_dims
    provenance.save(stage, provenance.new(
        "export",
        source=(parent or {}).get("source"),
        method="DeepSeek-V3 export (identity kv_a_layernorm, interleaved geometric RoPE, folded softmax scale)",
        options=dataclasses.asdict(options),
        kv_cache={
            "elements_per_token_per_layer_before": kv_before,
            "elements_per_token_per_layer_after": plan.kv_lora_rank_out + plan.rope_dims_out,
            "dtype": str(dtype).replace("torch.", ""),
        },
        export=record,
        measurements=measurements,
        copied_files=copied,
        parent=parent,
    ))  # fmt: skip


def export(model: str | os.PathLike, out: str | os.PathLike, options: ExportOptions, overwrite: bool = False) -> dict:
    """Export the native MLA checkpoint folder `model` to a DeepSeek-V3 folder `out`; returns the export record
    (what provenance.json holds under "export", plus "measurements")."""
    from mla_convert.card import write_model_card
    from mla_convert.outputs import ShardedWriter, check_output, staged_output
    from mla_convert.sources import SafetensorsSource
    from mla_convert.validate import check_checkpoint_finite
    from mla_convert.writes import check_room, room_for

    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} has no config.json: pass a native MLA checkpoint folder (mla-convert llama -o DIR)")
    check_output(Path(out), overwrite, (folder,))  # before any planning: a bad -o is named first
    config = native_config(folder)
    dtype = out_dtype(options, config)
    source = SafetensorsSource(config, str(folder), folder)
    check_checkpoint_finite(source, "an export")  # before any work: NaN weights would export into a broken model
    elements = sum(math.prod(source.shape(name)) for name in source.keys())
    needed = elements * dtype.itemsize
    check_room(Path(out), needed)  # before any work: the export is one full copy
    plan = make_export_plan(config, _layer_biases(source, config), options)
    for note in plan.warnings:
        log.warning("%s", note)
    for note in plan.approximations:
        log.warning("approximation: %s", note)
    record = _export_record(plan)
    with room_for(out, needed, "the export to"), staged_output(Path(out), overwrite, (folder,)) as stage:
        writer = ShardedWriter(stage, dtype)
        scales = _write_weights(writer, source, plan, options, config.num_hidden_layers)
        source.close()
        writer.finalize()
        (stage / "config.json").write_text(json.dumps(deepseek_config(config, plan, dtype), indent=2) + "\n")
        copied = source.copy_aux_files(stage)
        record["identity_norm_scales"] = scales
        measurements = _measure(folder, stage, options, plan, dtype)
        _save_provenance(stage, folder, options, plan, dtype, config.num_hidden_layers, record, measurements, copied)
        write_model_card(stage)
    record["measurements"] = measurements
    return record


def report_export(record: dict, output: Path, say: Callable[..., None]) -> None:
    """What an export wrote and how it verified, through `say` (the CLI passes typer.echo)."""
    say(
        f"wrote {output}: DeepSeek-V3, kv_lora_rank {record['kv_lora_rank']} + qk_rope_head_dim "
        f"{record['qk_rope_head_dim']}, rope_theta {record['rope_theta']:.6g}"
        + (f", q_lora_rank {record['q_lora_rank']}" if record["q_lora_rank"] else "")
    )
    for note in record["approximations"]:
        say(f"approximation: {note}")
    m = record["measurements"]
    if m:
        line = f"stock transformers vs native: max relative logit error {m['export_max_rel_logit_error']:.3g}, "
        line += "greedy tokens " + ("match" if m["export_greedy_tokens_match"] else "DIFFER")
        if "export_max_rel_logit_error_without_biases" in m:
            line += f"; without biases (as vLLM/SGLang run it): {m['export_max_rel_logit_error_without_biases']:.3g}"
        say(line)
    else:
        say("not verified (--no-verify)")
