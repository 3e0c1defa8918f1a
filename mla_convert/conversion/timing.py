"""What a conversion will take on this machine's CPU, phase by phase, as the plan prints it (`--dry-run`): the self
text still to sample, the calibration stream's forwards (statistics and advancing the stream past each layer), the
per-layer refinement and the model stage (those two: `mla_convert.refine`).

Every phase is a flop count at a rate fitted on whole conversions on 2 CPU cores (the rates and the runs they come
from: docs/decisions.md#time-estimate-and-when-auto-refines-on-a-cpu), scaled by this CPU's speed relative to that machine
(`refine.cpu_speed`). On a GPU the phases take minutes; the estimate is what the CPU would take.
"""

from __future__ import annotations

from mla_convert import refine

# The calibration stream's work for one layer, in forwards of the source layer over all calibration windows at
# refine.CPU_FLOPS: its statistics (second moments, attention statistics, float64 where they accumulate) and one
# advance of the stream past it (the layer's forward, the hidden states kept for a resumed run).
STATISTICS_FORWARDS = 1.75
ADVANCE_FORWARDS = 1.8
# Sampling the self text (batches of `selftext.BATCH` answers with transformers' `generate`): the effective rate in
# flop/s of 2 x parameters a sampled token (decoding is bound by reading the weights and by the loop's per-step
# overhead, not by arithmetic), in float32 and, where the CPU has bfloat16 arithmetic (`selftext.sampling_dtype`), in
# bfloat16.
SAMPLE_FLOPS = 3.0e10
SAMPLE_BF16_FLOPS = 6.8e10


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
    return plan.layers * forwards * layer_forward_flops(plan) / refine.cpu_rate("float32")


def sample_seconds(parameters: int, tokens: int, bf16: bool = False) -> float:
    """Sampling `tokens` of self text from a source of `parameters` parameters (in bfloat16 with `bf16`)."""
    return tokens * 2 * parameters / ((SAMPLE_BF16_FLOPS if bf16 else SAMPLE_FLOPS) * refine.cpu_speed())


def total_seconds(plan) -> float:
    """Every phase the plan estimates."""
    return plan.sample_seconds + plan.calibration_seconds + plan.refine_seconds + plan.refine_model_seconds
