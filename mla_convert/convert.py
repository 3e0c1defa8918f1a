"""The conversion: a plan (shapes, cache sizes, memory) and the per-layer pipeline that writes an MLA checkpoint.

state flow, one decoder layer at a time:
    source tensors -> [calibration statistics] -> RoPE plan -> split q/k into rope and nope parts
    -> low-rank factorization of [k_nope; v] -> MLA tensors -> shard writer
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mla_convert import lowrank, provenance, refine, rope, selftext
from mla_convert.card import write_model_card
from mla_convert.checkpoint import (AUX_FILES, SHARD_BYTES, ShardedWriter, Source, file_stamp, kept_file_intact,
                                   resume_dir, seal_kept_file, staged_output)
from mla_convert.dtypes import DTYPES
from mla_convert.errors import UserError
from mla_convert.families import Family, family_for

log = logging.getLogger(__name__)

RANK_ALLOCATIONS = ("uniform", "energy")
INPUT_KINDS = ("token", "attended")  # --value-inputs, --key-inputs
ATTENDED_EVERY = 4  # attended-input statistics on every 4th block of calibration queries (they cost a [T, T] x [T, D])
QK_NORM_MODES = ("exact", "calibrated")
QK_NORM_TEXT = {
    "exact": "exact (the key is normalized per token from the latent and the pre-norm rope key: expanded attention "
    "at every step, no absorbed decode, not servable in vLLM or as DeepSeek-V3)",
    "calibrated": "calibrated (the key's per-token RMS replaced by its calibration RMS: plain MLA keys, absorbed "
    "decode; the query keeps its exact norm)",
}
# Memory estimate (Plan.memory_parts): the runtime's own resident set (Python, torch, transformers, a tokenizer) at
# the first layer of a conversion; and the factor over the modelled parts for what they leave out (the allocator's
# free-but-held pages, short-lived copies inside torch ops): docs/decisions.md#memory-estimate.
BASELINE = int(0.6 * 2**30)
MEMORY_SAFETY = 1.15
# Config keys carried from the source into the MLA config unchanged.
CARRIED_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters",
    "attention_dropout", "mlp_bias",
)  # fmt: skip


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


@dataclass
class Plan:
    family: str
    model_type: str
    layers: int
    hidden: int
    heads: int
    groups: int
    head_dim: int
    kv_lora_rank: list[int]  # d_c per layer
    rope_dims: int
    nope_dims: int  # d_n: per head, the nope query/key width (the value keeps head_dim)
    dtype: str
    source_bytes: int
    calib_tokens: int
    attn_params_before: int = 0
    attn_params_after: int = 0
    shapes: dict = field(default_factory=dict)
    qkv_bias: bool = False
    qk_norm: str | None = None  # None: the source has no per-head q/k norms; else ConvertOptions.qk_norm
    qk_norm_scope: str = "head"  # "head" or "projection" (Family.qk_norm_scope)
    norm_unit_offset: bool = False  # the source's norms multiply by (1 + weight) (Gemma)
    norm_eps: float = 1e-6  # the source's rms_norm_eps (its q/k norms' epsilon)
    memory: dict = field(default_factory=dict)  # what the memory estimate needs beyond the shapes (see make_plan)
    refine_steps: int = 0  # per layer, as resolved (mla_convert.refine); with the CPU time estimate for them
    refine_seconds: float = 0.0
    refine_precision: str = "float32"  # what the refinement steps compute in, as resolved
    refine_scope: str = refine.DEFAULT_SCOPE
    refine_record: list = field(default_factory=list)  # per layer: held-out error before/after, kept
    refine_model_steps: int = 0  # the model stage, as resolved; with its CPU time estimate and its record
    refine_model_seconds: float = 0.0
    refine_model_scope: str = refine.MODEL_SCOPE
    refine_model_record: dict = field(default_factory=dict)
    nope_kept: list = field(default_factory=list)  # per layer: share of the nope score energy d_n dims keep

    def set_kv_lora_rank(self, kv_lora_rank: list[int]) -> None:
        """Per-layer latent dims (after a rank allocation): the shapes shown are the first layer's."""
        self.kv_lora_rank = list(kv_lora_rank)
        heads, groups, head_dim, hidden, d_r = self.heads, self.groups, self.head_dim, self.hidden, self.rope_dims
        d_n = self.nope_dims
        after = 0
        q_rows = heads * head_dim if self.qk_norm else heads * (d_n + d_r)  # with q/k norms: the source's query
        for layer, rank in enumerate(self.kv_lora_rank):
            shapes = {
                "q_proj": (q_rows, hidden),
                "kv_a_proj": (rank + d_r, hidden),
                "kv_b_proj": (groups * (d_n + head_dim), rank),
                "o_proj": (hidden, heads * head_dim),
            }
            if self.qk_norm:
                shapes["q_head_proj"] = (heads * (d_n + d_r), head_dim)
            after += sum(math.prod(s) for s in shapes.values())
            after += self.qkv_bias * (q_rows + rank + d_r + groups * (d_n + head_dim))
            whole = self.qk_norm_scope == "projection"
            if self.qk_norm == "exact":  # k_norm, and the rope key's maps R and K
                after += head_dim * (groups if whole else 1) + 2 * groups * head_dim * d_r
            after += head_dim * (heads if whole else 1) if self.qk_norm else 0  # q_norm
            if layer == 0:
                self.shapes = shapes
        self.attn_params_after = after

    @property
    def kv_before(self) -> int:
        """Cached elements per token per layer in the source (K and V of every kv head)."""
        return 2 * self.groups * self.head_dim

    def kv_after(self, layer: int | None = None) -> float:
        ranks = self.kv_lora_rank if layer is None else [self.kv_lora_rank[layer]]
        return sum(r + self.rope_dims for r in ranks) / len(ranks)

    @property
    def bytes_per_element(self) -> int:
        return torch.empty(0, dtype=DTYPES[self.dtype]).element_size()

    @property
    def kv_bytes_before(self) -> int:
        return self.kv_before * self.layers * self.bytes_per_element

    @property
    def kv_bytes_after(self) -> int:
        return sum(r + self.rope_dims for r in self.kv_lora_rank) * self.bytes_per_element

    @property
    def ratio(self) -> float:
        return self.kv_bytes_after / self.kv_bytes_before

    def memory_parts(self) -> dict[str, int]:
        """Peak resident bytes by what holds them, at the heaviest moment of each phase (`memory_estimate`).

        Resident the whole run: the Python/torch/transformers runtime with the tokenizer (`BASELINE`), the calibration
        hidden states (input, output and normed copy, float32; --rank-allocation energy keeps only each layer's
        spectrum from its statistics pass and takes the statistics again in the conversion pass). Embeddings, lm_head
        and the other layers are never resident: layers stream from the source one at a time and the shards are
        written last, from the kept layers.

        A layer, at its heaviest: its tensors as stored (source dtype), its attention in float32, its statistics
        (float64 [D+1, D+1]: the input and key-weighted second moments, and one per kv group for attended values), and
        the larger of
          calibration: the float32 decoder layer the calibration runs, one group's attended-input product, the
            attention activations of one sample (a block of 128 queries against every key, and the block's attended
            inputs in float64) and the MLP activations of one batch;
          factorization: the float64 maps of the RoPE split (query about 3 times, key and value about 4 times) and the
            solver's [D, D] float64 copies (each group's attended covariance is made in place).
        Checked at Llama-3-8B shapes against the measured peak: docs/decisions.md#memory-estimate.
        Writing: the shard writer's buffer (up to one shard) plus one kept layer being read into it."""
        m = self.memory
        hidden, heads, groups, head_dim, inter = self.hidden, self.heads, self.groups, self.head_dim, m["intermediate"]
        src, out = m["source_element"], self.bytes_per_element
        attn = (2 * heads + 2 * groups) * head_dim * hidden
        mlp = 3 * hidden * inter
        tokens, seq, samples = self.calib_tokens, m["seq_len"], m["samples"]
        square = (hidden + 1) ** 2 * 8
        stats = (2 + (groups if m["attended"] else 0)) * square if tokens else 0
        float_copy = 0 if src == 4 else 4  # a float32 source's tensors are used as read
        calibration = 0
        if m["calibrated"]:
            block = min(128, seq)
            acts = (4 * heads * seq * (3 * head_dim + 3 * block) + 16 * heads * block * (hidden + 1)
                    + 4 * 3 * min(samples, 8) * seq * inter)  # fmt: skip
            calibration = (attn + mlp) * float_copy + (square if m["attended"] else 0) + acts
        maps = 8 * (3 * heads * head_dim * hidden + 4 * groups * head_dim * hidden) + 2 * hidden**2 * 8
        parts = {
            "runtime": BASELINE,
            "calibration hidden states": 3 * tokens * hidden * 4 if m["calibrated"] else 0,
            "one layer as stored": (attn + mlp + 2 * hidden) * src,
            "one layer's working set": attn * float_copy + stats + max(calibration, maps),
        }
        writing = m["shard_bytes"] + (attn + mlp) * out + BASELINE
        if writing > sum(parts.values()):  # the writer's phase is the heavier one: it is what the estimate shows
            parts = {"runtime": BASELINE, "shard writer buffer": m["shard_bytes"], "one kept layer": (attn + mlp) * out}
        if self.refine_model_steps:  # the model stage holds the whole converted model (refine.model_stage_bytes)
            stage = {"runtime": BASELINE, "calibration hidden states": 2 * tokens * hidden * 4,
                     "model stage": refine.model_stage_bytes(self, seq, self.refine_model_scope)}
            if sum(stage.values()) > sum(parts.values()):
                parts = stage
        return parts

    def memory_estimate(self) -> int:
        """Peak resident bytes: `memory_parts` x MEMORY_SAFETY (see there)."""
        return int(sum(self.memory_parts().values()) * MEMORY_SAFETY)

    def kv_cache_record(self) -> dict:
        return {
            "elements_per_token_per_layer_before": self.kv_before,
            "elements_per_token_per_layer_after": self.kv_after(),
            "bytes_per_token_before": self.kv_bytes_before,
            "bytes_per_token_after": self.kv_bytes_after,
            "ratio": round(self.ratio, 6),
            "dtype": self.dtype,
        }

    def describe(self) -> str:
        d_r = self.rope_dims
        d_c = self.kv_lora_rank
        rank_text = str(d_c[0]) if len(set(d_c)) == 1 else f"{min(d_c)}..{max(d_c)}"
        lines = [
            f"family {self.family} ({self.model_type}): {self.layers} layers, hidden {self.hidden}, "
            f"{self.heads} query / {self.groups} kv heads, head_dim {self.head_dim}",
            f"latent d_c {rank_text} + rope key d_r {d_r} per layer; nope head dim {self.nope_dims} (query/key width "
            f"{self.nope_dims + d_r}), value head dim {self.head_dim}",
            "per-layer shapes: " + ", ".join(f"{k} {list(v)}" for k, v in self.shapes.items()),
            f"KV cache per token per layer: {self.kv_before} -> {self.kv_after():g} elements",
            f"KV cache per token (all layers, {self.dtype}): {self.kv_bytes_before} -> {self.kv_bytes_after} bytes "
            f"(ratio {self.ratio:.3f}, {1 / self.ratio:.2f}x smaller)",
            f"attention parameters: {self.attn_params_before:,} -> {self.attn_params_after:,}",
            *([f"per-head q/k norms: {QK_NORM_TEXT[self.qk_norm]}"] if self.qk_norm else []),
            (f"calibration: {self.memory['samples']} windows x {self.memory['seq_len']} tokens" if self.calib_tokens
             else "calibration: none (weight-only statistics)"),
            f"refinement: {self.refine_steps} steps per layer" + (
                f" (about {self.refine_seconds / 60:.0f} min on a 2-core CPU)" if self.refine_steps else "")
            + f"; model stage: {self.refine_model_steps} steps" + (
                f" (about {self.refine_model_seconds / 60:.0f} min)" if self.refine_model_steps else "")
            + (f"; training steps in {self.refine_precision}" if self.refine_steps or self.refine_model_steps else ""),
            f"source size {self.source_bytes / 2**20:.0f} MiB; estimated peak memory {self.memory_estimate() / 2**30:.2f} GiB"
            f" (x{MEMORY_SAFETY} of: " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in self.memory_parts().items() if v)
            + ")",
        ]
        return "\n".join(lines)


