"""What a conversion's target can hold, resolved and checked before any work (`--target deepseek`, and the export
that `--format deepseek|gguf` asks for after the conversion).

The conversion owns these rules because it must apply them before it reads a calibration window: DeepSeek-V3 (and
llama.cpp's deepseek2) hold one geometric RoPE frequency set for all layers (`mla_convert.rope_fit`, the room below
both conversion/ and export/), no attention or MLP biases in the served classes, no float16 latent norm, no per-head
q/k norms, no sliding windows or score caps. export/ applies its own checks to a finished checkpoint and imports
nothing of conversion/.
"""

from __future__ import annotations

import dataclasses

import torch

from mla_convert import rope as rope_lib
from mla_convert.conversion.plan import default_rope_dims
from mla_convert.errors import UserError
from mla_convert.rope_fit import fit_deepseek_rope


def check_source(family, config, target: str, qk_norm: str) -> list[str]:
    """What the source's family cannot carry to `target` (engine limits, per-head q/k norms): refused with a
    UserError; returns the notes a native conversion gets (printed to stderr)."""
    if target not in ("native", "deepseek"):
        raise UserError(f"--target must be native or deepseek, got {target}")
    limits = family.engine_limits(config)
    if limits and target == "deepseek":
        raise UserError(f"this model has {' and '.join(limits)}, which DeepSeek-V3's MLA (and "
                        "llama.cpp's) cannot hold: convert with --target native and run it in transformers (eval, "
                        "generate)")
    if not family.has_qk_norm(config) or (target != "deepseek" and qk_norm != "exact"):
        return []
    if target == "deepseek":
        raise UserError("this model normalizes each query and key head (q_norm/k_norm), which DeepSeek-V3's MLA "
                        "cannot hold (per-token query and key scales): convert with --target native (transformers; "
                        "--qk-norm calibrated for absorbed decode and vLLM through mla-convert's plugin)")
    return ["note: --qk-norm exact keeps the per-token key norm: expanded attention at every step in transformers; "
            "vLLM and the DeepSeek-V3 export refuse it (--qk-norm calibrated: absorbed decode, served by vLLM through "
            "the plugin, measured error)"]


def target_options(config, family, options, target: str, format: str, explicit=frozenset()):
    """The options resolved for `target` (deepseek: `deepseek_convert_options`) and the notes saying what was chosen;
    a source the export `format` cannot hold (attention biases) is refused before any work."""
    if target != "deepseek":
        return options, []
    options, notes = deepseek_convert_options(config, options, explicit)
    biases = any(family.attention_biases(config))
    if format == "gguf" and biases:
        raise UserError("this model has attention biases, which llama.cpp's deepseek2 attention has no place for: "
                        "serve the native checkpoint through the vLLM plugin or transformers (docs/serving.md)")
    if format == "deepseek" and biases:
        raise UserError("this model has attention biases, which vLLM's and SGLang's DeepSeek classes drop "
                        "silently: serve the native checkpoint through the vLLM plugin instead (convert without "
                        "--format deepseek; docs/serving.md), or convert with --target deepseek and run "
                        "`mla-convert export --keep-biases` (transformers only) or `--drop-biases --allow-approx`")
    return options, notes


def check_plan(plan, format: str) -> None:
    """What the export `format` cannot hold of the plan, refused before any work."""
    if format == "deepseek" and plan.dtype == "float16":
        raise UserError("the DeepSeek-V3 export cannot hold float16 (its identity latent norm needs bfloat16's "
                        "range): pass --dtype bfloat16 or --dtype float32")


# data-free choices that keep one geometric frequency set for all layers, in the order --target deepseek tries them:
# the fastest pairs first (docs/decisions.md#the-deepseek-v3-targets-rope-pairs)
TARGET_STRATEGIES = ("high", "uniform")


