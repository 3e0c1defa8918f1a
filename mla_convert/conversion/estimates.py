"""What a conversion will take on this machine's CPU, and what `auto` chooses from that: the rates the CPU
sustains (`cpu_rate`, scaled by `cpu_speed`), each phase's time as the plan prints it (`--dry-run`: the self text still
to sample, the calibration stream's forwards (statistics and advancing the stream past each layer), the per-layer
refinement and the model stage), the model stage's memory, and the refinement stages' steps, positions a step and
model-stage rate where the options leave them to `auto`.

Every phase is a flop count at a rate fitted on whole conversions on 2 CPU cores (the rates and the runs they come
from: docs/decisions.md#time-estimate-and-when-auto-refines-on-a-cpu), scaled by this CPU's speed relative to that machine
(`cpu_speed`). On a GPU the phases take minutes; the estimate is what the CPU would take.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from mla_convert import policy
from mla_convert.conversion.model_stage import (LOGIT_CHUNK, MODEL_CHECKS, MODEL_LR, MODEL_POSITIONS, MODEL_SCOPE,
                                                MODEL_STEPS, SHORT_MODEL_LR)
from mla_convert.conversion.refine_layer import BATCH, SEQ_LEN, batch_for
from mla_convert.errors import UserError

log = logging.getLogger(__name__)

# The refinement's steps per layer by the cache kept (a GPU's, and every position's): mla_convert.policy; chosen on the
# development split: docs/decisions.md#refinement-steps-rate-and-window.
DEFAULT_STEPS, WIDE_STEPS = policy.REFINE_STEPS
# `--refine-steps auto` refines on a GPU, and on the CPU when the estimate below is at most AUTO_CPU_SECONDS: the
# embedded model at both budgets, not an 8B model (hours). CPU_FLOPS: what 2 CPU cores without bfloat16 arithmetic
# sustain in the refinement's float32 steps (the steps `auto` runs there); CPU_BF16_FLOPS: what 2 cores with AMX
# sustain in its bfloat16 steps, CPU_AVX512_BF16_FLOPS what 2 cores with AVX512-BF16 but no AMX sustain in them;
# CPU_BF16_MODEL_FLOPS: what 2 cores with AMX sustain in the model stage's bfloat16 steps, whose whole-model matrix
# products (the head's above all) AMX speeds more than the layer step's attention; SUBSET_RATE: the share of the rate
# a step at chosen positions (`--refine-queries`) sustains. Measured on whole conversions
# (docs/decisions.md#time-estimate-and-when-auto-refines-on-a-cpu).
CPU_FLOPS = 1.5e11
CPU_BF16_FLOPS = 4.1e11
CPU_BF16_MODEL_FLOPS = 4.6e11
CPU_AVX512_BF16_FLOPS = 2.1e11
SUBSET_RATE = 0.5
# Those rates are the 2-core reference machine's; another CPU's are scaled by its speed relative to it (`cpu_speed`):
# its thread count over REFERENCE_THREADS, or $MLA_CONVERT_CPU_SPEED where set
# (docs/decisions.md#time-estimate-and-when-auto-refines-on-a-cpu).
REFERENCE_THREADS = 2
CPU_SPEED_ENV = "MLA_CONVERT_CPU_SPEED"
AUTO_CPU_SECONDS = 5400


def cpu_rate(precision: str, model_stage: bool = False) -> float:
    """The flop/s the estimates assume on this machine's CPU for steps computed in `precision` (float32 |
    bfloat16: AMX tiles where the CPU has them, else its AVX512-BF16 instructions; on a CPU with neither, bfloat16 is
    emulated, not measured, and estimated at the float32 rate), the model stage's steps with `model_stage`, scaled by
    its `cpu_speed`."""
    if precision != "bfloat16":
        rate = CPU_FLOPS
    elif torch.cpu._is_amx_tile_supported():
        rate = CPU_BF16_MODEL_FLOPS if model_stage else CPU_BF16_FLOPS
    else:
        rate = CPU_AVX512_BF16_FLOPS if torch.cpu._is_avx512_bf16_supported() else CPU_FLOPS
    return rate * cpu_speed()


def cpu_speed() -> float:
    """This CPU's speed relative to the 2-core machine the estimates' rates were fitted on: $MLA_CONVERT_CPU_SPEED
    where set (a positive number), else torch's thread count over REFERENCE_THREADS (each core as fast as the
    reference's)."""
    text = _speed_setting()
    if not text:
        return torch.get_num_threads() / REFERENCE_THREADS
    try:
        speed = float(text)
    except ValueError:
        speed = math.nan
    if not (math.isfinite(speed) and speed > 0):
        raise UserError(f"{CPU_SPEED_ENV}={text!r}: set it to a positive number (this CPU's speed relative to the "
                        "2-core machine the time estimates assume, 2 for twice as fast), or unset it")
    return speed


