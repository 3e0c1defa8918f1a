"""Defaults that depend on how much of the source's KV cache a conversion keeps (`Plan.ratio`): one threshold and
one (narrow, wide) pair per default, below and from `WIDE_FROM`. Imported without torch, so that the CLI's help texts
say the same rule the conversion applies (`rule_text`).

Why these values: docs/decisions.md#calibration-windows, docs/decisions.md#self-text-temperature-length-and-batch,
docs/decisions.md#refinement-steps-rate-and-window, docs/decisions.md#refinement-at-wide-budgets,
docs/decisions.md#refinement-on-a-cpu-positions-and-steps and docs/decisions.md#the-model-stage-on-a-cpu."""

from __future__ import annotations

WIDE_FROM = 0.375  # halfway between the two budgets the defaults were chosen at (25% and 50%)
CALIB_SAMPLES = (16, 32)  # --calib-samples: a wider latent and its refinement fit more from more text
CALIB_TEMPERATURE = (1.2, 1.0)  # --calib-temperature of `self` text: varied text for a small latent
REFINE_STEPS = (200, 300)  # --refine-steps auto (per layer) on a GPU: a wider latent has more to fit
REFINE_STEPS_CPU = (200, 600)  # ... on a CPU, where a step at the wide budget takes its loss at fewer positions
REFINE_QUERIES_CPU = (256, 256)  # --refine-queries auto on a CPU (0: every position; a GPU takes every position)
MODEL_STEPS_CPU = (32, 1)  # --refine-model-steps auto on a CPU (a GPU takes conversion.model_stage.MODEL_STEPS)


def by_cache_kept(kept: float, pair: tuple):
    """The narrow value of `pair` for a conversion that keeps less than WIDE_FROM of the source's cache, else the
    wide one."""
    return pair[0] if kept < WIDE_FROM else pair[1]


def rule_text(pair: tuple) -> str:
    """The rule of `by_cache_kept` in words, for help texts (the value alone where both are the same)."""
    if pair[0] == pair[1]:
        return f"{pair[0]} at every budget"
    return f"{pair[0]} where the MLA cache is under {WIDE_FROM:.1%} of the source's, else {pair[1]}"


# --kv-bytes (mla_convert.conversion.cachebudget): the measured frontier the plan chooses a latent width and cache type
# on, perplexity over the source's (geometric mean over the development domains, the embedded default; what each
# point is: docs/decisions.md#a-cache-budget-in-bytes). A 16-bit conversion by the share of the source's cache
# elements it keeps (log-log interpolated; below the first point extrapolated along the first segment):
CONVERTED_16BIT = ((0.25, 2.191), (0.417, 1.385), (0.5, 1.162), (0.667, 1.080), (1.0, 1.0))
# its latent and rope key stored in a block cache type (balanced basis), as a factor on that (q5_1, q5_0, q4_1, iq4_nl
# measured on the 66.7% conversion, q4_0 on the 25% and 41.7% ones):
LATENT_CACHE_COST = {"f16": 1.0, "q8_0": 1.001, "q5_1": 1.021, "q5_0": 1.034, "q4_1": 1.100, "q4_0": 1.158,
                     "iq4_nl": 1.104}
# the source's own cache in llama.cpp's cache types (no conversion at all; iq4_nl measured in llama.cpp itself):
SOURCE_CACHE_COST = {"q8_0": 1.000, "q5_1": 1.010, "q5_0": 1.011, "q4_1": 1.038, "q4_0": 1.047, "iq4_nl": 1.044}