def _dims(config) -> tuple[int, int, int, int, int]:
    heads = config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, config.hidden_size, heads, groups, head_dim


def max_rank(config) -> int:
    _, hidden, _, groups, head_dim = _dims(config)
    return min(2 * groups * head_dim, hidden)


def default_rope_dims(options: ConvertOptions, groups: int, head_dim: int) -> int:
    """d_r when --rope-dims is not given: a third of the cache budget, at most three quarters of head_dim and at most
    64 (the rope key width of vLLM's MLA kernels, `SERVED_ROPE_MAX`: a wider key cannot be served there); head_dim/2
    (same cap) with --rank.

    The RoPE pairs lose more than the rank until the latent gets small, so the rope key takes a large share, but not
    the whole head: chosen on the development split, docs/decisions.md#rope-key-width."""
    from mla_convert.serving.layout import SERVED_ROPE_MAX

    step = 2 if options.rope_merge else 2 * groups  # without merging every kv head keeps the same number of pairs
    cap = min(head_dim, max(step, SERVED_ROPE_MAX // step * step))
    if options.kv_budget is None:
        return min(head_dim // 2, cap)
    cap = min(cap, max(step, 3 * head_dim // 4 // step * step))
    budget = options.kv_budget * 2 * groups * head_dim if options.kv_budget <= 1 else options.kv_budget
    return int(min(cap, max(step, step * round(budget / 3 / step))))


# Calibration windows by the share of the source's cache a conversion keeps (`--calib-samples`, default): a wider
# latent and its refinement fit more from the same text when it has more of it; chosen on the development split,
# docs/decisions.md#calibration-windows.
CALIB_SAMPLES = 16
WIDE_CALIB_SAMPLES = 32
WIDE_FROM = refine.WIDE_FROM  # the one threshold of every default by the cache kept


def default_calib_samples(kept: float) -> int:
    """The calibration windows of a conversion that keeps `kept` (a fraction) of the source's KV cache: CALIB_SAMPLES
    below WIDE_FROM, else WIDE_CALIB_SAMPLES."""
    return CALIB_SAMPLES if kept < WIDE_FROM else WIDE_CALIB_SAMPLES


def default_nope_dims(options: ConvertOptions, head_dim: int, d_r: int, qk_norm: str | None) -> int:
    """d_n when --nope-dims is not given: head_dim - d_r where d_r <= head_dim/2 with merged RoPE pairs, so that a
    head's query/key width d_n + d_r is the source's head_dim: attention then costs what the source's does and runs
    sdpa's fused kernels without padding (the value keeps head_dim). Merged pairs leave the nope key d_h - d_r dropped
    dims plus the small remainder of the kept frequencies that the merge did not move into the rope key; the
    query-weighted reduction (`narrow_nope`) keeps nearly all of the nope score energy (recorded per layer as
    `nope_kept`; docs/decisions.md#nope-key-width). Otherwise (wider rope keys, unmerged pairs, per-head
    q/k norms): head_dim."""
    if qk_norm or not options.rope_merge or 2 * d_r > head_dim:
        return head_dim
    return head_dim - d_r


def make_plan(source: Source, family: Family, options: ConvertOptions) -> Plan:
    """Validate the options against the source config and compute the plan (nothing heavy, nothing written)."""
    config = source.config
    layers, hidden, heads, groups, head_dim = _dims(config)
    if options.rank is not None and options.kv_budget is not None:
        raise UserError("give --rank (latent dims) or --kv-budget (cache per token per layer), not both")
    if options.kv_budget is not None and not (math.isfinite(options.kv_budget) and options.kv_budget > 0):
        raise UserError(f"--kv-budget must be a positive number (elements, or a fraction <= 1), got {options.kv_budget}")
    if options.kv_balance is not None and not math.isfinite(options.kv_balance):
        raise UserError(f"--kv-balance must be a positive number, got {options.kv_balance}")
    d_r = default_rope_dims(options, groups, head_dim) if options.rope_dims is None else options.rope_dims
    if d_r <= 0 or d_r % 2 or d_r > groups * head_dim:
        raise UserError(
            f"--rope-dims must be even, at least 2 (without a rope key the model loses every position) and at most "
            f"{groups * head_dim} (kv heads x head_dim), got {d_r}"
        )
    if not options.rope_merge and d_r % (2 * groups):
        raise UserError(
            f"--rope-dims {d_r} without merging must be a multiple of {2 * groups} (2 x kv heads): "
            "use --rope-merge or change --rope-dims"
        )
    top = max_rank(config)
    if options.rank is None:
        if options.kv_budget is None:
            raise UserError("give --rank (latent dims) or --kv-budget (elements per token per layer, or a fraction)")
        budget = options.kv_budget * 2 * groups * head_dim if options.kv_budget <= 1 else options.kv_budget
        rank = int(round(budget)) - d_r
    else:
        rank = options.rank
    if rank <= 0:
        raise UserError(f"the latent rank must be positive (got {rank}); raise --rank/--kv-budget or lower --rope-dims")
    if rank > top:
        raise UserError(f"--rank {rank} exceeds the maximum {top} (min of 2 x kv heads x head_dim and hidden size)")
    if options.factorization not in ("joint", "split"):
        raise UserError(f"--factorization must be joint or split, got {options.factorization}")
    if options.method not in lowrank.METHODS:
        raise UserError(f"--method must be one of {', '.join(lowrank.METHODS)}, got {options.method}")
    if options.rope_strategy not in rope.STRATEGIES:
        raise UserError(f"--rope-strategy must be one of {', '.join(rope.STRATEGIES)}, got {options.rope_strategy}")
    if options.objective not in lowrank.OBJECTIVES:
        raise UserError(f"--objective must be one of {', '.join(lowrank.OBJECTIVES)}, got {options.objective}")
    if options.dropped_rope not in ("unrotated", "expected"):
        raise UserError(f"--dropped-rope must be unrotated or expected, got {options.dropped_rope}")
    if options.kv_balance is not None and not options.kv_balance > 0:
        raise UserError(f"--kv-balance must be positive, got {options.kv_balance}")
    if options.calib_data is None and options.objective != "kv":
        raise UserError(f"--objective {options.objective} needs calibration text: pass --calib-data FILE or --objective kv")
    if options.calib_propagate not in ("source", "converted"):
        raise UserError(f"--calib-propagate must be source or converted, got {options.calib_propagate}")
    if options.value_inputs not in INPUT_KINDS:
        raise UserError(f"--value-inputs must be one of {', '.join(INPUT_KINDS)}, got {options.value_inputs}")
    if options.latent_rounds < 0:
        raise UserError(f"--latent-rounds must be 0 or more, got {options.latent_rounds}")
    if options.latent_rounds and (options.value_inputs != "attended" or options.factorization != "joint"):
        raise UserError("--latent-rounds refines a joint latent for attended values: use it with --value-inputs "
                        "attended and --factorization joint (or drop it)")
    if options.refine_steps is not None and options.refine_steps < 0:
        raise UserError(f"--refine-steps must be 0 or more, got {options.refine_steps}")
    if not options.refine_lr > 0:
        raise UserError(f"--refine-lr must be positive, got {options.refine_lr}")
    if options.refine_scope not in refine.SCOPES:
        raise UserError(f"--refine-scope must be one of {', '.join(refine.SCOPES)}, got {options.refine_scope}")
    if options.refine_precision not in refine.PRECISIONS:
        raise UserError(f"--refine-precision must be one of {', '.join(refine.PRECISIONS)}, got "
                        f"{options.refine_precision}")
    if not options.refine_mlp_lr_scale >= 0:
        raise UserError(f"--refine-mlp-lr-scale must be 0 or more, got {options.refine_mlp_lr_scale}")
    if options.refine_seq_len < 16:
        raise UserError(f"--refine-seq-len must be at least 16 tokens, got {options.refine_seq_len}")
    if options.refine_steps and options.calib_data is None:
        raise UserError("--refine-steps trains each layer on calibration text: pass --calib-data (or --refine-steps 0)")
    if options.refine_model_steps is not None and options.refine_model_steps < 0:
        raise UserError(f"--refine-model-steps must be 0 or more, got {options.refine_model_steps}")
    if not options.refine_model_lr > 0:
        raise UserError(f"--refine-model-lr must be positive, got {options.refine_model_lr}")
    if options.refine_model_scope not in refine.MODEL_SCOPES:
        raise UserError(f"--refine-model-scope must be one of {', '.join(refine.MODEL_SCOPES)}, got "
                        f"{options.refine_model_scope}")
    if options.refine_model_steps and options.calib_data is None:
        raise UserError("--refine-model-steps trains on calibration text: pass --calib-data (or --refine-model-steps 0)")
    if options.refine_model_steps and options.calib_propagate != "source":
        raise UserError("--refine-model-steps distils the source's outputs on the calibration stream, which "
                        "--calib-propagate converted does not carry: use --calib-propagate source (or "
                        "--refine-model-steps 0)")
    if options.key_inputs not in INPUT_KINDS:
        raise UserError(f"--key-inputs must be one of {', '.join(INPUT_KINDS)}, got {options.key_inputs}")
    if options.rank_allocation not in (*RANK_ALLOCATIONS, None):
        raise UserError(f"--rank-allocation must be one of {', '.join(RANK_ALLOCATIONS)}, got {options.rank_allocation}")
    if options.qk_norm not in QK_NORM_MODES:
        raise UserError(f"--qk-norm must be one of {', '.join(QK_NORM_MODES)}, got {options.qk_norm}")
    qk_norm = options.qk_norm if family.has_qk_norm(config) else None
    if qk_norm == "calibrated" and options.calib_data is None:
        raise UserError("--qk-norm calibrated takes each key's RMS from calibration text: pass --calib-data "
                        "(or use --qk-norm exact)")
    if (options.calib_samples is not None and options.calib_samples <= 0) or options.calib_seq_len <= 0:
        raise UserError("--calib-samples and --calib-seq-len must be positive")
    if options.calib_seq_len < 2:
        raise UserError("--calib-seq-len must be at least 2 (a window's attention needs a key before its query)")
    if options.calib_temperature is not None and not (options.calib_temperature > 0
                                                      and math.isfinite(options.calib_temperature)):
        raise UserError(f"--calib-temperature must be positive, got {options.calib_temperature}")
    if options.calib_sample_tokens <= 0:
        raise UserError(f"--calib-sample-tokens must be positive, got {options.calib_sample_tokens}")
    if options.nope_dims is None:
        d_n = default_nope_dims(options, head_dim, d_r, qk_norm)
    else:
        d_n = options.nope_dims
        if not 0 < d_n <= head_dim:
            raise UserError(f"--nope-dims must be between 1 and head_dim ({head_dim}), got {d_n}")
        if qk_norm and d_n != head_dim:
            raise UserError(f"--nope-dims {d_n}: this model normalizes each query and key head, whose nope key must "
                            f"keep head_dim ({head_dim}) dims: drop --nope-dims")
    dtype = options.dtype or _source_dtype(config)
    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    qkv_bias, o_bias = family.attention_biases(config)
    ranks = [rank] * layers
    plan = Plan(
        family=family.name,
        model_type=config.model_type,
        layers=layers,
        hidden=hidden,
        heads=heads,
        groups=groups,
        head_dim=head_dim,
        kv_lora_rank=ranks,
        rope_dims=d_r,
        nope_dims=d_n,
        dtype=dtype,
        source_bytes=source.nbytes(),
        calib_tokens=0,  # below, with the windows the cache kept asks for
        refine_scope=options.refine_scope,
        memory={
            "intermediate": getattr(config, "intermediate_size", 4 * hidden),
            "vocab": config.vocab_size,
            "source_element": _source_element(source, family),
            "calibrated": bool(options.calib_data) and options.needs_statistics(),
            "attended": bool(options.calib_data) and options.value_inputs == "attended",
            "seq_len": options.calib_seq_len,
            "shard_bytes": SHARD_BYTES,
        },
    )
    per_layer_before = (2 * heads + 2 * groups) * head_dim * hidden + (heads + 2 * groups) * head_dim * qkv_bias
    plan.attn_params_before = per_layer_before * layers
    plan.qkv_bias = bool(qkv_bias)
    plan.qk_norm, plan.norm_eps = qk_norm, float(getattr(config, "rms_norm_eps", 1e-6))
    plan.qk_norm_scope = family.qk_norm_scope(config) or "head"
    plan.norm_unit_offset = family.gemma(config)
    plan.set_kv_lora_rank(ranks)
    plan.memory["samples"] = options.calib_samples or default_calib_samples(plan.ratio)  # by the cache kept
    if plan.memory["calibrated"]:
        plan.calib_tokens = plan.memory["samples"] * options.calib_seq_len
    plan.memory["shard_bytes"] = min(SHARD_BYTES, output_bytes(config, plan))  # the writer holds at most a shard
    if plan.ratio >= 1 and not options.force:
        raise UserError(
            f"the MLA cache ({plan.kv_after():g} per token per layer) is not smaller than the source's "
            f"({plan.kv_before}): lower --rank/--rope-dims, or pass --force to convert anyway"
        )
    return plan


def _source_element(source: Source, family: Family) -> int:
    """Bytes per element of the source's tensors as stored (its first layer's query weight; 4 if it has none)."""
    name = family.tensor(0, "q")
    return source.element_size(name) if source.has(name) else 4


def _source_dtype(config) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).replace("torch.", "") if dtype is not None else "float32"
    return name if name in DTYPES else "float32"


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
    config.architectures = ["MLAForCausalLM"]
    config.dtype = dtype
    return config


# ------------------------------------------------------------------------------------------------- one layer


def convert_attention(
    tensors: dict[str, torch.Tensor],
    plan: Plan,
    layer: int,
    options: ConvertOptions,
    attention_scaling: float,
    cov: torch.Tensor | None,
    phase: torch.Tensor | None = None,
    attended: torch.Tensor | None = None,
    keyed: torch.Tensor | None = None,
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """One layer's source attention -> MLA attention tensors.

    tensors: {"q", "k", "v", "o"} weights and optional {"q_bias", "k_bias", "v_bias", "o_bias"} (float32);
    cov: augmented input second moment [D+1, D+1] (None: weight-only proxies);
    phase: [H, d_h/2] complex E[e^{j theta d}] under each head's attention (None: dropped pairs stay unrotated);
    attended: [G, D+1, D+1] second moment of the attention-averaged inputs per kv group (None: values are fit on
    token inputs like keys). Given the latent, each group's value up-projection is then the least-squares map on the
    inputs values are consumed through: U_v = W_v C~ D^T (D C~ D^T)^-1 (exact at full rank, as any left inverse);
    keyed: [D+1, D+1] second moment of the inputs weighted by the attention each token's key receives (None: `cov`),
    the input statistics of the low-rank factorization and of the key pairs in the RoPE merge.
    Returns ({"q_proj.weight", ...} named as in MLAAttention, rope frequency index of each rope-key pair).
    """
    heads, groups, head_dim, hidden = plan.heads, plan.groups, plan.head_dim, plan.hidden
    rank = plan.kv_lora_rank[layer]
    maps = _layer_maps(tensors, plan, options, attention_scaling, cov, phase, keyed)
    k_nope, w_v = maps["k_nope"], maps["v"]
    up_k, up_v, down = lowrank.joint_or_split(
        k_nope[:, :hidden], w_v[:, :hidden], rank, options.factorization == "split", *maps["objective"]
    )
    if attended is not None and options.factorization == "joint":
        covs = _attended_covs(attended[:, :hidden, :hidden], maps["objective"][0], hidden)
        if options.latent_rounds:
            up_k, up_v, down = _refine_latent(
                k_nope[:, :hidden], w_v[:, :hidden], down, covs, maps["objective"], options.latent_rounds, head_dim
            )
        else:
            up_v = _attended_values(w_v[:, :hidden], down, covs, head_dim)
    up_k, k_bias = up_k.double().view(groups, head_dim, rank), k_nope[:, hidden].view(groups, head_dim)
    q_all, k_rope = maps["q"].view(heads, head_dim + plan.rope_dims, hidden + 1), maps["k_rope"]
    if plan.nope_dims < head_dim:
        q_all, up_k, k_bias = narrow_nope(q_all, up_k, k_bias, down, cov, plan, layer)
    kv_b = torch.cat([up_k, up_v.double().view(groups, head_dim, rank)], dim=1)
    kv_b_bias = torch.cat([k_bias, w_v[:, hidden].view(groups, head_dim)], dim=1)
    q_all = q_all.reshape(-1, hidden + 1)
    out = {
        "q_proj.weight": q_all[:, :hidden],
        "kv_a_proj.weight": torch.cat([down.double(), k_rope[:, :hidden]]),
        "kv_b_proj.weight": kv_b.reshape(groups * (plan.nope_dims + head_dim), rank),
        "o_proj.weight": tensors["o"],
    }
    if plan.qk_norm:  # the source's query and norm; per head to the nope and rope parts
        out["q_proj.weight"] = tensors["q"]
        out["q_norm.weight"] = tensors["q_norm"]
        out["q_head_proj.weight"] = maps["q_head"].reshape(heads * (head_dim + plan.rope_dims), head_dim)
        if plan.qk_norm == "exact":
            out.update({"k_norm.weight": tensors["k_norm"], "k_rope_up": maps["k_rope_up"],
                        "k_rope_down": maps["k_rope_down"]})  # fmt: skip
    if "q_bias" in tensors or "k_bias" in tensors:
        out["q_proj.bias"] = tensors.get("q_bias", torch.zeros(heads * head_dim)) if plan.qk_norm else q_all[:, hidden]
        out["kv_a_proj.bias"] = torch.cat([torch.zeros(rank, dtype=torch.float64), k_rope[:, hidden]])
        out["kv_b_proj.bias"] = kv_b_bias.reshape(-1)
    if "o_bias" in tensors:
        out["o_proj.bias"] = tensors["o_bias"]
    return {k: v.float() for k, v in out.items()}, maps["rope_plan"].frequencies


NOPE_KEPT_WARN = 0.98  # below what the default's layers keep (docs/decisions.md#nope-key-width)


def narrow_nope(q_all, up_k, k_bias, down, cov, plan: Plan, layer: int):
    """Each head's nope query and its group's nope key narrowed from head_dim to plan.nope_dims dims
    (`lowrank.bilinear_reduce` per kv group: the group's heads' nope queries under the calibration inputs against
    the keys the latent gives). q_all [H, d_h + d_r, D+1] (nope rows first), up_k [G, d_h, d_c], k_bias [G, d_h] ->
    the same with d_n nope dims. Records the share of the nope score energy kept in plan.nope_kept."""
    heads, groups, head_dim, hidden, d_n = plan.heads, plan.groups, plan.head_dim, plan.hidden, plan.nope_dims
    per = heads // groups
    q_nope = q_all[:, :head_dim]  # [H, d_h, D+1]
    q_gram = _group_query_grams(q_nope, cov, plan)
    # the latent's second moment under the inputs (weight-only: unit inputs)
    x_cov = torch.eye(hidden, dtype=torch.float64) if cov is None else cov[:hidden, :hidden].double()
    latent_cov = down.double() @ x_cov @ down.double().T
    queries, keys, biases, kept = [], [], [], []
    for g in range(groups):
        a, b, share = lowrank.bilinear_reduce(q_gram[g], up_k[g] @ latent_cov @ up_k[g].T, d_n)
        queries.append(torch.einsum("nd,hnx->hdx", a, q_nope[g * per : (g + 1) * per]))
        keys.append(b @ up_k[g])
        biases.append(b @ k_bias[g])
        kept.append(share)
    plan.nope_kept.append({"layer": layer, "kept": round(min(kept), 6)})
    if min(kept) < NOPE_KEPT_WARN:
        log.warning("the %d-dim nope query/key keeps %.1f%% of layer %d's nope score energy: --nope-dims %d keeps all",
                    d_n, 100 * min(kept), layer, head_dim)
    q_all = torch.cat([torch.cat(queries), q_all[:, head_dim:]], dim=1)  # [H, d_n + d_r, D+1]
    return q_all, torch.stack(keys), torch.stack(biases)


def _attended_covs(attended, token_cov, dim: int, blend: float = 0.05) -> list[torch.Tensor]:
    """Per kv group, the input second moment a value map is judged on: the attended inputs' (trace-normalized) plus
    `blend` x the token inputs' and the factorization's ridge, scaled to the token inputs' trace. Attended inputs from a
    small calibration set are often rank-deficient (layer 0 sees few distinct tokens); the token term keeps every
    direction of W_v determined, so full rank stays exact.

    Computed in place in `attended` (float64; a layer's statistics are used once): at 8B shapes each group's matrix is
    134 MB, and a second set of them would be the largest part of the layer's working set."""
    token = torch.eye(dim, dtype=torch.float64) if token_cov is None else token_cov.double()
    scale = token.diagonal().sum().clamp_min(1e-300)
    mixed = blend * token / scale
    covs = []
    for a in attended:  # = lowrank.ridged(a / trace(a) + mixed) * scale, without the copies
        a = a.double()
        a.div_(a.diagonal().sum().clamp_min(1e-300)).add_(mixed)
        a.diagonal().add_(lowrank.RIDGE * a.diagonal().mean().clamp_min(1e-12))
        covs.append(a.mul_(scale))
    return covs


def _attended_values(w_v, down, covs: list[torch.Tensor], head_dim: int):
    """Per kv group, the value up-projection [d_h, r] minimizing E||(W_v - U D) x~||^2 under the group's `covs`."""
    return torch.cat([lowrank.fit_up(w_v[g * head_dim : (g + 1) * head_dim], down, c) for g, c in enumerate(covs)]).float()


def _refine_latent(k_nope, w_v, down, covs, objective, rounds: int, head_dim: int):
    """The shared latent refined for keys on their inputs and each group's values on its attended inputs
    (`lowrank.refine_shared`). Returns (up_k, up_v, down), float32."""
    x_cov, k_weight, v_weight = objective
    token = lowrank.ridged(torch.eye(down.shape[1], dtype=torch.float64) if x_cov is None else x_cov)
    blocks = [(k_nope, k_weight, token)]
    for g, c in enumerate(covs):
        rows = slice(g * head_dim, (g + 1) * head_dim)
        blocks.append((w_v[rows], None if v_weight is None else v_weight[rows, rows], c))
    ups, down = lowrank.refine_shared(blocks, down, rounds=rounds)
    return ups[0].float(), torch.cat(ups[1:]).float(), down.float()


def layer_spectrum(
    tensors, plan: Plan, options: ConvertOptions, attention_scaling: float, cov, phase=None, attended=None, keyed=None
) -> torch.Tensor:
    """The eigenvalues (descending) of one layer's joint low-rank objective: the error left at rank r is the sum of
    those past r. What `--rank-allocation energy` shares the latent dims by."""
    hidden = plan.hidden
    maps = _layer_maps(tensors, plan, options, attention_scaling, cov, phase, keyed)
    return lowrank.joint_spectrum(maps["k_nope"][:, :hidden], maps["v"][:, :hidden], *maps["objective"])


def _layer_maps(tensors, plan: Plan, options: ConvertOptions, attention_scaling: float, cov, phase, keyed=None) -> dict:
    """The maps a layer's factorization starts from: the RoPE plan applied to q/k (query with the rope and nope parts,
    the shared rope key, the nope key), the value map (weights with the bias as last column, float64), and the
    objective (input covariance, key and value row weights) that `lowrank.joint_or_split` takes."""
    heads, groups, head_dim, hidden = plan.heads, plan.groups, plan.head_dim, plan.hidden
    d_r = plan.rope_dims

    def aug(name: str, rows: int) -> torch.Tensor:  # [rows, D+1]: weight with the bias as last column
        bias = tensors.get(f"{name}_bias")
        bias = torch.zeros(rows) if bias is None else bias
        return torch.cat([tensors[name].double(), bias.double()[:, None]], dim=1)

    w_q, w_k, w_v = aug("q", heads * head_dim), aug("k", groups * head_dim), aug("v", groups * head_dim)
    w_k_cached = w_k  # the key map the latent and the rope key carry
    if plan.qk_norm:
        # Per-head norms: score = RoPE(w_q . q)·RoPE(w_k . k) / (rms(q) rms(k)). The pairs are chosen on the weighted
        # maps (1/rms is a per-token scale). "exact" caches the pre-norm key (the model normalizes it per token);
        # "calibrated" replaces rms(k) by its calibration value per kv group, a linear key cached like any other.
        # A norm over the whole projection (OLMo 2) has one weight per row already, and one RMS per token.
        whole = plan.qk_norm_scope == "projection"
        offset = 1.0 if plan.norm_unit_offset else 0.0  # Gemma 3's norms multiply by (1 + weight)
        w_q = w_q * (tensors["q_norm"].double() + offset).repeat(1 if whole else heads)[:, None]
        w_k = w_k * (tensors["k_norm"].double() + offset).repeat(1 if whole else groups)[:, None]
        if plan.qk_norm == "calibrated":
            rms_groups, rms_dim = (1, groups * head_dim) if whole else (groups, head_dim)
            w_k = w_k_cached = w_k / key_rms(w_k_cached, cov, rms_groups, rms_dim, plan.norm_eps).repeat_interleave(
                rms_dim)[:, None]
    if cov is None:
        q_energy, k_cov = rope.pair_energies(w_q[:, :hidden], w_k[:, :hidden], None, heads, groups, head_dim)
    else:
        q_energy, k_cov = rope.pair_energies(w_q, w_k, cov, heads, groups, head_dim)
        if keyed is not None:  # key pairs judged on the tokens whose keys get attended
            k_cov = rope.pair_energies(w_q, w_k, keyed, heads, groups, head_dim)[1]
    rope_plan = rope.plan_rope(
        d_r, options.rope_strategy, options.rope_merge, heads, groups, head_dim, q_energy, k_cov, phase
    )
    q_all, k_rope, k_nope = _split_maps(rope_plan, w_q, w_k_cached, plan, options, phase, attention_scaling)
    q_nope = q_all[:, :head_dim]  # [H, d_h, D+1]
    q_all = q_all.reshape(heads * (head_dim + d_r), hidden + 1)
    extra = {}
    if plan.qk_norm:  # the same maps on the normalized query and key: identities in, per-head / per-key maps out
        eye_q = torch.eye(head_dim, dtype=torch.float64).repeat(heads, 1)  # [H*d_h, d_h]
        eye_k = torch.eye(groups * head_dim, dtype=torch.float64)
        q_head, down, nope = _split_maps(rope_plan, eye_q, eye_k, plan, options, phase, attention_scaling)
        # nope = I - R K and K R = I, so R = (I - nope) K^T (K K^T)^-1
        up = torch.linalg.solve(down @ down.T, down @ (eye_k - nope).T).T
        extra = {"q_head": q_head, "k_rope_down": down, "k_rope_up": up}

    fit_cov = cov if keyed is None else keyed
    x_cov = None if (fit_cov is None or options.method == "weight") else fit_cov[:hidden, :hidden]
    k_weight, v_weight = _row_weights(options, q_nope, tensors["o"], cov, plan)
    if options.kv_balance is not None:
        e_k = lowrank.energy(k_nope[:, :hidden], x_cov, k_weight)
        e_v = lowrank.energy(w_v[:, :hidden], x_cov, v_weight)
        scale = (options.kv_balance * e_v / max(e_k, 1e-30)) ** 0.5
        eye = torch.eye(groups * head_dim, dtype=torch.float64)
        k_weight = scale * (eye if k_weight is None else k_weight)
    return {"q": q_all, "k_rope": k_rope, "k_nope": k_nope, "v": w_v, "rope_plan": rope_plan,
            "objective": (x_cov, k_weight, v_weight), **extra}  # fmt: skip


def _split_maps(rope_plan, w_q, w_k, plan: Plan, options: ConvertOptions, phase, attention_scaling: float):
    """A rope plan applied to query and key maps w_q [H*d_h, D'], w_k [G*d_h, D''] -> (the query per head: nope part,
    then rope part [H, d_h+d_r, D'], the shared rope key [d_r, D''], the nope key [G*d_h, D''])."""
    heads, groups, head_dim = plan.heads, plan.groups, plan.head_dim
    q_rope, k_rope, k_nope = rope.split_rope(rope_plan, w_q, w_k, heads, groups, head_dim)
    # Dims that lose their rotation also lose the RoPE type's cos/sin scaling (s on q and on k): keep it on the query.
    # A dropped pair's query takes the expected rotation under the head's attention (kept pairs meet no nope key).
    w_q_nope = w_q if phase is None or options.dropped_rope != "expected" else rope.apply_phases(w_q, phase, heads, head_dim)
    q_nope = w_q_nope.view(heads, head_dim, -1) * attention_scaling**2
    return torch.cat([q_nope, q_rope], dim=1), k_rope, k_nope


def key_rms(w_k: torch.Tensor, cov: torch.Tensor | None, groups: int, head_dim: int, eps: float) -> torch.Tensor:
    """Each kv group's key RMS over the calibration tokens, sqrt(E[mean_d k_d^2] + eps), from the augmented input
    second moment (w_k [G*d_h, D+1] with the bias as last column, cov [D+1, D+1]) -> [G] float64."""
    if cov is None:
        raise UserError("--qk-norm calibrated needs calibration statistics: pass --calib-data (or --qk-norm exact)")
    energy = ((w_k @ cov.double()) * w_k).sum(-1)  # E[k_d^2] per key dim, [G*d_h]
    return (energy.view(groups, head_dim).mean(-1) + eps).sqrt()


def _group_query_grams(q_nope: torch.Tensor, cov, plan: Plan) -> torch.Tensor:
    """Per kv group, the second moment of its heads' nope queries summed over them, sum_h E[q_h q_h^T] [G, d_h, d_h],
    from the query maps q_nope [H, d_h, D+1] (bias last) under the augmented input moment `cov` (None: unit inputs,
    bias dropped)."""
    q = q_nope if cov is not None else q_nope[..., : plan.hidden]
    q_gram = q @ cov @ q.transpose(-1, -2) if cov is not None else q @ q.transpose(-1, -2)  # [H, d_h, d_h]
    return q_gram.view(plan.groups, plan.heads // plan.groups, plan.head_dim, plan.head_dim).sum(1)


def _row_weights(options: ConvertOptions, q_nope: torch.Tensor, w_o: torch.Tensor, cov, plan: Plan):
    """Row weightings (k_weight, v_weight) of the low-rank objective, or (None, None) for plain K/V error.

    attention: a key error e of kv group g costs sum_h E[(q_h . e)^2] / d_h in scores (queries of the group's heads,
    nope part, under the calibration inputs); a value error e costs sum_h ||W_o,h e||^2 after o_proj.
    scores: keys as in attention, values by their own error (as in kv).
    """
    if options.objective not in ("attention", "scores"):
        return None, None
    heads, groups, head_dim = plan.heads, plan.groups, plan.head_dim
    per = heads // groups
    q_gram = _group_query_grams(q_nope, cov, plan) / head_dim
    w_o = w_o.double().view(-1, heads, head_dim).transpose(0, 1)  # [H, D, d_h]
    o_gram = (w_o.transpose(-1, -2) @ w_o).view(groups, per, head_dim, head_dim).sum(1)  # [G, d_h, d_h]
    if options.objective == "scores":
        return lowrank.group_weight(list(q_gram)), None
    return lowrank.group_weight(list(q_gram)), lowrank.group_weight(list(o_gram))


# ------------------------------------------------------------------------------------------------- whole model


def _layer_names(source: Source, layer: int, family: Family) -> list[str]:
    prefix = family.layer_prefix.format(i=layer)
    return [k for k in source.keys() if k.startswith(prefix)]


def _raw_layer(source: Source, layer: int, family: Family) -> dict[str, torch.Tensor]:
    """One layer's tensors as stored (the source's dtype, on the CPU), named within the layer."""
    prefix = family.layer_prefix.format(i=layer)
    return {n[len(prefix) :]: source.get_raw(n) for n in _layer_names(source, layer, family)}


def _on(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """float32 copies on `device` (the tensors themselves where they already are)."""
    return {n: t.to(device=device, dtype=torch.float32) for n, t in tensors.items()}


def resolve_device(device: str) -> str:
    """--device: cpu, cuda, cuda:N, or auto (cuda when this torch sees a CUDA device, else cpu). A UserError names
    the fix for a device this machine lacks."""
    from mla_convert.evaluate import check_device

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if check_device(device).startswith("mps"):
        raise UserError("--device mps: the factorization needs float64, which MPS lacks: use --device cpu or cuda")
    return device


class LayerClock:
    """Seconds each layer spends calibrating (statistics, forwards) and factorizing, shown beside the progress bar's
    ETA and logged (-v). A CUDA device is synchronized at each lap so its queued work is counted where it ran."""

    def __init__(self, device: torch.device):
        import time

        self.device, self.time = device, time.perf_counter
        self.seconds: dict[str, float] = {}
        self.last = self.time()

    def lap(self, what: str) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = self.time()
        self.seconds[what] = self.seconds.get(what, 0.0) + now - self.last
        self.last = now

    def report(self, bar, layer: int, phase: str = "") -> None:
        text = ", ".join(f"{k} {v:.1f}s" for k, v in self.seconds.items())
        bar.set_postfix_str(text, refresh=False)
        log.info("%slayer %d: %s", phase, layer, text)


def _module_from(cls_or_factory, tensors: dict[str, torch.Tensor]):
    with torch.device("meta"):
        module = cls_or_factory()
    module.load_state_dict(tensors, assign=True, strict=True)
    return module.eval()


def convert(
    source: Source,
    out: Path,
    options: ConvertOptions,
    family_name: str | None = None,
    overwrite: bool = False,
    dry_run: bool = False,
    progress: bool = True,
) -> Plan:
    """Convert `source` into a native MLA checkpoint at `out`. With `dry_run`, only plan and return."""
    from tqdm.auto import tqdm

    family = family_for(source.config, family_name)
    from mla_convert.validate import check_source_finite, check_source_shapes

    check_source_shapes(source, family)  # every tensor present, of the config's shape: before the plan
    options = resolve_allocation(without_calibration(options))
    if options.factorization == "split" and options.value_inputs == "attended" and not options.latent_rounds:
        # the attended refit fits values in the whole latent, which a split factorization keeps for keys and values
        # apart: record what runs
        log.info("--factorization split: values keep their per-token fit (--value-inputs token)")
        options = dataclasses.replace(options, value_inputs="token")
    plan = make_plan(source, family, options)
    if options.calib_temperature is None:
        options = dataclasses.replace(options, calib_temperature=selftext.calib_temperature(plan.ratio))
    options = dataclasses.replace(options, calib_samples=plan.memory["samples"])  # the default by the cache kept
    window = min(options.refine_seq_len, options.calib_seq_len)  # the refinement windows are calibration windows
    precision = refine.resolve_precision(options.refine_precision, options.device)
    rate = refine.cpu_rate(precision)
    steps = refine.resolve_steps(options.refine_steps, plan, options.device, window, rate) if options.calib_data else 0
    options = dataclasses.replace(options, refine_steps=steps, refine_seq_len=window, refine_precision=precision)
    plan.refine_steps, plan.refine_precision = steps, precision
    plan.refine_seconds = refine.estimate_seconds(plan, steps, window, rate)
    model_steps = (refine.resolve_model_steps(options.refine_model_steps, plan, options.device, window, rate)
                   if options.calib_data and options.calib_propagate == "source" and options.needs_statistics() else 0)
    options = dataclasses.replace(options, refine_model_steps=model_steps)
    plan.refine_model_steps = model_steps
    plan.refine_model_scope = options.refine_model_scope
    plan.refine_model_seconds = refine.estimate_model_seconds(plan, model_steps, window, rate)
    if dry_run:
        return plan
    check_source_finite(source, family)  # before any work: a NaN or inf weight would convert into a broken output
    source.tokenizer()  # read even without calibration text: a broken tokenizer is refused, not copied into the output
    config = source.config
    # calibration runs source layers causally (calibration.layer_mask); eager where sdpa would drop the source's
    # score soft-capping (Gemma 2)
    config._attn_implementation = "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"
    # each layer's RoPE (Gemma 3: a base per layer type)
    frequencies = [rope.source_frequencies(rope.rope_config(config, rope.layer_type(config, i)))
                   for i in range(plan.layers)]
    device = torch.device(resolve_device(options.device))
    torch.manual_seed(options.seed)
    inputs = (Path(source.origin),) if Path(source.origin).exists() else ()  # the folder or the .gguf file read
    # the calibration text and tokenizer are read before anything is staged: their errors come first
    runner = _calibration_runner(source, options) if options.needs_statistics() and options.calib_data else None
    if runner is not None:
        runner.to(device)  # the calibration hidden states stay on the device for the whole run
    check_room(Path(out), output_bytes(config, plan))  # before the staging folder and the calibration forwards
    with staged_output(out, overwrite, inputs, fingerprint=_fingerprint(source, options, plan)) as stage:
        kept = resume_dir(stage)  # one file per converted layer: what a killed run keeps for the next one
        # kept in the output dtype (the cast the shards would make anyway), in float32 when the converted layers
        # carry the calibration activations on (they ran in float32)
        kept_dtype = torch.float32 if options.calib_propagate == "converted" else DTYPES[plan.dtype]
        skip_through = -1  # layers up to this one need no calibration forward: their output activations are kept
        done = {i for i in range(plan.layers) if kept_file_intact(kept / _layer_file(i))}
        if done:
            log.warning("resuming in %s: %d of %d layers were converted already", stage, len(done), plan.layers)
        if options.needs_statistics() and runner is None:
            log.warning("no calibration data: RoPE selection and factorization use weight-only statistics")
        rope_pairs: list[list[int]] = [[0] * (plan.rope_dims // 2) for _ in range(plan.layers)]

        def layer_inputs(i: int):
            """(prefix, the layer's tensors, its attention tensors, the source layer module or None, statistics =
            (cov, phase, attended, keyed)): the statistics taken at the runner's current hidden states."""
            prefix = family.layer_prefix.format(i=i)
            layer_tensors = _raw_layer(source, i, family)  # in the source's dtype: most of them pass through
            attn = _on(_attention_tensors(layer_tensors, family, i, prefix, plan.qk_norm), device)
            source_layer = cov = phase = attended = keyed = None
            if runner is not None:
                from mla_convert.calibration import second_moment

                source_layer = _source_layer(config, family, i, _on(layer_tensors, device))
                with torch.device(device):  # factory calls (eye, zeros, ones) land beside their inputs
                    cov = second_moment(runner.attention_input(source_layer))
                    if options.needs_attention_statistics():
                        every = ATTENDED_EVERY if options.value_inputs == "attended" else 0
                        profile, attended, keyed = runner.attention_statistics(source_layer, attended_every=every)
                        if options.needs_attention_profile():
                            phase = rope.attention_phases(profile, frequencies[i][0].to(device))
                        keyed = keyed if options.key_inputs == "attended" else None
            return prefix, layer_tensors, attn, source_layer, (cov, phase, attended, keyed)

        if options.rank_allocation == "energy":
            # every layer's spectrum first (on the source's activations), then the ranks, then the conversion. Only
            # the spectra are kept: the conversion pass takes the statistics again from a second calibration stream,
            # so memory does not grow with depth (an 8B model's statistics are about 1.3 GB a layer)
            spectra = []
            bar = tqdm(range(plan.layers), desc="layers: statistics", disable=not progress, unit="layer")
            for i in bar:
                clock = LayerClock(device)
                _, _, attn, source_layer, statistics = layer_inputs(i)
                clock.lap("calibration")
                with torch.device(device):
                    spectra.append(layer_spectrum(attn, plan, options, frequencies[i][1], *statistics).cpu())
                del attn, statistics
                if runner is not None:
                    runner.advance(source_layer)
                clock.lap("factorization")
                clock.report(bar, i, "statistics pass, ")
            runner = _calibration_runner(source, options).to(device) if runner is not None else None
            plan.set_kv_lora_rank(allocate(plan, spectra, max_rank(config)))
            log.info("rank allocation (energy): %s", plan.kv_lora_rank)
        bar = tqdm(range(plan.layers), desc="layers: convert", disable=not progress, unit="layer")
        for i in bar:
            bar.set_description(f"({i + 1}/{plan.layers}) layers: convert")
            prefix = family.layer_prefix.format(i=i)
            if i in done:  # converted by an earlier run: only carry the calibration activations past it
                rope_pairs[i] = _read_layer(kept / _layer_file(i), tensors=False)[1]
                if runner is not None and i == 0:
                    past = _read_activations(kept)  # the hidden states after the last layer a run finished, if kept
                    if past is not None and all(j in done for j in range(past[0] + 1)):
                        skip_through, runner.hidden = past[0], past[1].to(device)
                if runner is not None and i > skip_through:
                    if options.calib_propagate == "converted":  # the layer as kept (its MLP too, if refined)
                        kept_tensors = {n[len(prefix) :]: t.to(device)
                                        for n, t in _read_layer(kept / _layer_file(i))[0].items()}
                        mla_tensors = {n[len("self_attn.") :]: t for n, t in kept_tensors.items()
                                       if n.startswith("self_attn.")}
                        runner.advance(_converted_layer(config, plan, family, rope_pairs, i, kept_tensors, mla_tensors))
                    else:
                        runner.advance(_source_layer(config, family, i, _on(_raw_layer(source, i, family), device)))
                continue
            clock = LayerClock(device)
            prefix, layer_tensors, attn, source_layer, statistics = layer_inputs(i)
            targets = None
            refining = runner is not None and options.refine_steps > 0
            # the whole layer along the source's stream: its update is what the advance below computes anyway
            from_advance = refining and options.refine_scope == "layer" and options.calib_propagate == "source"
            if refining and not from_advance:  # on the stream the runner carries
                targets = refine.stream_targets(source_layer, runner, options.refine_scope)
            if runner is not None and options.calib_propagate == "source":
                inputs = runner.hidden
                runner.advance(source_layer)  # now, so that its float32 copy is gone before the factorization
                source_layer = None
                if from_advance:
                    targets = (inputs, runner.hidden - inputs)  # = refine.stream_targets(..., "layer")
                del inputs
            clock.lap("calibration")
            with torch.device(device):
                mla_tensors, rope_pairs[i] = convert_attention(attn, plan, i, options, frequencies[i][1], *statistics)
            clock.lap("factorization")
            if targets is not None:
                mla_tensors, trained = _refined(config, plan, family, rope_pairs, i, layer_tensors, mla_tensors,
                                                targets, runner.embeddings_at(i), options, device)
                layer_tensors.update(trained)  # the MLP and norms, where the whole layer was trained and kept
                targets = None
                clock.lap("refine")
            # unchanged tensors (MLP, norms, unless refined with the layer) go out as read, in the source's dtype:
            # never through float32
            out_tensors = {prefix + n: t for n, t in layer_tensors.items() if not n.startswith("self_attn.")}
            out_tensors.update({f"{prefix}self_attn.{n}": t.cpu() for n, t in mla_tensors.items()})
            _write_layer(kept / _layer_file(i), out_tensors, rope_pairs[i], kept_dtype)
            if runner is not None:
                if options.calib_propagate == "converted":
                    runner.advance(_converted_layer(config, plan, family, rope_pairs, i, _on(layer_tensors, device),
                                                    mla_tensors))
                if i < plan.layers - 1 or options.refine_model_steps:  # the model stage reads the last ones
                    _write_activations(kept, i, runner.hidden.cpu())
                clock.lap("calibration")
            clock.report(bar, i)
            del layer_tensors, attn, mla_tensors, source_layer, out_tensors, statistics
        trained = {}  # the model stage's attention tensors, which replace the kept layers' in the shards
        if runner is not None and options.refine_model_steps:
            trained = _model_stage(source, config, plan, family, rope_pairs, runner, kept, options, device)
        runner = None
        # the shards: the source's other tensors, then each layer's as kept (a resumed run writes the same bytes)
        writer = ShardedWriter(stage, DTYPES[plan.dtype], SHARD_BYTES)
        for name in _other_tensor_names(source, family):
            writer.add(name, source.get_raw(name))  # as stored: cast only when --dtype differs
        for i in range(plan.layers):
            for name, tensor in _read_layer(kept / _layer_file(i))[0].items():
                writer.add(name, trained.get(name, tensor))
        writer.finalize()
        out_config = mla_config(config, plan, family, rope_pairs, plan.dtype)
        out_config.save_pretrained(stage)
        copied = source.copy_aux_files(stage)
        record = provenance.new(
            "convert",
            source={
                "model": source.origin,
                "revision": source.revision,
                "family": family.name,
                "model_type": config.model_type,
                "license": source.license(),
                "base_model": source.base_model() or (source.origin if not Path(source.origin).exists() else None),
            },
            method=describe_method(options),
            options=dataclasses.asdict(options),
            kv_cache=plan.kv_cache_record(),
            plan={"ranks": plan.kv_lora_rank, "rope_dims": plan.rope_dims, "nope_dims": plan.nope_dims,
                  "nope_kept": plan.nope_kept, "rope_pairs": rope_pairs, "refine": plan.refine_record,
                  "refine_model": plan.refine_model_record},
            seed=options.seed,
            copied_files=copied,
        )
        provenance.save(stage, record)
        write_model_card(stage)
    log.info("wrote %s", out)
    return plan


def _layer_file(i: int) -> str:
    return f"layer-{i:05d}.safetensors"


def _write_layer(path: Path, tensors: dict[str, torch.Tensor], rope_pairs: list[int], dtype: torch.dtype) -> None:
    """One converted layer's output tensors (as `dtype`, in writing order) and its RoPE pairs, renamed into place
    last."""
    from safetensors.torch import save_file

    tensors = {n: t.detach().to(dtype).contiguous().clone() for n, t in tensors.items()}  # clone: no shared storage
    meta = {"order": json.dumps(list(tensors)), "rope_pairs": json.dumps([int(p) for p in rope_pairs])}
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata=meta)
    seal_kept_file(tmp, path)


def _read_layer(path: Path, tensors: bool = True) -> tuple[dict[str, torch.Tensor], list[int]]:
    """(the layer's tensors in writing order, or {} without `tensors`; its RoPE pairs) from `_write_layer`'s file."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        out = {name: f.get_tensor(name) for name in json.loads(meta["order"])} if tensors else {}
    return out, json.loads(meta["rope_pairs"])


ACTIVATIONS_FILE = "activations.safetensors"


def _write_activations(folder: Path, layer: int, hidden: torch.Tensor) -> None:
    """The calibration hidden states after `layer` [N, T, D] (float32), replacing the previous layer's: a resumed run
    starts from them instead of running every finished layer again."""
    from safetensors.torch import save_file

    tmp = folder / (ACTIVATIONS_FILE + ".tmp")
    save_file({"hidden": hidden.contiguous()}, str(tmp), metadata={"after_layer": str(layer)})
    seal_kept_file(tmp, folder / ACTIVATIONS_FILE)


def _read_activations(folder: Path) -> tuple[int, torch.Tensor] | None:
    from safetensors import safe_open

    if not kept_file_intact(folder / ACTIVATIONS_FILE):
        return None
    with safe_open(str(folder / ACTIVATIONS_FILE), framework="pt") as f:
        return int(f.metadata()["after_layer"]), f.get_tensor("hidden")


def _fingerprint(source: Source, options: ConvertOptions, plan: Plan) -> dict:
    """Everything a converted layer depends on: a run resumes only the work of a run with the same fingerprint."""
    import transformers

    from mla_convert import __version__

    from mla_convert.calibration import parse_mixture

    calib = [Path(name).expanduser() for name, _ in parse_mixture(options.calib_data)] if options.calib_data else []
    return {
        "mla_convert": __version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),  # the thread count changes the order of float sums, so the bytes
        "source": source.origin,
        "source_files": [file_stamp(p) for p in source.files()],
        # the calibration tokens depend on the tokenizer, the calibration forward on transformers' decoder classes
        "tokenizer_files": [
            file_stamp(source.folder / n) for n in AUX_FILES if source.folder and (source.folder / n).is_file()
        ],
        "transformers": transformers.__version__,
        "calibration_files": [file_stamp(path) for path in calib if path.is_file()],
        "options": dataclasses.asdict(options),
        "plan": {"ranks": plan.kv_lora_rank, "rope_dims": plan.rope_dims, "dtype": plan.dtype},
    }


def output_bytes(config, plan: Plan) -> int:
    """Bytes of the converted checkpoint: every tensor the source keeps plus the new attention, in the output dtype."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    embeddings = config.vocab_size * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    mlp = 3 * hidden * config.intermediate_size + 2 * hidden  # gate, up, down; the two norms
    return (embeddings + hidden + layers * mlp + plan.attn_params_after) * plan.bytes_per_element


def check_room(out: Path, needed: int, copies: int = 2) -> None:
    """Refuse, before any work, an output whose file system cannot take it or whose folder cannot be written.

    Needs `copies` times the checkpoint's size: for a conversion twice, the finished layers kept for a resume sit
    beside the shards being written."""
    parent = Path(out).expanduser().resolve()
    while not parent.exists():
        parent = parent.parent
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"cannot write under {parent} (permission denied): choose an output folder you can write to")
    free = shutil.disk_usage(parent).free
    if free < copies * needed:
        def size(n: int) -> str:
            return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

        what = "the checkpoint and the layers kept for a resume" if copies == 2 else "the checkpoint"
        raise UserError(f"{parent} has {size(free)} free, the output needs about {size(copies * needed)} ({what}): "
                        "free space or choose another output folder")


def allocate(plan: Plan, spectra: list[torch.Tensor], cap: int) -> list[int]:
    """Share the plan's total latent dims among its layers by their spectra (`lowrank.allocate_ranks`): in units of 16
    or 8 where the uniform rank is a multiple of at least 4 of them (kernel-friendly shapes), else of 1, each layer
    keeping at least a quarter of the uniform rank and none above the smallest latent width vLLM's MLA kernels take
    that holds the uniform rank (256 or 512): the allocation never moves a model to a larger served cache layout, nor
    out of the engines' reach (they pad every layer to one width)."""
    from mla_convert.serving.layout import VLLM_LAYOUTS

    total = sum(plan.kv_lora_rank)
    uniform = total // plan.layers
    served = sorted(c for c in {c for layouts in VLLM_LAYOUTS.values() for c, _ in layouts} if c >= uniform)
    cap = min(cap, served[0]) if served else cap
    # below 4 dims a layer there is nothing to share in kernel-friendly units: single dims, at least one a layer
    unit = next((u for u in (16, 8, 1) if uniform % u == 0 and uniform >= 4 * u), 1)
    floor = max(unit, uniform // 4 // unit * unit)
    return lowrank.allocate_ranks(spectra, total, unit=unit, floor=floor, cap=cap // unit * unit)


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


def _attention_tensors(layer_tensors: dict, family: Family, layer: int, prefix: str, plan_qk_norm: str | None = None
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


def _source_layer(config, family: Family, i: int, layer_tensors: dict[str, torch.Tensor]):
    """Layer i of the source as a transformers decoder layer (float32 inference module) on `layer_tensors`."""
    cls = family.decoder_layer_class(config.model_type)
    return _module_from(lambda: cls(config, i), layer_tensors)


def _converted_layer(config, plan, family, rope_pairs, i, layer_tensors, mla_tensors):
    from mla_convert.modeling.modeling_mla import MLADecoderLayer

    cfg = mla_config(config, plan, family, rope_pairs, "float32")
    cfg._attn_implementation = "sdpa"
    tensors = {k: v for k, v in layer_tensors.items() if not k.startswith("self_attn.")}
    tensors.update({f"self_attn.{k}": v for k, v in mla_tensors.items()})
    return _module_from(lambda: MLADecoderLayer(cfg, i), tensors)


def _refined(config, plan, family, rope_pairs, i, layer_tensors, mla_tensors, targets, position_embeddings, options,
             device) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the layer's MLA attention tensors, its other tensors where they were trained and kept, else {}) after
    `refine.refine_module` on the calibration targets: of the attention, or of the whole layer
    (`--refine-scope layer`, its MLP and norms on copies: the source's tensors are not touched)."""
    whole = options.refine_scope == "layer"
    others = {n: t.to(device=device, dtype=torch.float32, copy=whole) for n, t in layer_tensors.items()}
    layer = _converted_layer(config, plan, family, rope_pairs, i, others, mla_tensors)
    if whole:
        module, forward = layer, refine.layer_update
        slow = tuple(p for n, p in layer.named_parameters() if not n.startswith("self_attn."))
    else:
        module, forward, slow = layer.self_attn, refine.attention_output, ()
    record = refine.refine_module(module, *targets, position_embeddings, options.refine_steps, options.refine_lr,
                                     seq_len=options.refine_seq_len, seed=options.seed + i, forward=forward,
                                     slow=slow, slow_lr=options.refine_lr * options.refine_mlp_lr_scale,
                                     precision=options.refine_precision)
    log.info("refine: layer %d held-out error %.4g -> %.4g (%s)", i, record["before"], record["after"],
             "kept" if record["kept"] else "not kept")
    plan.refine_record.append({"layer": i, **{k: round(v, 6) if isinstance(v, float) else v for k, v in record.items()}})
    trained = {n: t.detach().cpu() for n, t in layer.state_dict().items() if not n.startswith("self_attn.")}
    return ({k: v.detach() for k, v in layer.self_attn.state_dict().items()},
            trained if whole and record["kept"] else {})


def _other_tensor_names(source: Source, family: Family) -> list[str]:
    """The source's tensors outside its decoder layers (embeddings, final norm, head), which pass through as read."""
    layer_prefix = family.layer_prefix.split("{")[0]
    return [name for name in source.keys() if not name.startswith(layer_prefix) and "rotary_emb" not in name]


MODEL_STAGE_FILE = "model_stage.safetensors"  # in the resume folder: the trained attention tensors and the record


def _model_stage(source: Source, config, plan: Plan, family: Family, rope_pairs, runner, kept: Path,
                 options: ConvertOptions, device) -> dict[str, torch.Tensor]:
    """The model stage (`refine.refine_model`): the whole converted model, built in float32 from the source's other
    tensors and the kept layers, trained end to end to the source's next-token distributions on the calibration
    windows (the runner's hidden states are the source's after its last layer). Returns the trained attention
    tensors (none if the stage did not help), which replace the kept layers' when the shards are written; they and
    the record are kept in the resume folder first, so a run killed later does not train again."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mla_convert.modeling.modeling_mla import MLAForCausalLM

    done = kept / MODEL_STAGE_FILE
    if kept_file_intact(done):
        with safe_open(str(done), framework="pt") as f:
            plan.refine_model_record = json.loads(f.metadata()["record"])
            return {name: f.get_tensor(name) for name in f.keys()}
    clock = time.perf_counter()
    state = {name: source.get_raw(name).float() for name in _other_tensor_names(source, family)}
    for i in range(plan.layers):
        state.update({n: t.float() for n, t in _read_layer(kept / _layer_file(i))[0].items()})
    with torch.device(device):
        model = MLAForCausalLM(mla_config(config, plan, family, rope_pairs, "float32"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head is the embedding
        raise RuntimeError(f"model stage: the converted state does not fit the model ({missing[:3]}, {unexpected[:3]})")
    model.tie_weights()
    del state
    model.eval()
    with torch.no_grad():
        teacher = model.model.norm(runner.hidden)  # the source's final norm is the converted model's (not converted)
    record = refine.refine_model(model, runner.tokens.to(device), teacher, options.refine_model_steps,
                                 options.refine_model_lr, seq_len=options.refine_seq_len, seed=options.seed,
                                 scope=options.refine_model_scope, precision=options.refine_precision)
    del teacher
    record = {k: round(v, 6) if isinstance(v, float) else v for k, v in record.items()}
    record["curve"] = [[step, round(kl, 6)] for step, kl in record["curve"]]
    record["seconds"] = round(time.perf_counter() - clock, 1)
    record["scope"] = options.refine_model_scope
    log.info("refine model: held-out KL %.4g -> %.4g (%s)", record["before"], record["after"],
             f"kept after step {record['step']} of {options.refine_model_steps}" if record["kept"] else "not kept")
    names = set(refine.model_parameter_names(model, options.refine_model_scope)) if record["kept"] else set()
    trained = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if n in names}
    tmp = done.with_name(done.name + ".tmp")
    save_file(trained, str(tmp), metadata={"record": json.dumps(record)})
    seal_kept_file(tmp, done)
    plan.refine_model_record = record
    return trained


def _calibration_runner(source: Source, options: ConvertOptions):
    from mla_convert.calibration import LayerRunner, calibration_tokens

    tokens = calibration_tokens(source, options.calib_data, options.calib_samples, options.calib_seq_len, options.seed,
                                temperature=options.calib_temperature, sample_tokens=options.calib_sample_tokens,
                                device=resolve_device(options.device))
    embed = source.get_raw("model.embed_tokens.weight")  # rows are looked up, then made float32: no float32 table
    family = family_for(source.config)
    embed_scale = gemma_fields(source.config, None)["embed_scale"] if family.gemma(source.config) else None
    return LayerRunner(source.config, embed, tokens, embed_scale=embed_scale)
