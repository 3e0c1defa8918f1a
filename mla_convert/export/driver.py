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
from mla_convert.export.plan import ExportOptions, deepseek_config, make_plan, out_dtype
from mla_convert.export.verify import verify_export

log = logging.getLogger(__name__)

LAYER_ATTENTION = ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj")


def native_config(folder: Path, what: str = "export"):
    """The MLAConfig of the native checkpoint folder `folder`; a UserError (naming `what` needs it) for a config.json
    that cannot be read or is not a native MLA model's."""
    from mla_convert.modeling import MLAConfig

    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as e:  # ValueError: not JSON or not UTF-8; AttributeError: not an object
        raise UserError(f"cannot read {folder / 'config.json'} ({type(e).__name__}): pass a native MLA checkpoint "
                        "folder whose config.json is intact") from None
    if model_type != "mla":
        raise UserError(f"{what} needs a native MLA checkpoint (model_type mla, made by `mla-convert llama ... -o "
                        f"DIR`), got model_type {model_type}")
    return MLAConfig.from_pretrained(folder)


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
    from mla_convert.conversion.plan import check_room
    from mla_convert.outputs import ShardedWriter, check_output, staged_output
    from mla_convert.sources import SafetensorsSource
    from mla_convert.validate import check_checkpoint_finite
    from mla_convert.writes import room_for

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
    plan = make_plan(config, _layer_biases(source, config), options)
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


# ---------------------------------------------------------------------------------------------------- convert --target


def resolve_target(target: str | None, format: str, output: Path | None) -> tuple[str, Path | None]:
    """Check `mla-convert convert --target/--format`; returns (target, the folder the native checkpoint goes to).

    With --format deepseek, OUT is the DeepSeek-V3 export (what engines serve) and the native checkpoint goes beside
    it, to OUT-native.
    """
    if format not in ("native", "deepseek", "gguf"):
        raise UserError(f"--format must be native, deepseek or gguf, got {format}")
    target = target or ("deepseek" if format == "gguf" else format)
    if target not in ("native", "deepseek"):
        raise UserError(f"--target must be native or deepseek, got {target}")
    if format in ("deepseek", "gguf") and target != "deepseek":
        raise UserError(f"--format {format} needs DeepSeek-exportable options: drop --target native")
    if format == "gguf" and output is not None:
        if output.suffix != ".gguf":
            raise UserError(f"--format gguf writes one file: -o must end in .gguf (got {output})")
        return target, output.with_name(output.stem + "-native")
    native_out = output.with_name(output.name + "-native") if format == "deepseek" and output is not None else output
    return target, native_out


def _plan_quietly(convert, source, native_out, options, family):
    """The plan alone (a dry run), its warnings held back: the conversion that follows prints them once."""
    logger = logging.getLogger("mla_convert")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return convert(source, native_out, options, family, dry_run=True)
    finally:
        logger.setLevel(level)


def convert_to_target(source, output: Path | None, native_out: Path | None, options, family: str | None, *,
                      target: str, format: str, explicit: set[str], overwrite: bool, dry_run: bool, progress: bool,
                      say: Callable[..., None]) -> None:
    """Convert `source` for `target` (native or deepseek) and, with `format` deepseek, export the result to `output`.

    `target` deepseek resolves and checks exportable options (deepseek_convert_options) before any heavy work;
    `explicit` names the options the user set. Notes go through `say(text)`, warnings through `say(text, err=True)`
    (the CLI passes typer.echo).
    """
    from mla_convert.convert import convert

    if format == "gguf" and output is not None and not dry_run:  # a GGUF path that cannot be written is named first
        from mla_convert.export.gguf import check_gguf_output

        check_gguf_output(output, overwrite, ())
    if target == "deepseek":  # resolve and check exportable options before any heavy work
        from mla_convert.export.plan import deepseek_layout_notes
        from mla_convert.export.rope_fit import deepseek_convert_options
        from mla_convert.families import family_for

        options, notes = deepseek_convert_options(source.config, options, explicit)
        if format == "gguf" and any(family_for(source.config, family).attention_biases(source.config)):
            raise UserError("this model has attention biases, which llama.cpp's deepseek2 attention has no place for: "
                            "serve the native checkpoint through the vLLM plugin or transformers (docs/serving.md)")
        if format == "deepseek" and any(family_for(source.config, family).attention_biases(source.config)):
            raise UserError("this model has attention biases, which vLLM's and SGLang's DeepSeek classes drop "
                            "silently: serve the native checkpoint through the vLLM plugin instead (convert without "
                            "--format deepseek; docs/serving.md), or convert with --target deepseek and run "
                            "`mla-convert export --keep-biases` (transformers only) or `--drop-biases --allow-approx`")
        plan = _plan_quietly(convert, source, native_out, options, family)
        if format == "deepseek" and plan.dtype == "float16":
            raise UserError("the DeepSeek-V3 export cannot hold float16 (its identity latent norm needs bfloat16's "
                            "range): pass --dtype bfloat16 or --dtype float32")
        for note in notes:
            say(note)
        for note in deepseek_layout_notes(source.config, plan.kv_lora_rank, plan.rope_dims):
            say(f"warning: {note}", err=True)
    if target != "deepseek":  # the native checkpoint serves through the vLLM plugin if its layout fits
        from mla_convert.serving.layout import serving_notes

        plan = _plan_quietly(convert, source, native_out, options, family)
        for note in serving_notes(plan.kv_lora_rank, plan.rope_dims):
            say(f"warning: {note}", err=True)
    plan = convert(source, native_out, options, family, overwrite=overwrite, dry_run=dry_run, progress=progress)
    say(plan.describe(target))
    if dry_run:
        where = (f" (native MLA to {native_out}, DeepSeek-V3 export to {output})" if format == "deepseek" else
                 f" (native MLA to {native_out}, GGUF to {output})" if format == "gguf" else "")
        say(f"dry run: nothing written{where}")
        return
    say(f"wrote {native_out}  (load: import mla_convert; AutoModelForCausalLM.from_pretrained('{native_out}'))")
    if format == "deepseek":
        report_export(export(native_out, output, ExportOptions(), overwrite=overwrite), output, say)
    elif format == "gguf":
        from mla_convert.export.gguf import export_gguf, report_gguf

        report_gguf(export_gguf(native_out, output, "f32", overwrite=overwrite), output, say)
    elif target == "deepseek":
        from mla_convert.export.rope_fit import check_exportable

        for problem in check_exportable(native_out):  # a converter change broke what was resolved above
            say(f"warning: the result will not export exactly to DeepSeek-V3: {problem}", err=True)


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
