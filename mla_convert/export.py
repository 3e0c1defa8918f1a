"""Export a native MLA checkpoint to the stock DeepSeek-V3 format (transformers `DeepseekV3ForCausalLM`, vLLM, SGLang).

Native layer (see mla_convert/modeling) -> DeepSeek-V3 layer, one tensor at a time:

    q_proj [H*(d_n+d_r), D]      -> q_proj [H*(d_n+d_r'), D]: softmax scale folded in, rope rows interleaved and
                                    reordered onto one geometric frequency set; or, when the query has a bias,
                                    q_a_proj (+bias) -> q_a_layernorm (identity) -> q_b_proj
    kv_a_proj [d_c+d_r, D]       -> kv_a_proj_with_mqa [d_c'+d_r', D]: latent rows times a tiny power of two `a`
                                    (so that kv_a_layernorm, which the format always applies, is linear), rope rows
                                    interleaved and reordered like the query's
    (none)                       -> kv_a_layernorm.weight = sqrt(eps)/a: the norm is the identity up to a bounded
                                    relative error (see `identity_norm_scale`)
    kv_b_proj [G*(d_n+d_v), d_c] -> kv_b_proj [H*(d_n+d_v), d_c']: kv groups repeated per query head
    o_proj [D, H*d_v]            -> o_proj, with the value bias (and the latent bias's value part) folded into its bias

Facts of the stock format this relies on are proven by tests/test_export.py against the installed transformers:
`kv_a_layernorm` and `q_a_layernorm` are built with eps 1e-6 whatever `rms_norm_eps` says (vLLM and SGLang use
`rms_norm_eps`), so the export sets `rms_norm_eps` = 1e-6 and rescales the residual stream by
sqrt(1e-6 / source eps), which makes every decoder RMSNorm compute exactly what the source's did;
`num_key_value_heads` must equal the number of heads; `n_routed_experts` must be an int (dense-only models set
`first_k_dense_replace = num_hidden_layers`); with `rope_interleave` the rope dims pair as (2m, 2m+1) with frequency
`rope_theta^(-2m/d_r)`; the attention scale is `(d_n + d_r)^-0.5` (no yarn mscale with the default rope type).

What the format cannot express is either re-expressed exactly, approximated only with `allow_approx` (and then always
measured), or refused with the conversion options that produce an exportable model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mla_convert.errors import UserError

log = logging.getLogger(__name__)

FORMATS = ("deepseek",)
# transformers builds kv_a_layernorm/q_a_layernorm as DeepseekV3RMSNorm(dim) with its default eps 1e-6; vLLM and
# SGLang pass config.rms_norm_eps. Exporting with rms_norm_eps = 1e-6 makes the three agree.
EXPORT_EPS = 1e-6
# Relative error allowed on the latent (and on the query under the q_lora path) by the identity-norm trick. Below
# float32's resolution of 6e-8 per element after rounding the scale down to a power of two.
NORM_TOLERANCE = 1e-7
VLLM_MLA_HEAD_SIZES = (320, 576)  # kv_lora_rank + qk_rope_head_dim accepted by vLLM's MLA backends
FLASHMLA_LAYOUT = (512, 64)  # (kv_lora_rank, qk_rope_head_dim) of FlashMLA
PAD_CHOICES = ("none", "vllm", "flashmla")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")
FREQ_TOLERANCE = 1e-5  # relative: two inverse frequencies this close are the same frequency (float32 rounding)


@dataclass
class ExportOptions:
    """Resolved export options (recorded in provenance.json)."""

    format: str = "deepseek"
    dtype: str = "auto"  # auto: the native checkpoint's dtype (float16 is refused, see _out_dtype)
    allow_approx: bool = False  # accept measured approximations (RoPE frequencies, dropped biases)
    drop_biases: bool = False  # drop biases the engines ignore (vLLM/SGLang load no attention bias); needs allow_approx
    keep_biases: bool = False  # keep them although only transformers applies them (vLLM/SGLang skip them silently)
    pad_latent: str = "none"  # none | vllm (kv_lora_rank + d_r in 320/576) | flashmla (512 + 64); exact, larger cache
    verify: bool = True
    verify_tokens: int = 64
    verify_batch: int = 2
    verify_new_tokens: int = 8
    seed: int = 0


# ---------------------------------------------------------------------------------------------------- RoPE


@dataclass
class RopeFit:
    """How the native per-layer rope pairs map onto DeepSeek's one geometric frequency set.

    `order[layer][m]` is the native pair index (in 0..d_r/2) with the m-th fastest frequency; it rotates with
    `base^(-2m/d_r)` in the export. (With rope padding, see `_place_rope_rows`, it sits at DeepSeek pair m*stride of
    `d_r*stride` dims, which has the same frequency.)
    """

    base: float
    order: list[list[int]]
    exact: bool
    max_freq_rel_error: float
    problems: list[str] = field(default_factory=list)


def source_inv_freq(config) -> tuple[torch.Tensor, float]:
    """The native model's source inverse frequencies [d_h/2] (float64) and the factor its RoPE type puts on cos/sin."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.double(), float(rotary.attention_scaling)


