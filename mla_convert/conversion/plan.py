"""The plan of a conversion: the checks of the options against the source config and the geometry they make
(`make_geometry`: shapes, cache sizes, what the estimates read; nothing heavy, nothing written), the whole `Plan`
(the geometry and the stages as they will run, made once by `conversion.pipeline.make_plan`) with its memory estimate
and `--dry-run` text, and the rank allocation among layers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from mla_convert import lowrank, policy
from mla_convert.outputs import SHARD_BYTES
from mla_convert.sources import Source
from mla_convert.conversion import cachebudget, estimates, model_stage, refine_layer
from mla_convert.conversion.options import QK_NORM_TEXT, ConvertOptions, needs_statistics
from mla_convert.schema import check_options
from mla_convert.dtypes import DTYPES
from mla_convert.errors import UserError
from mla_convert.families import Family


# Memory estimate (Plan.memory_parts): the runtime's own resident set (Python, torch, transformers, a tokenizer) at
# the first layer of a conversion; and the factor over the modelled parts for what they leave out (the allocator's
# free-but-held pages, short-lived copies inside torch ops): docs/decisions.md#memory-estimate.
BASELINE = int(0.6 * 2**30)
MEMORY_SAFETY = 1.15
# The energy allocation's statistics pass keeps every layer's output hidden states of the source stream for the
# conversion pass (which then need not run each source layer again) where they add up to at most this and to at most
# a quarter of the machine's memory: a small model's (SmolLM2-135M's 16 windows: 2.3 GB, 32 windows: 4.5 GB), not a
# large one's.
KEEP_HIDDEN_BYTES = 6 << 30


@dataclass
class Geometry:
    """What a conversion makes, before its stages are planned: every shape, the cache sizes and what the memory and
    time estimates read (`make_geometry`; the stages' estimates take it as their plan)."""

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
    memory: dict = field(default_factory=dict)  # what the estimates need beyond the shapes (see make_geometry)
    refine_scope: str = refine_layer.DEFAULT_SCOPE  # what the layer refinement trains (its step's cost)
    latent_cache_type: str | None = None  # --cache-type (or --kv-bytes' choice): the type the latent is served in
    cache_choice: cachebudget.Choice | None = None  # --kv-bytes: the candidates and the choice

    def set_kv_lora_rank(self, kv_lora_rank: list[int]) -> None:
        """Per-layer latent dims (after a rank allocation): the shapes shown are the first layer's."""
        self.kv_lora_rank = list(kv_lora_rank)
        self.shapes, self.attn_params_after = attention_shapes(
            self.kv_lora_rank, self.hidden, self.heads, self.groups, self.head_dim, self.rope_dims, self.nope_dims,
            self.qk_norm, self.qk_norm_scope, self.qkv_bias)

    @property
    def kv_before(self) -> int:
        """Cached elements per token per layer in the source (K and V of every kv head)."""
        return 2 * self.groups * self.head_dim

    def kv_after(self, layer: int | None = None) -> float:
        ranks = self.kv_lora_rank if layer is None else [self.kv_lora_rank[layer]]
        return sum(r + self.rope_dims for r in ranks) / len(ranks)

    @property
    def bytes_per_element(self) -> int:
        return element_size(self.dtype)

    @property
    def kv_bytes_before(self) -> int:
        return self.kv_before * self.layers * self.bytes_per_element

    @property
    def kv_bytes_after(self) -> int:
        return sum(r + self.rope_dims for r in self.kv_lora_rank) * self.bytes_per_element

    @property
    def ratio(self) -> float:
        return cache_share(self.kv_lora_rank, self.rope_dims, self.kv_before)

    def kv_cache_record(self) -> dict:
        return {
            "elements_per_token_per_layer_before": self.kv_before,
            "elements_per_token_per_layer_after": self.kv_after(),
            "bytes_per_token_before": self.kv_bytes_before,
            "bytes_per_token_after": self.kv_bytes_after,
            "ratio": round(self.ratio, 6),
            "dtype": self.dtype,
            **({"cache_type": self.latent_cache_type, "bytes_per_token_in_cache_type": self.cache_type_bytes(),
                "latent_basis": self.latent_basis()} if self.latent_cache_type else {}),
            **({"budget_bytes": self.cache_choice.budget, "predicted_ratio": self.cache_choice.chosen.predicted}
               if self.cache_choice else {}),
        }

    def latent_basis(self) -> str:
        """The basis the conversion stores the latent in (`mla_convert.latent_basis`): for a block cache type
        "balanced" (fitted on the calibration text) or, without calibration text, "rotation"; else (and for per-head
        q/k norms, which it is not built for) "native"."""
        from mla_convert import kvquant

        if not self.latent_cache_type or not kvquant.cache_type(self.latent_cache_type).levels or self.qk_norm:
            return "native"
        return "balanced" if self.memory.get("calibrated") else "rotation"

    def cache_type_bytes(self) -> float:
        """Bytes per token (all layers) of the cached rows in `latent_cache_type` (whole blocks)."""
        from mla_convert import kvquant

        return sum(kvquant.latent_row_bytes(r, self.rope_dims, self.latent_cache_type) for r in self.kv_lora_rank)


@dataclass
class Plan(Geometry):
    """The whole plan of a conversion (`conversion.pipeline.make_plan`, made once): its geometry and each stage as it
    will run (steps, window, precision, workers, the self text's temperature, the model stage's rate) with the time
    estimates on this machine. The energy rank allocation later changes the ranks (`set_kv_lora_rank`)."""

    refine_steps: int = 0  # per layer, as resolved (conversion.estimates); with the CPU time estimate for them
    refine_queries: int = 0  # positions of a window a step takes its loss at (0: all)
    refine_workers: int = 1  # processes refining layers at once (mla_convert.conversion.workers)
    refine_seconds: float = 0.0
    refine_precision: str = "float32"  # what the refinement steps compute in, as resolved
    refine_seq_len: int = refine_layer.SEQ_LEN  # tokens per refinement window (at most a calibration window)
    refine_model_steps: int = 0  # the model stage, as resolved; with its CPU time estimate
    refine_model_seconds: float = 0.0
    refine_model_scope: str = model_stage.MODEL_SCOPE
    refine_model_lr: float | None = None  # the model stage's rate, as resolved
    calib_temperature: float | None = None  # the self text's sampling temperature, as resolved
    calibration_seconds: float = 0.0  # the calibration stream's forwards on this CPU (conversion.timing)
    sample_seconds: float = 0.0  # the self text still to sample there

    def memory_parts(self) -> dict[str, int]:
        """Peak resident bytes by what holds them, at the heaviest moment of each phase (`memory_estimate`).

        Resident the whole run: the Python/torch/transformers runtime with the tokenizer (`BASELINE`), the calibration
        hidden states (input, output and normed copy, float32; --rank-allocation energy keeps each layer's spectrum from
        its statistics pass, and where they fit KEEP_HIDDEN_BYTES every layer's output hidden states for the
        conversion pass). Embeddings, lm_head
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
        if m.get("kept_hidden"):
            parts["hidden states kept from the statistics pass"] = m["kept_hidden"]
        if self.refine_steps and self.refine_workers > 1 and m["calibrated"]:  # each: its runtime and layer's targets
            parts["refinement workers"] = self.refine_workers * (BASELINE + tokens * hidden * 4)
        writing = m["shard_bytes"] + (attn + mlp) * out + BASELINE
        if writing > sum(parts.values()):  # the writer's phase is the heavier one: it is what the estimate shows
            parts = {"runtime": BASELINE, "shard writer buffer": m["shard_bytes"], "one kept layer": (attn + mlp) * out}
        if self.refine_model_steps:  # the model stage holds the whole converted model (estimates.model_stage_bytes)
            stage = {"runtime": BASELINE, "calibration hidden states": 2 * tokens * hidden * 4,
                     "model stage": estimates.model_stage_bytes(self, seq, self.refine_model_scope)}
            if sum(stage.values()) > sum(parts.values()):
                parts = stage
        return parts

    def memory_estimate(self) -> int:
        """Peak resident bytes: `memory_parts` x MEMORY_SAFETY (see there)."""
        return int(sum(self.memory_parts().values()) * MEMORY_SAFETY)

    def describe(self, target: str = "native") -> str:
        """The plan as `--dry-run` prints it; `target` deepseek: the serving line is the DeepSeek-V3 export's."""
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
            self.describe_cache_types(),
            *(self.cache_choice.describe() if self.cache_choice else []),
            *([f"served with its latent in {self.latent_cache_type}: {self.cache_type_bytes():,.0f} bytes per token "
               f"({self.cache_type_bytes() / (2 * self.kv_before * self.layers):.3f} of the source's 16-bit)"
               + (f"; the latent stored in the {self.latent_basis()} basis (exact)" if self.latent_basis() != "native"
                  else "")]
              if self.latent_cache_type else []),
            f"attention parameters: {self.attn_params_before:,} -> {self.attn_params_after:,}",
            self.describe_export_serving() if target == "deepseek" else self.describe_serving(),
            *([f"per-head q/k norms: {QK_NORM_TEXT[self.qk_norm]}"] if self.qk_norm else []),
            (f"calibration: {self.memory['samples']} windows x {self.memory['seq_len']} tokens" if self.calib_tokens
             else "calibration: none (weight-only statistics)"),
            f"refinement: {self.refine_steps} steps per layer"
            + (f" (loss at {self.refine_queries} positions a window)" if self.refine_steps and self.refine_queries
               else "")
            + (f", {self.refine_workers} layers at once" if self.refine_steps and self.refine_workers > 1 else "")
            + f"; model stage: {self.refine_model_steps} step{'' if self.refine_model_steps == 1 else 's'}"
            + (f"; training steps in {self.refine_precision}" if self.refine_steps or self.refine_model_steps else ""),
            self.describe_time(),
            f"source size {self.source_bytes / 2**20:.0f} MiB; estimated peak memory {self.memory_estimate() / 2**30:.2f} GiB"
            f" (x{MEMORY_SAFETY} of: " + ", ".join(f"{k} {v / 2**30:.2f}" for k, v in self.memory_parts().items() if v)
            + ")",
        ]
        return "\n".join(lines)

    def describe_cache_types(self, kinds: tuple[str, ...] = ("f16", "q8_0", "q4_0")) -> str:
        """Bytes per token in the engines' cache types (ggml's blocks; a row padded to whole blocks), this
        conversion's against the source's own cache quantized instead (no conversion: llama.cpp --cache-type-k, where
        q8_0 costs next to nothing and q4_0 a few percent; benchmarks/frontier/README.md)."""
        from mla_convert import kvquant

        full = self.kv_before * self.layers * 2  # the source's 16-bit cache

        def share(b: float) -> str:
            return f"{b:,.0f} ({b / full:.3f})"

        ours = {k: sum(kvquant.latent_row_bytes(r, self.rope_dims, k) for r in self.kv_lora_rank) for k in kinds}
        source = {k: self.layers * kvquant.row_bytes(self.kv_before, k) for k in kinds[1:]}
        line = ("KV cache bytes per token in llama.cpp's cache types (fraction of the source's 16-bit): this conversion "
                + ", ".join(f"{k} {share(b)}" for k, b in ours.items()) + "; the source's own cache quantized, no "
                "conversion: " + ", ".join(f"{k} {share(b)}" for k, b in source.items()))
        smallest = min(source, key=source.get)
        if self.latent_cache_type:  # its bytes and the source's alternatives: the lines after this one
            return line
        if ours["f16"] >= source[smallest]:
            return line + (f"\nnote: the source's own {smallest} cache is this small without converting; compare "
                           f"(mla-convert eval SOURCE --cache-type {smallest}) before serving the conversion")
        return line + (f"\nnote: below the source's smallest quantized cache ({smallest}); the conversion's own q8_0 "
                       "cache halves its bytes again at next to no cost (benchmarks/frontier/README.md)")

    def describe_serving(self) -> str:
        """Where the planned shape serves in vLLM (the plugin): the cache row and the MLA kernels vLLM's selection
        code picks on a Hopper GPU (docs/serving.md, "vLLM's CUDA build") and on a CPU."""
        from mla_convert.errors import UserError
        from mla_convert.serving.layout import PREFILL_HEADS, VLLM_LAYOUTS, served_layout

        heads = (self.nope_dims, self.head_dim)
        try:
            gpu = served_layout(self.kv_lora_rank, self.rope_dims, VLLM_LAYOUTS["cuda"], heads, PREFILL_HEADS["cuda"])
            cpu = served_layout(self.kv_lora_rank, self.rope_dims, VLLM_LAYOUTS["cpu"])
        except UserError as e:
            return f"serving in vLLM: no ({e})"
        decode = ("FlashAttention MLA" if gpu.elements_per_token_per_layer == 576
                  else "FlashMLA (unproven on this row) or Triton MLA")
        padded = f" padded to {gpu.nope_dims}/{gpu.value_dims}" if (gpu.nope_dims, gpu.value_dims) != heads else ""
        return (f"serving in vLLM (plugin): on a Hopper GPU a {gpu.kv_lora_rank}+{gpu.rope_dims} cache row, decode by "
                f"{decode}, prefill by FlashAttention with nope/value heads {heads[0]}/{heads[1]}{padded}; on a CPU "
                f"{cpu.kv_lora_rank}+{cpu.rope_dims} (CPU_MLA, or AMX_MLA where it runs)")

    def describe_export_serving(self) -> str:
        """Where the DeepSeek-V3 export of the planned shape serves (docs/serving.md's routes): as written in
        transformers and llama.cpp (`--format gguf`), and in vLLM's own DeepSeek class once `mla-convert export
        --pad-latent` pads it (exactly) to a cache row vLLM's kernels take."""
        from mla_convert.errors import UserError
        from mla_convert.serving.layout import VLLM_LAYOUTS, served_layout

        row = f"{max(self.kv_lora_rank)}+{self.rope_dims}"
        text = (f"serving (DeepSeek-V3 export, no mla-convert needed): transformers' DeepseekV3ForCausalLM with the "
                f"{row} row as written; llama.cpp from --format gguf")
        try:
            gpu = served_layout(self.kv_lora_rank, self.rope_dims, VLLM_LAYOUTS["cuda"])
            cpu = served_layout(self.kv_lora_rank, self.rope_dims, VLLM_LAYOUTS["cpu"])
        except UserError as e:
            return f"{text}; vLLM: no ({e})"
        return (f"{text}; vLLM's DeepseekV3ForCausalLM after `mla-convert export --pad-latent vllm` on a GPU "
                f"({gpu.kv_lora_rank}+{gpu.rope_dims} row), `--pad-latent flashmla` on a CPU ({cpu.kv_lora_rank}+"
                f"{cpu.rope_dims})")

    def describe_time(self) -> str:
        """The time estimate's line: the total on this CPU (at `estimates.cpu_speed`: its threads, or the speed a user
        set) and its phases."""
        phases = {"self text": self.sample_seconds, "calibration": self.calibration_seconds,
                  "refinement": self.refine_seconds, "model stage": self.refine_model_seconds}
        minutes = ", ".join(f"{k} {v / 60:.0f}" for k, v in phases.items() if v)
        return f"time on this CPU ({estimates.cpu_speed_source()}): about {estimates.total_seconds(self) / 60:.0f} min" + (
            f" ({minutes} min)" if minutes else "")