def cpu_speed_source() -> str:
    """Where `cpu_speed` comes from, for the plan's time line: the user's setting, or the thread count."""
    text, threads = _speed_setting(), torch.get_num_threads()
    return f"{CPU_SPEED_ENV}={text}" if text else f"{threads} thread{'s' * (threads != 1)}"


def _speed_setting() -> str:
    """$MLA_CONVERT_CPU_SPEED as the user set it ("" where unset)."""
    return os.environ.get(CPU_SPEED_ENV, "").strip()


def step_flops(plan, seq_len: int = SEQ_LEN, batch: int = BATCH, whole: bool | None = None,
               queries: int | None = None) -> float:
    """Forward + backward flops of one refinement step of one layer: the projections (2 x tokens x parameters, the
    MLP's too where the whole layer runs: `whole`, by default where it trains) and the score and value products over
    causal windows, both x3 for the backward pass. With `queries` (fewer than `seq_len`: `layer_update_at`) only the
    key side (kv_a and kv_b) runs at every position; the rest, and the scores (each chosen query against the whole
    window, masked), at the chosen positions."""
    params = plan.attn_params_after / plan.layers
    if plan.refine_scope == "layer" if whole is None else whole:  # a gated MLP: three hidden x intermediate maps
        params += 3 * plan.hidden * plan.memory.get("intermediate", 4 * plan.hidden)
    width = plan.nope_dims + plan.rope_dims + plan.head_dim  # q.k and p.v per score
    if not queries or queries >= seq_len:
        return 3 * (2 * batch * seq_len * params + 2 * batch * plan.heads * seq_len**2 * width)
    ranks = plan.kv_lora_rank
    keys = sum((r + plan.rope_dims) * plan.hidden + plan.groups * (plan.nope_dims + plan.head_dim) * r
               for r in ranks) / len(ranks)
    linear = 2 * batch * (seq_len * keys + queries * (params - keys))
    return 3 * (linear + 2 * batch * plan.heads * queries * seq_len * width)


def resolve_queries(requested: int | None, seq_len: int, kept: float = 1.0, device: str = "cpu") -> int:
    """Positions of a window a step takes its loss at (`refine_module`'s `queries`): `requested`, or (None, auto)
    `policy.REFINE_QUERIES_CPU` by the cache `kept` on a CPU and every position on a GPU; 0 (every position) where
    that is the whole window anyway."""
    if requested is None:
        requested = policy.by_cache_kept(kept, policy.REFINE_QUERIES_CPU) if device.startswith("cpu") else 0
    return requested if requested < seq_len else 0


def estimate_seconds(plan, steps: int, seq_len: int = SEQ_LEN, rate: float = CPU_FLOPS,
                     queries: int | None = None) -> float:
    """`steps` per layer at `rate` flop/s over windows of `seq_len` tokens (the refinement window, as trained), at
    `queries` positions of each (`step_flops`, at SUBSET_RATE of `rate`)."""
    if queries and queries < seq_len:
        rate *= SUBSET_RATE
    return steps * plan.layers * step_flops(plan, seq_len, batch_for(seq_len), queries=queries) / rate