def fit_deepseek_rope(inv_freq: torch.Tensor, rope_pairs: list[list[int]], tolerance: float = FREQ_TOLERANCE) -> RopeFit:
    """Map every layer's kept frequencies onto one set `base^(-2m/d_r)`, m = 0..d_r/2-1 (DeepSeek's, default type).

    Exact when all layers keep the same frequencies and those form a geometric sequence starting at 1 (e.g. the
    fastest r pairs, base' = base^(2r/d_h), or every s-th pair from the fastest, base' = base^(2rs/d_h)). Otherwise
    the least-squares base in log space is returned with `exact=False`: each layer's pairs, fastest first, take the
    DeepSeek frequencies in order, and `max_freq_rel_error` says how far any pair moved.
    """
    freqs = inv_freq.double()
    pairs = len(rope_pairs[0])
    order, sorted_freqs, problems = [], [], []
    for layer, idx in enumerate(rope_pairs):
        f = freqs[torch.tensor(idx, dtype=torch.long)]
        perm = torch.argsort(f, descending=True, stable=True)
        order.append(perm.tolist())
        sorted_freqs.append(f[perm])
        if len(set(idx)) != len(idx):
            problems.append(f"layer {layer} keeps frequency pairs {sorted(idx)} with repeats (several kv components "
                            "on one frequency); DeepSeek's frequencies are distinct")
    sf = torch.stack(sorted_freqs)  # [L, r], fastest first
    k = torch.arange(pairs, dtype=torch.float64)
    if pairs > 1:
        # log f_k = -k * (2/d_r) * ln(base): least squares through the origin over all layers
        log_rho = float((sf.log() * k).sum() / (k * k).sum() / sf.shape[0])
        base = math.exp(-log_rho * pairs)
    else:
        base, log_rho = 10000.0, 0.0  # one pair rotates at frequency 1 whatever the base
    target = torch.exp(log_rho * k)  # [r]: DeepSeek's inv_freq, 1 first
    rel = (target / sf - 1).abs()
    max_rel = float(rel.max())
    if (sf[:, 0] - 1).abs().max() > tolerance:
        problems.append(f"the fastest kept frequency is {float(sf[:, 0].min()):.4g}, not 1 (DeepSeek's pair 0 always "
                        "rotates at 1 rad/token): keep the fastest source pair")
    if (sf - sf[0]).abs().max() > tolerance * sf[0].abs().max():
        bad = next(i for i in range(1, sf.shape[0]) if sorted(rope_pairs[i]) != sorted(rope_pairs[0]))
        problems.append(f"layers keep different frequency pairs (layer 0 {sorted(rope_pairs[0])}, layer {bad} "
                        f"{sorted(rope_pairs[bad])}); DeepSeek has one frequency set for all layers")
    if max_rel > tolerance and not problems:
        problems.append(f"the kept frequencies are not geometric (max relative deviation {max_rel:.3g}; e.g. RoPE "
                        "scaling that bends them, or a non-uniform pair choice)")
    exact = max_rel <= tolerance and not problems
    return RopeFit(base=base, order=order, exact=exact, max_freq_rel_error=max_rel, problems=problems)


def deepseek_compatible_rope_pairs(
    head_dim: int, rope_dims: int, strategy: str = "uniform", inv_freq: torch.Tensor | None = None
) -> list[int]:
    """Source frequency indices a converter can keep so that the result exports exactly to DeepSeek-V3.

    `strategy` "high": the fastest `rope_dims/2` pairs (base' = base^(rope_dims/head_dim)); "uniform": every s-th pair
    from the fastest, s = (head_dim/2) // (rope_dims/2) (base' = base^(s*rope_dims/head_dim)). Use the same list for
    every layer, one kv component per frequency (merging across kv heads keeps that when each frequency is taken
    once). With `inv_freq` (the source's, after any RoPE scaling), the set is checked to be geometric and a
    UserError says why not. "low" and "2-norm" choices are not exportable (their fastest pair is not frequency 1, or
    they differ per layer).
    """
    half, count = head_dim // 2, rope_dims // 2
    if rope_dims % 2 or not 0 < count <= half:
        raise UserError(f"rope dims must be even and in [2, {head_dim}] for a DeepSeek export, got {rope_dims}")
    if strategy == "high":
        pairs = list(range(count))
    elif strategy == "uniform":
        stride = half // count
        pairs = [m * stride for m in range(count)]
    else:
        raise UserError(f"--rope-strategy {strategy} does not give a DeepSeek-exportable model: use high or uniform")
    if inv_freq is not None:
        fit = fit_deepseek_rope(inv_freq, [pairs])
        if not fit.exact:
            raise UserError(f"the {strategy} pairs {pairs} do not export exactly: {fit.problems[0]}; "
                            "try --rope-strategy high (RoPE scaling usually leaves the fastest pairs alone)")
    return pairs


TARGET_STRATEGIES = ("uniform", "high")  # data-free choices that keep one geometric frequency set for all layers