def deepseek_convert_options(config, options, explicit: frozenset[str] | set[str] = frozenset()):
    """Resolve conversion options so that the converted model exports exactly to DeepSeek-V3 (`--target deepseek`).

    Cheap: reads the source config only (run it before calibration). `options` is a ConvertOptions; `explicit` names
    the fields the user set (e.g. {"rope_strategy", "rope_dims"}): an explicit choice the format cannot hold is
    refused with a UserError naming the fix, a default is replaced by an exportable one. Exportable means: one kv
    component per frequency (merged across kv heads, or a single kv head), at most head_dim rope dims, and a data-free
    pair choice ("high", else "uniform") whose frequencies, after the source's RoPE scaling, form a geometric set
    starting at the fastest pair. Returns (resolved options, notes saying what was chosen).
    """
    if getattr(config, "mlp_bias", False):
        raise UserError("the MLP has biases, which DeepSeek-V3's dense MLP cannot hold: convert with --target native")
    heads = config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    d_r = options.rope_dims
    # half the budget as a power of two, at most 64 (docs/decisions.md#the-deepseek-v3-targets-rope-pairs)
    if d_r is None:
        d_r = default_rope_dims(options, groups, head_dim, budget_share=0.5, head_share=1.0)
        d_r = 1 << (d_r.bit_length() - 1)
    if d_r <= 0 or d_r % 2:
        raise UserError(f"--target deepseek needs an even, positive --rope-dims (a rope key), got {d_r}")
    if d_r > head_dim:
        raise UserError(f"--rope-dims {d_r} is above head_dim {head_dim}: several rope pairs would share a frequency, "
                        f"which DeepSeek-V3 cannot hold; pass --rope-dims {head_dim} or less (or --target native)")
    if not options.rope_merge and groups > 1:
        raise UserError(f"--no-rope-merge keeps a rope pair per kv head ({groups}) on every kept frequency; DeepSeek-V3 "
                        "has one: drop --no-rope-merge (or use --target native)")
    if "rope_strategy" in explicit:
        if options.rope_strategy not in TARGET_STRATEGIES:
            raise UserError(f"--rope-strategy {options.rope_strategy} picks pairs that DeepSeek-V3 cannot hold (one "
                            "geometric frequency set for all layers): pass --rope-strategy uniform or high, or use "
                            "--target native")
        candidates = [options.rope_strategy]
    else:
        candidates = list(TARGET_STRATEGIES)
    inv_freq, _ = rope_lib.source_frequencies(config)
    eye = torch.eye(groups, dtype=torch.float64).expand(head_dim // 2, groups, groups)
    # a default width halves until the fastest pairs fit (RoPE scaling such as llama3 bends the slow ones)
    widths = [d_r] if "rope_dims" in explicit else [d_r >> k for k in range(d_r.bit_length() - 1)]
    tries = [(s, w) for s in candidates for w in (widths if s == "high" else [d_r])]
    problems = []
    for strategy, width in tries:
        # The pairs the converter keeps with this data-free strategy (identity key statistics stand in for data).
        plan = rope_lib.plan_rope(width, strategy, options.rope_merge, heads, groups, head_dim,
                                  q_energy=torch.ones(heads, head_dim // 2, dtype=torch.float64), k_cov=eye)
        pairs = plan.frequencies
        fit = fit_deepseek_rope(inv_freq, [pairs])
        if fit.exact:
            # DeepSeek-V3 has one kv_lora_rank: per-layer ranks would export padded to the largest, a larger cache
            allocation = options.rank_allocation or "uniform"
            resolved = dataclasses.replace(options, rope_dims=width, rope_strategy=strategy, rank_allocation=allocation)
            notes = [f"--target deepseek: --rope-strategy {strategy} --rope-dims {width}"
                     f"{' --rope-merge' if options.rope_merge else ''} keeps frequency pairs {pairs}, exported with "
                     f"rope_theta {fit.base:.6g}"]
            if width < d_r:
                notes.append(f"--rope-dims {width}, not the default {d_r}: the source's RoPE scaling bends the "
                             "slower pairs, which one geometric frequency set cannot hold")
            if allocation == "energy":
                notes.append("--rank-allocation energy: DeepSeek-V3 has one kv_lora_rank, so the export pads every "
                             "layer's latent to the largest (a larger cache than the native checkpoint's)")
            return resolved, notes
        if width == d_r:
            problems.append(f"--rope-strategy {strategy} keeps pairs {pairs}: {fit.problems[0]}")
    if "rope_strategy" in explicit and options.rope_strategy == "uniform":
        fix = "pass --rope-strategy high, or a --rope-dims whose pair count divides head_dim/2"
    else:
        fix = "no data-free pair choice fits: use --target native (and `mla-convert export --allow-approx`)"
    raise UserError(f"not exportable to DeepSeek-V3: {'; '.join(problems)}; {fix}")