def default_steps(kept: float, device: str = "cuda", queries: int = 0) -> int:
    """The auto refinement steps per layer of a conversion that keeps `kept` (a fraction) of the source's KV cache:
    `policy.REFINE_STEPS_CPU` on a CPU whose steps take `queries` positions of a window (the trade that pair was
    measured for), else `policy.REFINE_STEPS` (a GPU's, and every position's)."""
    subset = device.startswith("cpu") and queries > 0
    return policy.by_cache_kept(kept, policy.REFINE_STEPS_CPU if subset else policy.REFINE_STEPS)


def resolve_steps(requested: int | None, plan, device: str, seq_len: int, rate: float = CPU_FLOPS,
                  queries: int = 0) -> int:
    """The refinement steps per layer: `requested`, or (None, auto) `default_steps` of the cache kept on a GPU or
    where the CPU estimate (steps at `queries` positions) is at most AUTO_CPU_SECONDS, else 0 (with a warning that
    says what refining would cost)."""
    if requested is not None:
        return requested
    steps = default_steps(plan.ratio, device, queries)
    if not device.startswith("cpu"):
        return steps
    seconds = estimate_seconds(plan, steps, seq_len, rate, queries)
    if seconds <= AUTO_CPU_SECONDS:
        return steps
    log.warning("not refining the converted layers: on this CPU it would take about %.1f h (estimate); pass "
                "--refine-steps %d to refine anyway, or convert with --device cuda", seconds / 3600, steps)
    return 0


AUTO_MODEL_CPU_SECONDS = 1800  # `--refine-model-steps auto` on the CPU: at most this estimate (see resolve_model_steps)


def model_step_flops(plan, seq_len: int = SEQ_LEN, positions: int | None = None) -> float:
    """Forward + backward flops of one model-stage step: every layer (attention and MLP) on one window of `seq_len`
    tokens and the head at `positions` of them (default MODEL_POSITIONS; 0: all): the student's logits and their
    gradient (the teacher's side is formed once, `teacher_terms`)."""
    positions = MODEL_POSITIONS if positions is None else positions
    at = positions if 0 < positions < seq_len else seq_len
    return plan.layers * step_flops(plan, seq_len, 1, whole=True) + 2 * _head_flops(plan, at)


def _head_flops(plan, positions: int) -> float:
    """Flops of the head's logits at `positions`."""
    return 2 * positions * plan.hidden * plan.memory.get("vocab", 0)


def estimate_model_seconds(plan, steps: int, seq_len: int = SEQ_LEN, rate: float = CPU_FLOPS) -> float:
    """The model stage's `steps` at `rate` flop/s, with its held-out passes (a forward at every position, about a
    third of such a step: one before training and about MODEL_CHECKS during it, one a step where the stage is
    shorter) and the teacher's terms of the windows it reads (`teacher_terms`: its logits and their expected head
    row, float32; the held-out window and at most one more a step); 0 without steps."""
    if not steps:
        return 0.0
    checks = (min(steps, MODEL_CHECKS) + 1) / 3 * model_step_flops(plan, seq_len, 0)
    windows = min(plan.memory.get("samples", 0), steps + 1)  # the held-out window and those the steps draw
    terms = windows * 2 * _head_flops(plan, seq_len) / cpu_rate("float32")
    return (steps * model_step_flops(plan, seq_len) + checks) / rate + terms