def deepseek_convert_options(config, options, explicit: frozenset[str] | set[str] = frozenset()):
    """Resolve conversion options so that the converted model exports exactly to DeepSeek-V3 (`--target deepseek`).

    Cheap: reads the source config only (run it before calibration). `options` is a ConvertOptions; `explicit` names
    the fields the user set (e.g. {"rope_strategy", "rope_dims"}): an explicit choice the format cannot hold is
    refused with a UserError naming the fix, a default is replaced by an exportable one. Exportable means: one kv
    component per frequency (merged across kv heads, or a single kv head), at most head_dim rope dims, and a data-free
    pair choice ("uniform", else "high") whose frequencies, after the source's RoPE scaling, form a geometric set
    starting at the fastest pair. Returns (resolved options, notes saying what was chosen).
    """
    from mla_convert import rope as rope_lib

    if getattr(config, "mlp_bias", False):
        raise UserError("the MLP has biases, which DeepSeek-V3's dense MLP cannot hold: convert with --target native")
    heads = config.num_attention_heads
    groups = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    d_r = head_dim // 2 if options.rope_dims is None else options.rope_dims
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
    inv_freq, _ = source_inv_freq(config)
    eye = torch.eye(groups, dtype=torch.float64).expand(head_dim // 2, groups, groups)
    problems = []
    for strategy in candidates:
        # The pairs the converter keeps with this data-free strategy (identity key statistics stand in for data).
        plan = rope_lib.plan_rope(d_r, strategy, options.rope_merge, heads, groups, head_dim,
                                  q_energy=torch.ones(heads, head_dim // 2, dtype=torch.float64), k_cov=eye)
        pairs = plan.frequencies
        fit = fit_deepseek_rope(inv_freq, [pairs])
        if fit.exact:
            resolved = dataclasses.replace(options, rope_dims=d_r, rope_strategy=strategy)
            notes = [f"--target deepseek: --rope-strategy {strategy} --rope-dims {d_r}"
                     f"{' --rope-merge' if options.rope_merge else ''} keeps frequency pairs {pairs}, exported with "
                     f"rope_theta {fit.base:.6g}"]
            return resolved, notes
        problems.append(f"--rope-strategy {strategy} keeps pairs {pairs}: {fit.problems[0]}")
    if "rope_strategy" in explicit and options.rope_strategy == "uniform":
        fix = "pass --rope-strategy high, or a --rope-dims whose pair count divides head_dim/2"
    else:
        fix = "no data-free pair choice fits: use --target native (and `mla-convert export --allow-approx`)"
    raise UserError(f"not exportable to DeepSeek-V3: {'; '.join(problems)}; {fix}")


def deepseek_layout_notes(config, ranks: list[int], rope_dims: int) -> list[str]:
    """serving_notes for the layout a conversion with these ranks will export to (no padding)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return serving_notes(max(ranks), rope_dims, sum(ranks) / len(ranks) + rope_dims, heads, head_dim)


def check_exportable(folder: str | os.PathLike) -> list[str]:
    """Problems that keep the native checkpoint `folder` from an exact DeepSeek-V3 export (RoPE only; cheap)."""
    from mla_convert.modeling import MLAConfig

    config = MLAConfig.from_pretrained(Path(folder))
    inv_freq, _ = source_inv_freq(config)
    return fit_deepseek_rope(inv_freq, config.rope_pairs).problems


def _place_rope_rows(x: torch.Tensor, order: list[int], out_dim: int, stride: int) -> torch.Tensor:
    """Native rotate_half rope rows -> DeepSeek interleaved rows, along dim 1 of x [N, d_r, ...] -> [N, out_dim, ...].

    Native pair j is (row j, row j + d_r/2); DeepSeek pair k is (row 2k, row 2k+1) and rotates in the same sense
    (first' = first cos - second sin). Native pair order[m] goes to DeepSeek pair m*stride; other rows stay zero.
    """
    half = x.shape[1] // 2
    out = x.new_zeros(x.shape[0], out_dim, *x.shape[2:])
    for m, j in enumerate(order):
        out[:, 2 * m * stride] = x[:, j]
        out[:, 2 * m * stride + 1] = x[:, j + half]
    return out


# ---------------------------------------------------------------------------------------------------- identity norm


def identity_norm_scale(max_mean_square: float, eps: float = EXPORT_EPS, tolerance: float = NORM_TOLERANCE) -> float:
    """The power of two `a` for which RMSNorm_eps(a*c) * (sqrt(eps)/a) equals c within relative `tolerance`.

    RMSNorm_eps(a c) * sqrt(eps)/a = c / sqrt(1 + a^2 mean(c^2)/eps), so the relative error is at most
    a^2 M / (2 eps) for every c with mean(c^2) <= M. A power of two keeps `a * W` exact in any float format.
    """
    if max_mean_square <= 0:
        return 1.0
    a = math.sqrt(2 * tolerance * eps / max_mean_square)
    return 2.0 ** math.floor(math.log2(a))


def _latent_bound(w: torch.Tensor, norm_weight: torch.Tensor, bias: torch.Tensor | None, dims: int) -> float:
    """Bound on mean(y^2) over `dims` outputs for y = w x + bias, x = the decoder input RMSNorm's output.

    x = norm_weight * h / rms(h) has ||h/rms(h)|| <= sqrt(D) for every h, so ||y|| <= ||w diag(norm_weight)||_2
    sqrt(D) + ||bias||.
    """
    sigma = float(torch.linalg.matrix_norm(w.double() * norm_weight.double(), ord=2))
    bound = sigma * math.sqrt(w.shape[1]) + (float(bias.double().norm()) if bias is not None else 0.0)
    return bound * bound / dims


# ---------------------------------------------------------------------------------------------------- plan


@dataclass
class ExportPlan:
    heads: int
    groups: int
    nope: int  # d_n
    value: int  # d_v
    rope: int  # native d_r
    rope_out: int  # exported qk_rope_head_dim
    rope_stride: int  # DeepSeek pair index step between native pairs (rope padding)
    ranks: list[int]  # native d_c per layer
    latent_out: int  # exported kv_lora_rank
    q_scale: float  # softmax scale folded into the query
    rope_score_scale: float  # the source RoPE type's cos/sin factor, squared (1 for default)
    residual_scale: float  # s = sqrt(EXPORT_EPS / source eps)
    fit: RopeFit
    q_bias: bool  # the query keeps a bias: q_lora path
    k_rope_bias: bool
    o_bias: bool
    q_lora_rank: int | None
    q_lora_mode: str | None  # "input" (q_a = [x; 1]) | "output" (q_b = identity)
    approximations: list[str]
    warnings: list[str]

    @property
    def attention_bias(self) -> bool:
        return self.q_bias or self.k_rope_bias or self.o_bias


def _nonzero(t: torch.Tensor | None) -> bool:
    return t is not None and bool(t.abs().max() > 0)


def _out_dtype(options: ExportOptions, config) -> torch.dtype:
    name = options.dtype
    if name == "auto":
        name = str(getattr(config, "dtype", None) or "float32").replace("torch.", "")
    if name == "float16":
        raise UserError(
            "float16 cannot hold the export: the identity kv_a_layernorm needs latent values far below float16's "
            "normal range (~6e-5) and norm weights above its maximum; pass --dtype bfloat16 or --dtype float32"
        )
    if name not in ("float32", "bfloat16"):
        raise UserError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {options.dtype}")
    return getattr(torch, name)


def _pad_layout(options: ExportOptions, latent: int, rope: int) -> tuple[int, int]:
    """(kv_lora_rank, qk_rope_head_dim) after --pad-latent; refuses a padding that cannot be exact."""
    if options.pad_latent == "none":
        return latent, rope
    if options.pad_latent not in PAD_CHOICES:
        raise UserError(f"--pad-latent must be one of {', '.join(PAD_CHOICES)}, got {options.pad_latent}")
    rope_out = FLASHMLA_LAYOUT[1]
    if rope > rope_out or (rope_out // 2) % (rope // 2):
        raise UserError(
            f"--pad-latent {options.pad_latent} needs qk_rope_head_dim 64, reachable from {rope} only when {rope} "
            "divides 64 (the padded pairs must stay geometric); convert with --rope-dims 8, 16, 32 or 64"
        )
    if options.pad_latent == "flashmla" or latent > VLLM_MLA_HEAD_SIZES[0] - rope_out:
        target = FLASHMLA_LAYOUT[0]
    else:
        target = VLLM_MLA_HEAD_SIZES[0] - rope_out
    if latent > target:
        raise UserError(f"kv_lora_rank {latent} is above {target}: no exact padding to a layout vLLM's MLA accepts")
    return target, rope_out


def serving_notes(latent: int, rope: int, native_per_token: float, heads: int, nope: int) -> list[str]:
    """Warnings about what vLLM/SGLang will do with a (kv_lora_rank, qk_rope_head_dim) layout."""
    notes = []
    size = latent + rope
    if size not in VLLM_MLA_HEAD_SIZES:
        expanded = 2 * heads * (nope + rope)
        notes.append(
            f"kv_lora_rank + qk_rope_head_dim = {size}: vLLM's MLA backends accept only {VLLM_MLA_HEAD_SIZES} and "
            f"refuse this model; with VLLM_MLA_DISABLE=1 vLLM falls back to per-head K/V ({expanded} values per "
            f"token per layer instead of {size}); re-export with --pad-latent vllm for an exact padded layout"
        )
    if (latent, rope) != FLASHMLA_LAYOUT:
        notes.append(f"FlashMLA needs kv_lora_rank 512 + qk_rope_head_dim 64 (this export: {latent} + {rope}); "
                     "engines pick another MLA kernel (vLLM: Triton MLA / FlashInfer / FlashAttention MLA)")
    if size > native_per_token:
        notes.append(f"the exported cache holds {size} values per token per layer, more than the native "
                     f"model's {native_per_token:g} (padding to one rank for all layers)")
    return notes


def make_plan(config, layer_biases: list[dict], options: ExportOptions) -> ExportPlan:
    """Decide the exported shapes, the RoPE mapping and which biases survive, from the config and the biases alone."""
    if options.format not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {options.format}")
    if options.drop_biases and options.keep_biases:
        raise UserError("--keep-biases and --drop-biases contradict each other: pass one of them")
    if options.drop_biases and not options.allow_approx:
        raise UserError("--drop-biases changes the model: pass --allow-approx with it (the error is measured)")
    if options.allow_approx and not options.verify:
        raise UserError("--allow-approx exports are always measured: drop --no-verify")
    if getattr(config, "model_type", None) != "mla":
        raise UserError(f"export needs a native MLA checkpoint (model_type mla, made by `mla-convert llama ... -o DIR`), "
                        f"got model_type {getattr(config, 'model_type', None)}")
    if getattr(config, "mlp_bias", False):
        raise UserError("the MLP has biases, which DeepSeek-V3's dense MLP cannot hold: this model is not exportable")
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    rope, nope, value = config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    if rope == 0:
        raise UserError("this model has no RoPE dims (qk_rope_head_dim 0); DeepSeek engines need a rope key: "
                        "convert with --rope-dims 8 or more")
    approximations, warnings = [], []
    inv_freq, attention_scaling = source_inv_freq(config)
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        warnings.append(f"rope_type {rope_type} changes frequencies with the sequence length; the export uses the "
                        "frequencies at load time (exact up to the original context length only)")
    fit = fit_deepseek_rope(inv_freq, config.rope_pairs)
    if not fit.exact:
        message = (f"RoPE: {fit.problems[0] if fit.problems else 'not geometric'} (max frequency change "
                   f"{fit.max_freq_rel_error:.3g} with base {fit.base:.6g})")
        if not options.allow_approx:
            raise UserError(
                f"not exportable exactly: {message}. Convert with --rope-strategy high or uniform and --rope-merge "
                "(see mla_convert.export.deepseek_compatible_rope_pairs), or pass --allow-approx to export the "
                "nearest geometric frequencies with the logit error measured"
            )
        approximations.append(message)
    ranks = list(config.kv_lora_rank)
    latent_out, rope_out = _pad_layout(options, max(ranks), rope)
    stride = rope_out // rope
    has = {key: any(_nonzero(b.get(key)) for b in layer_biases) for key in ("q", "k_rope", "o")}
    if any(has.values()):
        names = [n for n, v in (("query", has["q"]), ("rope key", has["k_rope"]), ("output/value", has["o"])) if v]
        if options.drop_biases:
            approximations.append(f"dropped the {', '.join(names)} biases (what vLLM and SGLang compute anyway)")
            has = dict.fromkeys(has, False)
        elif not options.keep_biases:
            raise UserError(
                f"this model has {', '.join(names)} biases, which vLLM's and SGLang's DeepSeek classes drop silently: "
                "serve the native checkpoint through the vLLM plugin instead (exact, docs/serving.md), or pass "
                "--keep-biases (for transformers only) or --drop-biases --allow-approx (the error is measured)"
            )
        else:
            warnings.append(
                f"this export keeps {', '.join(names)} biases (attention_bias: true): transformers loads them, but "
                "vLLM and SGLang build DeepSeek attention without biases and skip them silently; see "
                "export_max_rel_logit_error_without_biases, or re-export with --drop-biases --allow-approx"
            )
    q_lora_rank = q_lora_mode = None
    if has["q"]:
        hidden, q_rows = config.hidden_size, heads * (nope + rope_out)
        q_lora_mode = "input" if hidden + 1 <= q_rows else "output"
        q_lora_rank = hidden + 1 if q_lora_mode == "input" else q_rows
    native_per_token = sum(ranks) / len(ranks) + rope
    warnings += serving_notes(latent_out, rope_out, native_per_token, heads, nope)
    if config.hidden_act != "silu":
        warnings.append(f"hidden_act {config.hidden_act}: vLLM's DeepSeek MLP supports only silu")
    return ExportPlan(
        heads=heads, groups=groups, nope=nope, value=value, rope=rope, rope_out=rope_out, rope_stride=stride,
        ranks=ranks, latent_out=latent_out,
        q_scale=config.softmax_scale * math.sqrt(nope + rope_out),
        rope_score_scale=attention_scaling**2,
        residual_scale=math.sqrt(EXPORT_EPS / config.rms_norm_eps),
        fit=fit, q_bias=has["q"], k_rope_bias=has["k_rope"], o_bias=has["o"],
        q_lora_rank=q_lora_rank, q_lora_mode=q_lora_mode, approximations=approximations, warnings=warnings,
    )  # fmt: skip


def deepseek_config(config, plan: ExportPlan, dtype: torch.dtype) -> dict:
    """config.json of the export: a dense DeepSeek-V3 (every layer below first_k_dense_replace)."""
    from transformers import DeepseekV3Config

    layers = config.num_hidden_layers
    ds = DeepseekV3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=plan.heads,
        num_key_value_heads=plan.heads,  # kv_b_proj makes per-head K/V: the format's grouping must be 1
        # Dense only: n_routed_experts must be an int (transformers rejects null, vLLM's loader adds to it).
        n_shared_experts=1, n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=layers,
        routed_scaling_factor=1.0,  # vLLM divides fp16 hidden states by it: 1.0 keeps the norms' eps unchanged
        kv_lora_rank=plan.latent_out,
        q_lora_rank=plan.q_lora_rank,
        qk_rope_head_dim=plan.rope_out,
        qk_nope_head_dim=plan.nope,
        v_head_dim=plan.value,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=EXPORT_EPS,
        rope_parameters={"rope_type": "default", "rope_theta": plan.fit.base},
        rope_interleave=True,
        attention_bias=plan.attention_bias,
        attention_dropout=0.0,
        tie_word_embeddings=False,  # vLLM's DeepSeek ignores tying: lm_head is always written
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        num_nextn_predict_layers=0,
        initializer_range=config.initializer_range,
    )  # fmt: skip
    out = ds.to_dict()
    # Without it vLLM resolves the base DeepseekV3Model and serves an embedding model (LLM.generate refuses it).
    out["architectures"] = ["DeepseekV3ForCausalLM"]
    out["dtype"] = str(dtype).replace("torch.", "")
    # Engines pinned to transformers 4 read these top-level keys (rope_parameters is transformers 5).
    out["rope_theta"] = plan.fit.base
    out["rope_scaling"] = None
    out.pop("transformers_version", None)
    return out


# ---------------------------------------------------------------------------------------------------- tensors


def _round_to(value: float, dtype: torch.dtype) -> float:
    return float(torch.tensor(value, dtype=torch.float64).to(dtype).double())


def export_layer(t: dict[str, torch.Tensor], plan: ExportPlan, layer: int, norm_weight: torch.Tensor) -> tuple[dict, dict]:
    """One layer's attention tensors (names relative to `self_attn.`) -> DeepSeek tensors and per-layer stats.

    `t` holds the native q_proj/kv_a_proj/kv_b_proj/o_proj weights and biases (float32); `norm_weight` is the
    layer's input_layernorm weight, which bounds the latent for the identity norm.
    """
    H, G, d_n, d_v, d_r = plan.heads, plan.groups, plan.nope, plan.value, plan.rope
    d_c, d_c_out, d_r_out = plan.ranks[layer], plan.latent_out, plan.rope_out
    order, stride = plan.fit.order[layer], plan.rope_stride
    per_group = H // G
    f64 = torch.float64

    def get(name):
        x = t.get(name)
        return None if x is None else x.to(f64)

    w_q, b_q = get("q_proj.weight"), get("q_proj.bias")
    hidden = w_q.shape[1]
    w_q = w_q.view(H, d_n + d_r, hidden)
    b_q = (b_q if b_q is not None else w_q.new_zeros(H * (d_n + d_r))).view(H, d_n + d_r)
    rope_q = plan.q_scale * plan.rope_score_scale
    w_q_out = torch.cat(
        (plan.q_scale * w_q[:, :d_n], rope_q * _place_rope_rows(w_q[:, d_n:], order, d_r_out, stride)), dim=1
    ).reshape(H * (d_n + d_r_out), hidden)
    b_q_out = torch.cat(
        (plan.q_scale * b_q[:, :d_n], rope_q * _place_rope_rows(b_q[:, d_n:, None], order, d_r_out, stride)[..., 0]),
        dim=1,
    ).reshape(-1)

    w_a, b_a = get("kv_a_proj.weight"), get("kv_a_proj.bias")
    w_c, w_r = w_a[:d_c], w_a[d_c:]  # [d_c, D], [d_r, D]
    b_c = b_a[:d_c] if b_a is not None else None
    b_r = b_a[d_c:] if b_a is not None else w_a.new_zeros(d_r)

    w_b, b_b = get("kv_b_proj.weight"), get("kv_b_proj.bias")
    w_b = w_b.view(G, d_n + d_v, d_c)
    w_uv = w_b[:, d_n:]  # [G, d_v, d_c]
    # Value bias seen by the output: kv_b's value bias plus the latent bias mapped through W_uv (softmax rows sum to
    # 1). The nope-key parts of both biases add one constant per query to every score, which softmax cancels.
    v_bias = w_b.new_zeros(G, d_v)
    if b_b is not None:
        v_bias += b_b.view(G, d_n + d_v)[:, d_n:]
    if b_c is not None:
        v_bias += torch.einsum("gvc,c->gv", w_uv, b_c)
    w_o, b_o = get("o_proj.weight"), get("o_proj.bias")
    o_bias = w_o @ v_bias.repeat_interleave(per_group, dim=0).reshape(-1)  # [D]
    if b_o is not None:
        o_bias = o_bias + b_o

    # Identity kv_a_layernorm: latent rows scaled by a power of two a (exact in any format), norm weight sqrt(eps)/a
    # rounded to bfloat16 precision so that a float32 export served in bfloat16 keeps it exactly; kv_b_proj absorbs
    # the rounding.
    latent_ms = _latent_bound(w_c, norm_weight, None, d_c_out)
    a = identity_norm_scale(latent_ms)
    norm_w = _round_to(math.sqrt(EXPORT_EPS) / a, torch.bfloat16)  # exact in float32 and bfloat16 alike
    correction = math.sqrt(EXPORT_EPS) / a / norm_w
    kv_a = w_a.new_zeros(d_c_out + d_r_out, hidden)
    kv_a[:d_c] = a * w_c
    kv_a[d_c_out:] = _place_rope_rows(w_r[None], order, d_r_out, stride)[0]
    kv_b = w_b.new_zeros(H, d_n + d_v, d_c_out)
    kv_b[:, :, :d_c] = correction * w_b.repeat_interleave(per_group, dim=0)

    out = {
        "kv_a_proj_with_mqa.weight": kv_a,
        "kv_a_layernorm.weight": torch.full((d_c_out,), norm_w, dtype=f64),
        "kv_b_proj.weight": kv_b.reshape(H * (d_n + d_v), d_c_out),
        "o_proj.weight": plan.residual_scale * w_o,
    }
    stats = {"kv_a_scale": a, "latent_mean_square_bound": latent_ms}
    if plan.attention_bias:
        k_bias = w_a.new_zeros(d_c_out + d_r_out)
        if plan.k_rope_bias:
            k_bias[d_c_out:] = _place_rope_rows(b_r[None, :, None], order, d_r_out, stride)[0, :, 0]
        out["kv_a_proj_with_mqa.bias"] = k_bias
        out["o_proj.bias"] = plan.residual_scale * o_bias if plan.o_bias else torch.zeros_like(o_bias)
    if plan.q_lora_rank is None:
        out["q_proj.weight"] = w_q_out
        return out, stats
    # Query with a bias: q = W x + b through q_a_proj (+bias) -> identity q_a_layernorm -> q_b_proj.
    rows = w_q_out.shape[0]
    if plan.q_lora_mode == "input":  # q_a = a [x; 1], q_b = [W | b]
        ms = (float(norm_weight.double().abs().max()) ** 2 * hidden + 1.0) / (hidden + 1)
        a_q = identity_norm_scale(ms)
        q_a = torch.cat((torch.eye(hidden, dtype=f64), w_q.new_zeros(1, hidden)), dim=0) * a_q
        q_a_bias = w_q.new_zeros(hidden + 1)
        q_a_bias[-1] = a_q
        q_b = torch.cat((w_q_out, b_q_out[:, None]), dim=1)
    else:  # q_a = a (W x + b), q_b = identity
        ms = _latent_bound(w_q_out, norm_weight, b_q_out, rows)
        a_q = identity_norm_scale(ms)
        q_a, q_a_bias, q_b = a_q * w_q_out, a_q * b_q_out, torch.eye(rows, dtype=f64)
    q_norm_w = _round_to(math.sqrt(EXPORT_EPS) / a_q, torch.bfloat16)
    out["q_a_proj.weight"] = q_a
    out["q_a_proj.bias"] = q_a_bias
    out["q_a_layernorm.weight"] = torch.full((q_a.shape[0],), q_norm_w, dtype=f64)
    out["q_b_proj.weight"] = q_b * (math.sqrt(EXPORT_EPS) / a_q / q_norm_w)
    stats["q_a_scale"] = a_q
    return out, stats


# ---------------------------------------------------------------------------------------------------- verification

# Runs in a fresh interpreter that never imports mla_convert: the export must load in stock transformers alone.
_STOCK_CHECK = r"""
import sys
import torch
from transformers import DeepseekV3ForCausalLM

folder, inputs_path, out_path = sys.argv[1:4]
inp = torch.load(inputs_path)
model, info = DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
model.eval()
res = {"loading_info": {k: sorted(str(x) for x in v) for k, v in info.items()}}
with torch.no_grad():
    res["logits"] = model(inp["input_ids"]).logits
    n = inp["new_tokens"]
    res["generated"] = model.generate(
        inp["prompt"], do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
    )
    if inp["zero_biases"]:
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
        res["logits_without_biases"] = model(inp["input_ids"]).logits
res["mla_convert_imported"] = any(m.split(".")[0] == "mla_convert" for m in sys.modules)
res["transformers_version"] = __import__("transformers").__version__
torch.save(res, out_path)
"""


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    """max |other - reference| / max |reference| (over every position and vocabulary entry)."""
    reference, other = reference.double(), other.double()
    return float((other - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def verify_export(native_folder: Path, export_folder: Path, options: ExportOptions, has_biases: bool) -> dict:
    """Logits and greedy tokens of stock DeepseekV3ForCausalLM (subprocess, no mla_convert) vs the native model."""
    from transformers import AutoModelForCausalLM

    import mla_convert.modeling  # noqa: F401  (registers model_type mla)

    native = AutoModelForCausalLM.from_pretrained(native_folder, dtype=torch.float32, trust_remote_code=False).eval()
    gen = torch.Generator().manual_seed(options.seed)
    ids = torch.randint(0, native.config.vocab_size, (options.verify_batch, options.verify_tokens), generator=gen)
    prompt = ids[:1, : max(1, options.verify_tokens // 4)]
    n = options.verify_new_tokens
    with torch.no_grad():
        native_logits = native(ids).logits
        native_gen = native.generate(prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    del native
    with tempfile.TemporaryDirectory(prefix="mla-export-verify-") as tmp:
        inputs, result = Path(tmp) / "inputs.pt", Path(tmp) / "result.pt"
        torch.save({"input_ids": ids, "prompt": prompt, "new_tokens": n, "zero_biases": has_biases}, inputs)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of ours on the path
        proc = subprocess.run(
            [sys.executable, "-c", _STOCK_CHECK, str(export_folder), str(inputs), str(result)],
            cwd=tmp, env=env, capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
            raise RuntimeError(f"stock DeepseekV3ForCausalLM failed on the export: {tail}\n{proc.stderr[-4000:]}")
        res = torch.load(result)
    info = res["loading_info"]
    if res["mla_convert_imported"]:
        raise RuntimeError("the stock check imported mla_convert: it would not prove a stock load")
    if info.get("missing_keys") or info.get("unexpected_keys") or info.get("mismatched_keys"):
        raise RuntimeError(f"stock DeepseekV3ForCausalLM did not load every tensor of the export: {info}")
    out = {
        "export_max_rel_logit_error": relative_error(native_logits, res["logits"]),
        "export_max_abs_logit_error": float((native_logits.double() - res["logits"].double()).abs().max()),
        "export_argmax_agreement": float((native_logits.argmax(-1) == res["logits"].argmax(-1)).double().mean()),
        "export_greedy_tokens_match": bool(torch.equal(native_gen, res["generated"])),
        "export_verify_protocol": (
            f"{options.verify_batch} x {options.verify_tokens} random tokens (seed {options.seed}) and "
            f"{n} greedy tokens, float32, stock transformers {res['transformers_version']} DeepseekV3ForCausalLM in a "
            "subprocess without mla_convert; error = max|stock - native| / max|native| over all logits"
        ),
    }
    if has_biases:
        out["export_max_rel_logit_error_without_biases"] = relative_error(native_logits, res["logits_without_biases"])
    return out


# ---------------------------------------------------------------------------------------------------- driver


LAYER_ATTENTION = ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj")


def export(model: str | os.PathLike, out: str | os.PathLike, options: ExportOptions, overwrite: bool = False) -> dict:
    """Export the native MLA checkpoint folder `model` to a DeepSeek-V3 folder `out`; returns the export record
    (what provenance.json holds under "export", plus "measurements")."""
    from mla_convert import provenance
    from mla_convert.card import write_model_card
    from mla_convert.checkpoint import SafetensorsSource, ShardedWriter, staged_output
    from mla_convert.modeling import MLAConfig

    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} has no config.json: pass a native MLA checkpoint folder (mla-convert llama -o DIR)")
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type != "mla":
        raise UserError(f"export needs a native MLA checkpoint (model_type mla, made by `mla-convert llama ... -o "
                        f"DIR`), got model_type {model_type}")
    config = MLAConfig.from_pretrained(folder)
    dtype = _out_dtype(options, config)
    source = SafetensorsSource(config, str(folder), folder)
    layers = config.num_hidden_layers
    prefix = "model.layers.{i}."

    def bias(i: int, name: str) -> torch.Tensor | None:
        key = f"{prefix.format(i=i)}self_attn.{name}.bias"
        return source.get(key) if source.has(key) else None

    layer_biases = []
    for i in range(layers):
        d_c = config.kv_lora_rank[i]
        kv_a, kv_b = bias(i, "kv_a_proj"), bias(i, "kv_b_proj")
        v_part = kv_b.view(config.num_key_value_heads, -1)[:, config.qk_nope_head_dim :] if kv_b is not None else None
        o_parts = [x for x in (bias(i, "o_proj"), v_part, kv_a[:d_c] if kv_a is not None else None) if x is not None]
        layer_biases.append({
            "q": bias(i, "q_proj"),
            "k_rope": kv_a[d_c:] if kv_a is not None else None,
            "o": torch.cat([x.reshape(-1) for x in o_parts]) if o_parts else None,
        })  # fmt: skip
    plan = make_plan(config, layer_biases, options)
    for note in plan.warnings:
        log.warning("%s", note)
    for note in plan.approximations:
        log.warning("approximation: %s", note)
    s = plan.residual_scale
    record = {
        "format": "deepseek_v3",
        "rope_theta": plan.fit.base,
        "rope_order": plan.fit.order,
        "rope_exact": plan.fit.exact,
        "rope_max_freq_rel_error": plan.fit.max_freq_rel_error,
        "kv_lora_rank": plan.latent_out,
        "qk_rope_head_dim": plan.rope_out,
        "q_lora_rank": plan.q_lora_rank,
        "attention_bias": plan.attention_bias,
        "residual_scale": s,
        "approximations": plan.approximations,
        "warnings": plan.warnings,
    }
    inputs = (folder,)
    with staged_output(Path(out), overwrite, inputs) as stage:
        writer = ShardedWriter(stage, dtype)
        writer.add("model.embed_tokens.weight", s * source.get("model.embed_tokens.weight"))
        lm_head = "lm_head.weight" if source.has("lm_head.weight") else "model.embed_tokens.weight"
        writer.add("lm_head.weight", source.get(lm_head))
        writer.add("model.norm.weight", source.get("model.norm.weight"))
        scales = []
        for i in range(layers):
            p = prefix.format(i=i)
            norm_weight = source.get(p + "input_layernorm.weight")
            attn = {}
            for name in LAYER_ATTENTION:
                for kind in ("weight", "bias"):
                    key = f"{p}self_attn.{name}.{kind}"
                    if source.has(key):
                        attn[f"{name}.{kind}"] = source.get(key)
            if options.drop_biases:
                attn = {k: v for k, v in attn.items() if not k.endswith(".bias")}
            tensors, stats = export_layer(attn, plan, i, norm_weight)
            scales.append(stats)
            for name, tensor in tensors.items():
                writer.add(f"{p}self_attn.{name}", tensor)
            writer.add(p + "input_layernorm.weight", norm_weight)
            writer.add(p + "post_attention_layernorm.weight", source.get(p + "post_attention_layernorm.weight"))
            for name in ("gate_proj", "up_proj"):
                writer.add(f"{p}mlp.{name}.weight", source.get(f"{p}mlp.{name}.weight"))
            writer.add(f"{p}mlp.down_proj.weight", s * source.get(f"{p}mlp.down_proj.weight"))
        source.close()
        writer.finalize()
        (stage / "config.json").write_text(json.dumps(deepseek_config(config, plan, dtype), indent=2) + "\n")
        copied = source.copy_aux_files(stage)
        record["identity_norm_scales"] = scales
        measurements = {}
        if options.verify:
            measurements = verify_export(folder, stage, options, plan.attention_bias)
            err = measurements["export_max_rel_logit_error"]
            log.info("stock DeepseekV3ForCausalLM vs native: max relative logit error %.3g", err)
            if not plan.approximations and err > 1e-3:
                log.warning("the export differs from the native model by %.3g although no approximation was made "
                            "(dtype %s rounding?)", err, str(dtype).replace("torch.", ""))
        parent = provenance.load(folder)
        kv_before = sum(plan.ranks) / layers + plan.rope
        provenance.save(stage, provenance.new(
            "export",
            source=(parent or {}).get("source"),
            method="DeepSeek-V3 export (identity kv_a_layernorm, interleaved geometric RoPE, folded softmax scale)",
            options=dataclasses.asdict(options),
            kv_cache={
                "elements_per_token_per_layer_before": kv_before,
                "elements_per_token_per_layer_after": plan.latent_out + plan.rope_out,
                "dtype": str(dtype).replace("torch.", ""),
            },
            export=record,
            measurements=measurements,
            copied_files=copied,
            parent=parent,
        ))  # fmt: skip
        write_model_card(stage)
    record["measurements"] = measurements
    return record
