"""The conversion's options: `ConvertOptions` (recorded in provenance.json), the defaults resolved from other options,
and the one-line description of the method they make (provenance and the model card)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from mla_convert import refine, selftext

log = logging.getLogger(__name__)


RANK_ALLOCATIONS = ("uniform", "energy")
INPUT_KINDS = ("token", "attended")  # --value-inputs, --key-inputs


QK_NORM_MODES = ("exact", "calibrated")
QK_NORM_TEXT = {
    "exact": "exact (the key is normalized per token from the latent and the pre-norm rope key: expanded attention "
    "at every step, no absorbed decode, not servable in vLLM or as DeepSeek-V3)",
    "calibrated": "calibrated (the key's per-token RMS replaced by its calibration RMS: plain MLA keys, absorbed "
    "decode; the query keeps its exact norm)",
}


@dataclass
class ConvertOptions:
    """Resolved conversion options (also recorded in provenance.json)."""

    rank: int | None = None  # latent dims d_c per layer; None: from kv_budget
    kv_budget: float | None = None  # elements per token per layer (>1) or a fraction of the source's cache (<=1)
    rope_dims: int | None = None  # d_r, dims of the shared rope key; None: see default_rope_dims
    nope_dims: int | None = None  # d_n, nope query/key dims per head; None: see default_nope_dims
    rope_strategy: str = "attention"
    rope_merge: bool = True
    factorization: str = "joint"  # joint | split
    method: str = "activation"  # weight | activation
    objective: str = "kv"  # kv: error in K/V | attention: keys by query-key score error, values by error after o_proj
    kv_balance: float | None = 1.0  # scale the key block so its energy is this multiple of the value block's
    dropped_rope: str = "expected"  # unrotated | expected: dropped pairs keep E[rotation] under the head's attention
    calib_data: str | None = "self"  # text sampled from the source (data-free); files/datasets, weighted: see calibration
    # None: default_calib_samples of the share of the source's cache kept; the refinement trains on the first SEQ_LEN
    # tokens of all but one window
    calib_samples: int | None = None
    calib_seq_len: int = 2048  # as long as the evaluation windows: the attention profiles see those distances
    # `self` text (mla_convert.selftext): the sampling temperature (None: selftext.calib_temperature of the share of
    # the cache kept, resolved in `convert`) and the new tokens per sampled answer (self-doc: per window):
    # docs/decisions.md#self-text-temperature-length-and-batch
    calib_temperature: float | None = None
    calib_sample_tokens: int = selftext.SAMPLE_TOKENS
    calib_propagate: str = "source"  # source | converted: which activations later layers calibrate on
    # uniform | energy: share the latent dims among layers by their spectra; None: energy with calibration text,
    # else uniform (resolve_allocation, in `convert`): docs/decisions.md#rank-allocation
    rank_allocation: str | None = None
    value_inputs: str = "attended"  # token | attended: fit the value up-projection on the inputs attention averages
    key_inputs: str = "attended"  # token | attended: weight each calibration token by the attention its key receives
    latent_rounds: int = 0  # with value_inputs attended: rounds refining the shared latent for both input kinds
    # gradient steps per layer matching the source attention's outputs (mla_convert.refine); None: auto (see
    # refine.resolve_steps), resolved in `convert` so that provenance records the number that ran
    refine_steps: int | None = None
    refine_lr: float = refine.DEFAULT_LR
    refine_seq_len: int = refine.SEQ_LEN  # tokens per refinement window (from each sequence's start)
    refine_scope: str = refine.DEFAULT_SCOPE  # attention | layer: what refinement trains (mla_convert.refine.SCOPES)
    refine_mlp_lr_scale: float = refine.MLP_LR_SCALE  # layer scope: the MLP's and norms' learning rate / refine_lr
    # the model stage (mla_convert.refine.refine_model): Adam steps training every converted attention end to end to
    # the source's next-token distributions on the calibration windows, after the layers; None: auto (see
    # refine.resolve_model_steps), resolved in `convert`
    refine_model_steps: int | None = None
    refine_model_lr: float = refine.MODEL_LR
    refine_model_scope: str = refine.MODEL_SCOPE  # attention | layer: what the model stage trains (refine.MODEL_SCOPES)
    # what both stages' training steps compute in (refine.PRECISIONS); auto resolved in `convert` (refine.resolve_precision)
    refine_precision: str = refine.DEFAULT_PRECISION
    seed: int = 0
    device: str = "cpu"
    dtype: str | None = None  # output dtype; None: the source's (float32 for GGUF)
    force: bool = False  # allow a cache that is not smaller than the source's
    # sources with per-head q/k RMS norms (Qwen3): exact | calibrated (the key's per-token RMS replaced by its
    # calibration RMS per layer and kv group, which makes the key linear: absorbed decode). Ignored for other sources.
    qk_norm: str = "exact"

    def needs_statistics(self) -> bool:
        return (
            self.method == "activation"
            or self.rope_strategy in ("2-norm", "attention")
            or self.rope_merge
            or self.objective != "kv"
            or self.value_inputs != "token"
            or self.key_inputs != "token"
            or self.dropped_rope == "expected"
            or self.qk_norm == "calibrated"  # the keys' RMS (only sources with q/k norms read it)
            or (self.refine_steps or 0) > 0
            or (self.refine_model_steps or 0) > 0
        )

    def needs_attention_profile(self) -> bool:
        return self.rope_strategy == "attention" or self.dropped_rope == "expected"

    def needs_attention_statistics(self) -> bool:
        return self.needs_attention_profile() or self.value_inputs == "attended" or self.key_inputs == "attended"


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
    if options.calib_data is not None or not options.needs_attention_statistics():
        return options
    log.warning("no calibration text: --rope-strategy attention -> 2-norm (weight proxies), --dropped-rope expected "
                "-> unrotated, --value-inputs attended -> token; pass --calib-data for the attention-aware choices")
    strategy = "2-norm" if options.rope_strategy == "attention" else options.rope_strategy
    return dataclasses.replace(options, rope_strategy=strategy, dropped_rope="unrotated", value_inputs="token",
                               key_inputs="token")


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
