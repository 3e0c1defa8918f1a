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
# Sampling the self text (`mla_convert.sampler`: `width` sequences a step, each in its own slot of a preallocated
# cache): a sampled token costs 2 x the parameters its step reads (every layer and the head) at SAMPLE_FLOPS (in
# bfloat16, where the CPU has its arithmetic and `selftext.sampling_dtype` samples in it: SAMPLE_BF16_FLOPS), the
# softmax and cumulative sum over the vocabulary (SAMPLE_VOCAB_S a token and vocabulary entry), and its share of the
# step's fixed cost (the Python of each layer's call: SAMPLE_LAYER_S a layer, SAMPLE_STEP_S a step). SAMPLE_FLOPS and
# SAMPLE_VOCAB_S fitted on the embedded default and a 3-layer, 192-wide model sampled on busy cores (1 thread, load
# 11-14 on 2 cores: benchmarks/convert/README.md#the-self-texts-sampler); bfloat16 at the ratio measured for the
# previous sampler (6.8 / 3.0), not yet measured for this one.
SAMPLE_FLOPS = 4.4e10
SAMPLE_BF16_FLOPS = 1.0e11
SAMPLE_VOCAB_S = 3.7e-9
SAMPLE_LAYER_S = 4e-4
SAMPLE_STEP_S = 3e-3

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


def sampled_parameters(config) -> int:
    """The parameters a sampled token's step reads: every layer's attention and gated MLP, and the head."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    attention = (2 * heads + 2 * groups) * head_dim * hidden
    mlp = 3 * hidden * (getattr(config, "intermediate_size", None) or 4 * hidden)
    return layers * (attention + mlp) + config.vocab_size * hidden


def sample_seconds(config, tokens: int, width: int, bf16: bool = False) -> float:
    """Sampling `tokens` of self text from a source of `config`, `width` sequences a step (in bfloat16 with
    `bf16`)."""
    per_token = (2 * sampled_parameters(config) / (SAMPLE_BF16_FLOPS if bf16 else SAMPLE_FLOPS) + config.vocab_size * SAMPLE_VOCAB_S
                 + (config.num_hidden_layers * SAMPLE_LAYER_S + SAMPLE_STEP_S) / max(1, width))
    return tokens * per_token / refine.cpu_speed()

def total_seconds(plan) -> float:
    """Every phase the plan estimates."""
    return plan.sample_seconds + plan.calibration_seconds + plan.refine_seconds + plan.refine_model_seconds