def resolve_model_steps(requested: int | None, plan, device: str, seq_len: int, rate: float = CPU_FLOPS) -> int:
    """The model stage's steps: `requested`, or (None, auto) MODEL_STEPS on a GPU; on a CPU `policy.MODEL_STEPS_CPU`
    by the cache kept where their estimate is at most AUTO_MODEL_CPU_SECONDS and the model stage's memory
    (`model_stage_bytes`) at most half the machine's, else 0 (with a warning that says why; none where the CPU's
    default is 0 steps)."""
    if requested is not None:
        return requested
    if not device.startswith("cpu"):
        return MODEL_STEPS
    steps = policy.by_cache_kept(plan.ratio, policy.MODEL_STEPS_CPU)
    if not steps:
        return 0
    seconds = estimate_model_seconds(plan, steps, seq_len, rate)
    needed, total = model_stage_bytes(plan, seq_len), machine_bytes()
    if seconds <= AUTO_MODEL_CPU_SECONDS and (total is None or needed <= total / 2):
        return steps
    log.warning("no model stage: on this CPU it would take about %.1f h and %.1f GiB (estimates); pass "
                "--refine-model-steps %d to run it anyway, or convert with --device cuda", seconds / 3600,
                needed / 2**30, steps)
    return 0


def resolve_model_lr(requested: float | None, steps: int) -> float:
    """The model stage's rate: `requested`, or (None, auto) MODEL_LR for a stage of MODEL_STEPS or more steps and
    SHORT_MODEL_LR for a shorter one."""
    if requested is not None:
        return requested
    return MODEL_LR if steps >= MODEL_STEPS else SHORT_MODEL_LR


def model_stage_bytes(plan, seq_len: int = SEQ_LEN, scope: str = MODEL_SCOPE) -> int:
    """Resident bytes of the model stage beyond the calibration hidden states: the whole converted model in float32,
    the trained tensors' gradients, Adam moments and best copy (`scope`: the attention's or the whole layers', 4 more
    copies), the saved activations of one window (about 16 hidden and 4 intermediate floats a token per layer, with
    the attention's score rows for one head at a time) and the logits of LOGIT_CHUNK positions (the student's, its
    distribution and gradient; the teacher's side is `teacher_terms`, the size of its hidden states)."""
    inter, vocab = plan.memory.get("intermediate", 4 * plan.hidden), plan.memory.get("vocab", 0)
    layers = plan.attn_params_after + plan.layers * (3 * plan.hidden * inter + 2 * plan.hidden)
    trained = layers if scope == "layer" else plan.attn_params_after
    acts = plan.layers * seq_len * (16 * plan.hidden + 4 * inter) * 4 + seq_len * seq_len * 4 * 2
    return 4 * (layers + vocab * plan.hidden) + 16 * trained + acts + 5 * min(LOGIT_CHUNK, seq_len) * vocab * 4


def machine_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


# The calibration stream's work for one layer, in forwards of the source layer over all calibration windows at
# CPU_FLOPS: its statistics (second moments, attention statistics, float64 where they accumulate) and one
# advance of the stream past it (the layer's forward, the hidden states kept for a resumed run).
STATISTICS_FORWARDS = 1.75
ADVANCE_FORWARDS = 1.8
# Sampling the self text (`mla_convert.sampler`: `width` sequences a step, each in its own slot of a preallocated
# cache): a sampled token costs 2 x the parameters its step reads (every layer and the head) at SAMPLE_FLOPS (in
# bfloat16, where the CPU has its arithmetic and `selftext.sampling_dtype` samples in it: SAMPLE_BF16_FLOPS), the
# softmax and cumulative sum over the vocabulary (SAMPLE_VOCAB_S a token and vocabulary entry), the cached keys and
# values its attention reads (SAMPLE_CACHE_BYTES_S), and its share of the step's fixed cost (the Python of each
# layer's call: SAMPLE_LAYER_S a layer, SAMPLE_STEP_S a step). Fitted and checked by benchmarks/convert/selftext.py
# (benchmarks/convert/README.md#the-self-texts-sampler).
SAMPLE_FLOPS = 4.4e10
SAMPLE_BF16_FLOPS = 1.26e11
SAMPLE_VOCAB_S = 1.6e-9
SAMPLE_CACHE_BYTES_S = 1.05e10
SAMPLE_LAYER_S = 4e-4
SAMPLE_STEP_S = 3e-3
# The positions a step's attention reads, over a sequence's length: chat slots are refilled at different times, so
# the furthest is past the buffer's middle and the whole buffer is read (`sampler._forward`); documents run in step,
# reading their own positions for the first half and the whole buffer after (1/4 and 1 of it: 5/8 on average).
DOCUMENT_SPAN = 5 / 8