def _dims(config) -> tuple[int, int, int, int, int]:
    heads = config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, config.hidden_size, heads, groups, head_dim


def kept_hidden_bytes(options: ConvertOptions, every_layer: int) -> int:
    """What the statistics pass keeps of the source stream's hidden states for the conversion pass: all of them
    (`every_layer` bytes, float32) where the energy allocation runs that pass on the source's stream and they fit
    KEEP_HIDDEN_BYTES and a quarter of the machine's memory, else none (0)."""
    keeps = options.rank_allocation == "energy" and options.calib_propagate == "source"
    machine = estimates.machine_bytes()
    fits = every_layer <= KEEP_HIDDEN_BYTES and (machine is None or every_layer <= machine / 4)
    return every_layer if keeps and fits else 0


def max_rank(config) -> int:
    _, hidden, _, groups, head_dim = _dims(config)
    return min(2 * groups * head_dim, hidden)


def default_rope_dims(options: ConvertOptions, groups: int, head_dim: int, budget_share: float = 1 / 3,
                      head_share: float = 0.75) -> int:
    """d_r when --rope-dims is not given: `budget_share` of the cache budget, at most `head_share` of head_dim and at
    most 64 (the rope key width of vLLM's MLA kernels, `SERVED_ROPE_MAX`: a wider key cannot be served there);
    head_dim/2 (same cap) with --rank. The native model: a third of the budget, three quarters of head_dim at most;
    --target deepseek, whose rope key holds one pair per frequency: half of the budget, up to all of head_dim.

    The RoPE pairs lose more than the rank until the latent gets small, so the rope key takes a large share, but not
    the whole head: chosen on the development split, docs/decisions.md#rope-key-width."""
    from mla_convert.serving.layout import SERVED_ROPE_MAX

    step = 2 if options.rope_merge else 2 * groups  # without merging every kv head keeps the same number of pairs
    cap = min(head_dim, max(step, SERVED_ROPE_MAX // step * step))
    if options.kv_budget is None:
        return min(head_dim // 2, cap)
    cap = min(cap, max(step, int(head_share * head_dim) // step * step))
    budget = options.kv_budget * 2 * groups * head_dim if options.kv_budget <= 1 else options.kv_budget
    return int(min(cap, max(step, step * round(budget * budget_share / step))))


# Calibration windows by the share of the source's cache a conversion keeps (`--calib-samples`, default): a wider
# latent and its refinement fit more from the same text when it has more of it; chosen on the development split,
# docs/decisions.md#calibration-windows.
CALIB_SAMPLES, WIDE_CALIB_SAMPLES = policy.CALIB_SAMPLES


def default_calib_samples(kept: float) -> int:
    """The calibration windows of a conversion that keeps `kept` (a fraction) of the source's KV cache
    (`policy.CALIB_SAMPLES`)."""
    return policy.by_cache_kept(kept, policy.CALIB_SAMPLES)


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


def _nope_dims(options: ConvertOptions, head_dim: int, d_r: int, qk_norm: str | None) -> int:
    """--nope-dims checked against the source's head_dim, or its default (`default_nope_dims`)."""
    if options.nope_dims is None:
        return default_nope_dims(options, head_dim, d_r, qk_norm)
    d_n = options.nope_dims
    if not 0 < d_n <= head_dim:
        raise UserError(f"--nope-dims must be between 1 and head_dim ({head_dim}), got {d_n}")
    if qk_norm and d_n != head_dim:
        raise UserError(f"--nope-dims {d_n}: this model normalizes each query and key head, whose nope key must "
                        f"keep head_dim ({head_dim}) dims: drop --nope-dims")
    return d_n


def _rope_dims_and_rank(options: ConvertOptions, config) -> tuple[int, int]:
    """d_r and the uniform d_c, checked against the source config."""
    _, _, _, groups, head_dim = _dims(config)
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
        budget = options.kv_budget * 2 * groups * head_dim if options.kv_budget <= 1 else options.kv_budget
        rank = int(round(budget)) - d_r
    else:
        rank = options.rank
    if rank <= 0:
        raise UserError(f"the latent rank must be positive (got {rank}); raise --rank/--kv-budget or lower --rope-dims")
    if rank > top:
        raise UserError(f"--rank {rank} exceeds the maximum {top} (min of 2 x kv heads x head_dim and hidden size)")
    return d_r, rank


def attention_shapes(ranks: list[int], hidden: int, heads: int, groups: int, head_dim: int, d_r: int, d_n: int,
                     qk_norm: str | None, qk_norm_scope: str, qkv_bias: bool) -> tuple[dict, int]:
    """The converted attention's tensor shapes (the first layer's) and its parameters over all layers."""
    after, first = 0, {}
    q_rows = heads * head_dim if qk_norm else heads * (d_n + d_r)  # with q/k norms: the source's query
    for layer, rank in enumerate(ranks):
        shapes = {
            "q_proj": (q_rows, hidden),
            "kv_a_proj": (rank + d_r, hidden),
            "kv_b_proj": (groups * (d_n + head_dim), rank),
            "o_proj": (hidden, heads * head_dim),
        }
        if qk_norm:
            shapes["q_head_proj"] = (heads * (d_n + d_r), head_dim)
        after += sum(math.prod(s) for s in shapes.values())
        after += qkv_bias * (q_rows + rank + d_r + groups * (d_n + head_dim))
        whole = qk_norm_scope == "projection"
        if qk_norm == "exact":  # k_norm, and the rope key's maps R and K
            after += head_dim * (groups if whole else 1) + 2 * groups * head_dim * d_r
        after += head_dim * (heads if whole else 1) if qk_norm else 0  # q_norm
        if layer == 0:
            first = shapes
    return first, after


def cache_share(ranks: list[int], d_r: int, kv_before: int) -> float:
    """The MLA cache over the source's: (d_c + d_r) summed over layers, over the source's K and V elements."""
    return sum(r + d_r for r in ranks) / (kv_before * len(ranks))


def element_size(dtype: str) -> int:
    return torch.empty(0, dtype=DTYPES[dtype]).element_size()


def make_geometry(source: Source, family: Family, options: ConvertOptions) -> Geometry:
    """Validate the options (`schema.check_options`, then against the source config) and compute what the conversion
    makes: every shape, the cache sizes and what the estimates read (nothing heavy, nothing written). The stages are
    planned from it (`conversion.pipeline.make_plan`)."""
    config = source.config
    layers, hidden, heads, groups, head_dim = _dims(config)
    check_options(options)  # each option on its own, and the rules between options (mla_convert.schema)
    # --kv-bytes: the width and cache type chosen on the measured frontier, then planned as --kv-budget --cache-type
    options, choice = cachebudget.resolve(options, layers, 2 * groups * head_dim, max_rank(config), lambda o: (
        default_rope_dims(o, groups, head_dim) if o.rope_dims is None else o.rope_dims))
    d_r, rank = _rope_dims_and_rank(options, config)
    _check_blocks(options.cache_type, rank, d_r)
    qk_norm = options.qk_norm if family.has_qk_norm(config) else None
    if qk_norm == "calibrated" and options.calib_data is None:
        raise UserError("--qk-norm calibrated takes each key's RMS from calibration text: pass --calib-data "
                        "(or use --qk-norm exact)")
    d_n = _nope_dims(options, head_dim, d_r, qk_norm)
    dtype = options.dtype or _source_dtype(config)
    qkv_bias, _ = family.attention_biases(config)
    ranks = [rank] * layers
    scope = family.qk_norm_scope(config) or "head"
    shapes, after = attention_shapes(ranks, hidden, heads, groups, head_dim, d_r, d_n, qk_norm, scope, bool(qkv_bias))
    kept = cache_share(ranks, d_r, 2 * groups * head_dim)
    source_bytes = source.nbytes()
    before = ((2 * heads + 2 * groups) * head_dim * hidden + (heads + 2 * groups) * head_dim * qkv_bias) * layers
    intermediate = getattr(config, "intermediate_size", 4 * hidden)
    calibrated = bool(options.calib_data) and needs_statistics(options)
    samples = options.calib_samples or default_calib_samples(kept)  # by the cache kept
    calib_tokens = samples * options.calib_seq_len if calibrated else 0
    memory = {
        "intermediate": intermediate,
        "vocab": config.vocab_size,
        "source_element": _source_element(source, family),
        "calibrated": calibrated,
        "attended": bool(options.calib_data) and options.value_inputs == "attended",
        "seq_len": options.calib_seq_len,
        # the writer holds at most a shard
        "shard_bytes": min(SHARD_BYTES, _output_bytes(config, after, element_size(dtype))),
        # what decoding a token reads: every layer and the head (the self text's sampling cost)
        "parameters": before + layers * 3 * hidden * intermediate + config.vocab_size * hidden,
        "samples": samples,
    }
    if calibrated:
        memory["kept_hidden"] = kept_hidden_bytes(options, layers * calib_tokens * hidden * 4)
    if kept >= 1 and not options.force:
        raise UserError(
            f"the MLA cache ({rank + d_r:g} per token per layer) is not smaller than the source's "
            f"({2 * groups * head_dim}): lower --rank/--rope-dims, or pass --force to convert anyway"
        )
    return Geometry(family=family.name, model_type=config.model_type, layers=layers, hidden=hidden, heads=heads,
                    groups=groups, head_dim=head_dim, kv_lora_rank=ranks, rope_dims=d_r, nope_dims=d_n, dtype=dtype,
                    source_bytes=source_bytes, calib_tokens=calib_tokens, attn_params_before=before,
                    attn_params_after=after, shapes=shapes, qkv_bias=bool(qkv_bias), qk_norm=qk_norm,
                    qk_norm_scope=scope, norm_unit_offset=family.gemma(config),
                    norm_eps=float(getattr(config, "rms_norm_eps", 1e-6)), memory=memory,
                    refine_scope=options.refine_scope, latent_cache_type=options.cache_type, cache_choice=choice)


def _check_blocks(cache_type: str | None, rank: int, d_r: int) -> None:
    """A block cache type stores rows of whole blocks: the latent and rope key together a multiple of 32 (padding
    would cost bytes the budget does not count)."""
    from mla_convert import kvquant

    if cache_type and kvquant.latent_padding(rank, d_r, cache_type):
        fit = max(kvquant.BLOCK, (rank + d_r) // kvquant.BLOCK * kvquant.BLOCK) - d_r
        raise UserError(f"--cache-type {cache_type} stores each row in whole blocks of {kvquant.BLOCK} values, and "
                        f"d_c {rank} + d_r {d_r} is not: use --rank {fit} (or a --kv-budget of a multiple of "
                        f"{kvquant.BLOCK}), or give --kv-bytes and let the plan choose")


def _source_element(source: Source, family: Family) -> int:
    """Bytes per element of the source's tensors as stored (its first layer's query weight; 4 if it has none)."""
    name = family.tensor(0, "q")
    return source.element_size(name) if source.has(name) else 4


def _source_dtype(config) -> str:
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    name = str(dtype).replace("torch.", "") if dtype is not None else "float32"
    return name if name in DTYPES else "float32"



def output_bytes(config, plan: Geometry) -> int:
    """Bytes of the converted checkpoint: every tensor the source keeps plus the new attention, in the output dtype."""
    return _output_bytes(config, plan.attn_params_after, plan.bytes_per_element)


def _output_bytes(config, attn_params_after: int, element: int) -> int:
    hidden, layers = config.hidden_size, config.num_hidden_layers
    embeddings = config.vocab_size * hidden * (1 if getattr(config, "tie_word_embeddings", False) else 2)
    mlp = 3 * hidden * config.intermediate_size + 2 * hidden  # gate, up, down; the two norms
    return (embeddings + hidden + layers * mlp + attn_params_after) * element


ROOM_COPIES = 2  # a conversion needs its checkpoint's size twice: the layers kept for a resume beside the shards


def allocate(plan: Plan, spectra: list[torch.Tensor], cap: int) -> list[int]:
    """Share the plan's total latent dims among its layers by their spectra (`lowrank.allocate_ranks`): in units of 16
    or 8 where the uniform rank is a multiple of at least 4 of them (kernel-friendly shapes), else of 1, each layer
    keeping at least a quarter of the uniform rank and none above the smallest latent width vLLM's MLA kernels take
    that holds the uniform rank (256 or 512): the allocation never moves a model to a larger served cache layout, nor
    out of the engines' reach (they pad every layer to one width)."""
    from mla_convert import kvquant
    from mla_convert.serving.layout import VLLM_LAYOUTS

    total = sum(plan.kv_lora_rank)
    uniform = total // plan.layers
    served = sorted(c for c in {c for layouts in VLLM_LAYOUTS.values() for c, _ in layouts} if c >= uniform)
    cap = min(cap, served[0]) if served else cap
    kind = getattr(plan, "latent_cache_type", None)  # a Plan has it; a stand-in with ranks alone need not
    if kind and kvquant.cache_type(kind).levels:
        # every layer's row whole blocks (a block cache type): units of a block, each rank as the uniform one is
        # modulo a block (so d_c + d_r stays a multiple of it), the floor about a quarter of the uniform rank
        block = kvquant.BLOCK
        floor = uniform % block + max(0, (uniform // 4 - uniform % block) // block) * block or block
        return lowrank.allocate_ranks(spectra, total, unit=block, floor=floor, cap=cap)
    # below 4 dims a layer there is nothing to share in kernel-friendly units: single dims, at least one a layer
    unit = next((u for u in (16, 8, 1) if uniform % u == 0 and uniform >= 4 * u), 1)
    floor = max(unit, uniform // 4 // unit * unit)
    return lowrank.allocate_ranks(spectra, total, unit=unit, floor=floor, cap=cap // unit * unit)
