"""The conversion's options: `ConvertOptions` (declared in mla_convert/schema.py with every field's flags, help and
check; recorded in provenance.json), the defaults resolved from other options, and the one-line description of the
method they make (provenance and the model card)."""

from __future__ import annotations

import dataclasses
import logging

from mla_convert import schema
from mla_convert.schema import ConvertOptions

log = logging.getLogger(__name__)


RANK_ALLOCATIONS = schema.choices("rank_allocation")
INPUT_KINDS = schema.choices("value_inputs")  # --value-inputs, --key-inputs


QK_NORM_MODES = schema.choices("qk_norm")
QK_NORM_TEXT = {
    "exact": "exact (the key is normalized per token from the latent and the pre-norm rope key: expanded attention "
    "at every step, no absorbed decode, not servable in vLLM or as DeepSeek-V3)",
    "calibrated": "calibrated (the key's per-token RMS replaced by its calibration RMS: plain MLA keys, absorbed "
    "decode; the query keeps its exact norm)",
}


def needs_statistics(options: ConvertOptions) -> bool:
    """Whether the conversion collects calibration statistics (the options ask for something beyond plain SVD of the
    weights)."""
    return (
        options.method == "activation"
        or options.rope_strategy in ("2-norm", "attention")
        or options.rope_merge
        or options.objective != "kv"
        or options.value_inputs != "token"
        or options.key_inputs != "token"
        or options.dropped_rope == "expected"
        or options.qk_norm == "calibrated"  # the keys' RMS (only sources with q/k norms read it)
        or (options.refine_steps or 0) > 0
        or (options.refine_model_steps or 0) > 0
    )


def needs_attention_profile(options: ConvertOptions) -> bool:
    """Whether the conversion reads the calibration attention by distance (the attention pair choice, expected phases)."""
    return options.rope_strategy == "attention" or options.dropped_rope == "expected"


def needs_attention_statistics(options: ConvertOptions) -> bool:
    """Whether the calibration collects attention statistics of any kind."""
    return needs_attention_profile(options) or options.value_inputs == "attended" or options.key_inputs == "attended"


def resolve_allocation(options: ConvertOptions) -> ConvertOptions:
    """The default rank allocation (None): energy, which shares the dims by every layer's calibrated spectrum before
    it converts any (on the source's stream, whichever stream the conversion then follows); uniform without
    calibration text (weight-only spectra: not measured)."""
    if options.rank_allocation is not None:
        return options
    return dataclasses.replace(options, rank_allocation="energy" if options.calib_data is not None else "uniform")


def without_calibration(options: ConvertOptions) -> ConvertOptions:
    """With no calibration text, the attention-profile choices fall back to their data-free neighbours (2-norm on
    weight proxies, unrotated dropped pairs), with a warning; the resolved options are what provenance records."""
    if options.calib_data is not None or not needs_attention_statistics(options):
        return options
    log.warning("no calibration text: --rope-strategy attention -> 2-norm (weight proxies), --dropped-rope expected "
                "-> unrotated, --value-inputs attended -> token; pass --calib-data for the attention-aware choices")
    strategy = "2-norm" if options.rope_strategy == "attention" else options.rope_strategy
    return dataclasses.replace(options, rope_strategy=strategy, dropped_rope="unrotated", value_inputs="token",
                               key_inputs="token")


def as_planned(options: ConvertOptions, plan) -> ConvertOptions:
    """The options as the planned conversion runs them (what provenance.json and the resume fingerprint record): each
    default the plan (`conversion.plan.Plan`) resolved filled in: the self text's temperature, the calibration
    windows, the layer refinement's steps, window, precision, positions and workers, the model stage's steps and
    rate; and --kv-bytes as the width (--kv-budget, elements) and --cache-type it chose."""
    if plan.cache_choice is not None:
        options = dataclasses.replace(options, kv_bytes=None, kv_budget=float(plan.cache_choice.chosen.elements))
    return dataclasses.replace(options, cache_type=plan.latent_cache_type,
                               calib_temperature=plan.calib_temperature, calib_samples=plan.memory["samples"],
                               refine_steps=plan.refine_steps, refine_seq_len=plan.refine_seq_len,
                               refine_precision=plan.refine_precision, refine_queries=plan.refine_queries,
                               refine_workers=plan.refine_workers, refine_model_steps=plan.refine_model_steps,
                               refine_model_lr=plan.refine_model_lr)


def describe_method(options: ConvertOptions) -> str:
    rope_text = f"{options.rope_strategy} partial RoPE" + (" merged across kv heads" if options.rope_merge else "")
    if options.dropped_rope == "expected":
        rope_text += " (dropped pairs keep their expected rotation)"
    fact = f"{options.factorization} {'activation-aware' if options.method == 'activation' else 'weight-only'} SVD"
    fact += {"attention": " of query-key scores and o_proj outputs", "scores": " of query-key scores and values"}.get(
        options.objective, " of K/V")
    if options.kv_balance is not None:
        fact += f", K/V balanced {options.kv_balance:g}:1"
    if options.key_inputs == "attended":
        fact += ", calibration tokens weighted by the attention their keys receive"
    if options.value_inputs == "attended":
        fact += ", values fit on attended inputs" + (f" (latent refined, {options.latent_rounds} rounds)"
                                                     if options.latent_rounds else "")
    if options.rank_allocation == "energy":
        fact += ", latent dims shared among layers by their spectra"
    if options.refine_steps:
        fact += (f"; each layer's attention then trained {options.refine_steps} steps to match the source "
                 "attention's outputs" if options.refine_scope == "attention" else
                 f"; each whole layer (attention, MLP, norms) then trained {options.refine_steps} steps to match what "
                 "the source layer adds to the residual stream")
    if options.refine_model_steps:
        trained = "attention" if options.refine_model_scope == "attention" else "whole layer"
        fact += (f"; then every {trained} trained {options.refine_model_steps} steps end to end to the source's "
                 "next-token distributions on the calibration text")
    return f"{rope_text}, {fact}"