def layer_forward_flops(plan) -> float:
    """Flops of one source layer's forward over all the calibration windows: the projections (2 x tokens x the
    attention's and the gated MLP's parameters) and the score and value products over causal windows."""
    windows, seq_len = plan.memory.get("samples", 0), plan.memory.get("seq_len", 0)
    tokens = windows * seq_len
    params = plan.attn_params_before / plan.layers + 3 * plan.hidden * plan.memory.get("intermediate", 4 * plan.hidden)
    scores = 2 * windows * plan.heads * seq_len**2 * plan.head_dim  # q.k and p.v, half of each score row causal
    return 2 * tokens * params + scores


def calibration_seconds(plan, statistics_pass: bool) -> float:
    """The calibration stream's forwards of a conversion: each layer's statistics once (the statistics pass keeps
    them for the conversion pass, `pipeline.KEEP_STATISTICS_BYTES`) and one advance past it per pass (two with the
    energy allocation's `statistics_pass`, unless it keeps the hidden states for the conversion pass:
    `plan.KEEP_HIDDEN_BYTES`)."""
    if not plan.calib_tokens:
        return 0.0
    passes = 2 if statistics_pass and not plan.memory.get("kept_hidden") else 1
    forwards = STATISTICS_FORWARDS + passes * ADVANCE_FORWARDS
    return plan.layers * forwards * layer_forward_flops(plan) / cpu_rate("float32")


def sampled_parameters(config) -> int:
    """The parameters a sampled token's step reads: every layer's attention and gated MLP, and the head."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads, head_dim, groups = _heads(config)
    attention = (2 * heads + 2 * groups) * head_dim * hidden
    mlp = 3 * hidden * (getattr(config, "intermediate_size", None) or 4 * hidden)
    return layers * (attention + mlp) + config.vocab_size * hidden


def sample_seconds(config, tokens: int, width: int, bf16: bool = False, length: int = 0,
                   document: bool = False, prompt: float = 0.0, shared: float = 0.0) -> float:
    """Sampling `tokens` of self text from a source of `config`, `width` sequences a step (in bfloat16 with `bf16`),
    sequences of `length` positions (documents with `document`: `DOCUMENT_SPAN`) after prompts of `prompt` tokens on
    average whose first `shared` are every prompt's: those take no step (`mla_convert.sampler` copies their keys and
    values from a prompt read before)."""
    sampled = tokens * (1 - shared / (length + prompt) if length and shared else 1.0)
    per_token = (2 * sampled_parameters(config) / (SAMPLE_BF16_FLOPS if bf16 else SAMPLE_FLOPS)
                 + config.vocab_size * SAMPLE_VOCAB_S
                 + cache_bytes(config, bf16) * length * (DOCUMENT_SPAN if document else 1) / SAMPLE_CACHE_BYTES_S
                 + (config.num_hidden_layers * SAMPLE_LAYER_S + SAMPLE_STEP_S) / max(1, width))
    return sampled * per_token / cpu_speed()


def cache_bytes(config, bf16: bool) -> int:
    """Bytes of the keys and values the source caches a position, all layers (in bfloat16 with `bf16`)."""
    _, head_dim, groups = _heads(config)
    return config.num_hidden_layers * groups * 2 * head_dim * (2 if bf16 else 4)


def _heads(config) -> tuple[int, int, int]:
    """(query heads, head dim, kv heads) of a source config."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, head_dim, getattr(config, "num_key_value_heads", None) or heads


def total_seconds(plan) -> float:
    """Every phase the plan estimates."""
    return plan.sample_seconds + plan.calibration_seconds + plan.refine_seconds + plan.refine_model_seconds
