"""A cache budget in bytes (`--kv-bytes`): the latent's width and the cache type it is stored in, chosen together.

A budget of B bytes per token (all layers; or a fraction <= 1 of the source's 16-bit cache) holds a wider latent in a
smaller cache type: in q8_0 (34 bytes a block of 32 values) 1.9x the f16 width, in q4_0 (18 bytes) 3.6x. Which is
best depends on how fast the conversion's quality grows with its width against what each cache type costs, both
measured (`policy.CONVERTED_16BIT`, `policy.LATENT_CACHE_COST`): each candidate type takes the widest row that fits
(a whole number of blocks, so that no padding is paid for), its quality is predicted from the frontier, and the best
prediction wins. The source's own quantized caches (`policy.SOURCE_CACHE_COST`) are compared at the same bytes: where
one fits the budget and is predicted better, the plan says so (converting is then not worth it for quality per byte).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from mla_convert import kvquant, policy
from mla_convert.errors import UserError

LATENT_TYPES = tuple(policy.LATENT_CACHE_COST)  # the types a conversion's latent is planned in
F16 = 2  # bytes per element the engines' 16-bit caches store


@dataclass(frozen=True)
class Candidate:
    """One cache type's widest row within the budget and its predicted quality."""

    cache_type: str
    elements: int  # d_c + d_r per token per layer
    rope_dims: int
    bytes: float  # per token, all layers
    kept: float  # elements over the source's
    predicted: float  # perplexity over the source's (the frontier's prediction)


@dataclass(frozen=True)
class Choice:
    """What `choose` decided for a budget: every candidate, the chosen one, and the source's own cache types that fit
    the budget, with their measured cost."""

    budget: float  # bytes per token, all layers
    source_bytes: int  # the source's 16-bit cache, bytes per token, all layers
    candidates: tuple[Candidate, ...]
    chosen: Candidate
    source_types: tuple[tuple[str, float, float], ...]  # (type, bytes per token, measured ratio), fitting the budget

    def describe(self) -> list[str]:
        """The lines `--dry-run` prints."""
        def row(c: Candidate) -> str:
            return (f"{c.cache_type} {c.elements} values a layer ({c.bytes:,.0f} B, {c.bytes / self.source_bytes:.3f})"
                    f" ~{c.predicted:.2f}x")

        lines = [f"cache budget {self.budget:,.0f} bytes per token ({self.budget / self.source_bytes:.3f} of the "
                 f"source's 16-bit {self.source_bytes:,}): the latent in {self.chosen.cache_type}, "
                 f"{self.chosen.elements} values a layer; predicted perplexity over the source's, from the frontier "
                 "measured on SmolLM2-135M (docs/decisions.md#a-cache-budget-in-bytes): "
                 + ", ".join(row(c) for c in self.candidates)]
        if not self.source_types:
            return lines + ["the source's own quantized caches do not fit this budget (the smallest, q4_0, takes "
                            f"{kvquant.row_bytes(self.source_bytes // F16, 'q4_0'):,.0f} B): only a conversion goes "
                            "here"]
        kind, size, ratio = min(self.source_types, key=lambda t: (t[2], t[1]))
        if ratio <= self.chosen.predicted:
            return lines + [f"note: converting is not worth it at this budget: the source's own {kind} cache fits "
                            f"({size:,.0f} B) at {ratio:.3f}x measured, no conversion (llama.cpp --cache-type-k "
                            f"{kind} --cache-type-v {kind}; check: mla-convert eval SOURCE --cache-type {kind})"]
        return lines + [f"the source's own {kind} cache also fits ({size:,.0f} B) at {ratio:.3f}x measured"]


def predicted_ratio(kept: float, cache_type: str) -> float:
    """The frontier's perplexity over the source's for a conversion keeping `kept` of the source's cache elements,
    its latent in `cache_type` (`policy.CONVERTED_16BIT`, log-log interpolated)."""
    points = policy.CONVERTED_16BIT
    if kept >= points[-1][0]:
        base = points[-1][1]
    else:
        i = max(0, next((j for j, (k, _) in enumerate(points) if k > kept), len(points)) - 1)
        i = min(i, len(points) - 2)
        (k0, r0), (k1, r1) = points[i], points[i + 1]
        slope = math.log(r1 / r0) / math.log(k1 / k0)
        base = r0 * (kept / k0) ** slope
    return base * policy.LATENT_CACHE_COST[cache_type]


def budget_bytes(kv_bytes: float, source_bytes: int) -> float:
    """--kv-bytes as bytes per token: a fraction <= 1 of the source's 16-bit cache, else bytes."""
    return kv_bytes * source_bytes if kv_bytes <= 1 else kv_bytes


def _widest(kind: str, budget: float, layers: int, kv_before: int, top: int, rope_dims) -> Candidate | None:
    """The widest row of `kind` within `budget` (whole blocks for a block type), smaller than the source's row and
    with a latent of at most `top` dims; None where none fits. `rope_dims(elements)` gives d_r."""
    step = kvquant.BLOCK if kvquant.cache_type(kind).levels else 2
    per_layer = budget / layers
    for elements in range(min(kv_before - 1, top + 64) // step * step, 0, -step):
        d_r = rope_dims(elements)
        if not 0 < elements - d_r <= top or kvquant.row_bytes(elements, kind) > per_layer:
            continue
        return Candidate(kind, elements, d_r, layers * kvquant.row_bytes(elements, kind), elements / kv_before,
                         predicted_ratio(elements / kv_before, kind))
    return None


def choose(options, layers: int, kv_before: int, top: int, rope_dims) -> Choice:
    """The width and cache type for `options.kv_bytes` (`options.cache_type` alone where the user named one)."""
    source_bytes = F16 * kv_before * layers
    budget = budget_bytes(options.kv_bytes, source_bytes)
    kinds = (options.cache_type,) if options.cache_type else LATENT_TYPES
    found = tuple(c for c in (_widest(k, budget, layers, kv_before, top, rope_dims) for k in kinds) if c is not None)
    if not found:
        smallest = min(layers * kvquant.row_bytes(kvquant.BLOCK if kvquant.cache_type(k).levels else 4, k)
                       for k in kinds)
        raise UserError(f"--kv-bytes {options.kv_bytes:g} ({budget:,.0f} bytes per token) holds no latent row in "
                        f"{'/'.join(kinds)}: the smallest takes {smallest:,.0f}; raise --kv-bytes")
    source_types = tuple((k, layers * kvquant.row_bytes(kv_before, k), r) for k, r in policy.SOURCE_CACHE_COST.items()
                         if layers * kvquant.row_bytes(kv_before, k) <= budget)
    chosen = min(found, key=lambda c: (c.predicted, c.bytes))
    return Choice(budget, source_bytes, found, chosen, source_types)


def resolve(options, layers: int, kv_before: int, top: int, rope_dims) -> tuple[object, Choice | None]:
    """The options with --kv-bytes resolved into --kv-budget (elements) and --cache-type, and the choice (None
    without --kv-bytes). `rope_dims(options)` is the plan's default d_r for those options."""
    if options.kv_bytes is None:
        return options, None

    def d_r(elements: int) -> int:
        return rope_dims(dataclasses.replace(options, kv_bytes=None, kv_budget=float(elements)))

    choice = choose(options, layers, kv_before, top, d_r)
    return dataclasses.replace(options, kv_bytes=None, kv_budget=float(choice.chosen.elements),
                               cache_type=choice.chosen.cache_type), choice
