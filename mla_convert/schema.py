"""The conversion's options, declared once as classes you can read: `ConvertOptions` (the library's options, recorded in
provenance.json in field order) and `CommandLine` (the convert commands' own flags: the output, the target, ...).

Each field is written out with its type and default; its metadata (`option(...)`) carries its flags, help, choices,
check and the docs/decisions.md record of its default. From those two classes come the options of the convert commands
(`mla-convert convert|llama|qwen|...`, mla_convert/cli/convert.py: `OPTIONS`), their single-option checks
(`check_options`, called by `conversion.plan.make_geometry`) and the option reference docs/options.md
(`python -m mla_convert.schema --markdown`). Adding an option is one field here; what the option does is then the
pipeline's business.

This module imports no torch (the CLI builds its options from it before any model code loads). The defaults chosen
by measurement say why in one line and point into docs/decisions.md; each option with a default names its record there
(`why`), which docs/options.md links.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, get_args, get_type_hints

from mla_convert import policy
from mla_convert.errors import UserError

_SAME = object()  # Option.cli_default: the flag's default is the library's


def option(default: Any, *flags: str, help: str, choices: tuple[str, ...] | None = None,
           check: Callable[[Option, Any], str | None] | None = None, cli_default: Any = _SAME, cli_type: Any = None,
           parse: Callable[[Option, Any], Any] | None = None, show_default: bool = True, why: str | None = None,
           library_only: bool = False):
    """A field of the options classes: its `default`, and as its metadata what the commands, the checks and the docs
    make of it (`Option`'s attributes of the same names). Give `flags` (the CLI's spellings; a bool's "--x/--no-x"
    pair is one string), or none and `library_only` for an option the commands do not offer."""
    if bool(flags) == library_only:
        raise TypeError("an option has its flags or is library_only (one of the two)")
    return field(default=default, metadata=dict(flags=flags, help=help, choices=choices, check=check,
                                                cli_default=cli_default, cli_type=cli_type, parse=parse,
                                                show_default=show_default, why=why, library_only=library_only))


@dataclass(frozen=True)
class Option:
    """One option as the commands, the checks and the docs see it: a field of `ConvertOptions` or `CommandLine` (its
    name, type and default) with the metadata `option` gave it."""

    name: str  # the field (and the CLI parameter)
    type: type  # the value's type: int, float, str, bool (Path for an output)
    default: Any  # the field's default; None: resolved later (see the help)
    flags: tuple[str, ...]  # the CLI's spellings; a bool's "--x/--no-x" pair is one string; () where library_only
    help: str
    choices: tuple[str, ...] | None = None
    nullable: bool = False  # None is a value (the field's type is `X | None`: not given, resolved from other options)
    check: Callable[[Option, Any], str | None] | None = None  # beyond the choices: the error line, or None when fine
    cli_default: Any = _SAME  # what the flag holds when not given, where that differs from `default`
    cli_type: Any = None  # the flag's annotation, where it differs from `type` (text such as `auto` or a list)
    parse: Callable[[Option, Any], Any] | None = None  # the flag's value -> the option's (raises UserError)
    show_default: bool = True  # whether --help shows "[default: ...]"
    cli_only: bool = False  # a flag of the convert commands that is no conversion option (`CommandLine`)
    why: str | None = None  # the docs/decisions.md record of the default (its anchor), linked from docs/options.md
    library_only: bool = False  # a conversion option the commands do not offer (no flags)

    @property
    def flag(self) -> str:
        return self.flags[0].split("/")[0] if self.flags else self.name

    @property
    def annotation(self) -> Any:
        """The CLI parameter's annotation (typer reads the flag's type from it)."""
        if self.cli_type is not None:
            return self.cli_type
        return Optional[self.type] if self.nullable or self.flag_default is None else self.type

    @property
    def flag_default(self) -> Any:
        return self.default if self.cli_default is _SAME else self.cli_default

    def from_flag(self, value: Any) -> Any:
        """The option's value from what the flag holds: parsed, and `default` where the flag was not given."""
        if self.parse is not None:
            return self.parse(self, value)
        return self.default if value is None and self.cli_default is None else value

    def error(self, value: Any) -> str | None:
        """The one-line error for this option's value alone, or None."""
        if value is None and (self.nullable or self.default is None):
            return None
        if self.choices is not None and value not in self.choices:
            return f"{self.flag} must be one of {', '.join(self.choices)}, got {value}"
        return self.check(self, value) if self.check is not None else None


def options_of(cls: type, cli_only: bool = False) -> tuple[Option, ...]:
    """The `Option` of every field of the dataclass `cls`, in field order; a field not declared with `option(...)` is
    refused (each must say its flags or that it is library-only)."""
    hints = get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        if "flags" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name}: declare it with option(...) (its flags, or library_only=True)")
        kinds = get_args(hints[f.name])
        nullable = type(None) in kinds
        kind = next(k for k in kinds if k is not type(None)) if nullable else hints[f.name]
        found.append(Option(f.name, kind, f.default, nullable=nullable, cli_only=cli_only, **f.metadata))
    return tuple(found)


# ------------------------------------------------------------------------------------------------ checks and parsers


def _positive(opt: Option, v) -> str | None:
    return None if v > 0 else f"{opt.flag} must be positive, got {v}"


def _positive_finite(opt: Option, v) -> str | None:
    return None if v > 0 and math.isfinite(v) else f"{opt.flag} must be positive, got {v}"


def _non_negative(opt: Option, v) -> str | None:
    return None if v >= 0 else f"{opt.flag} must be 0 or more, got {v}"


def _kv_budget(opt: Option, v) -> str | None:
    if math.isfinite(v) and v > 0:
        return None
    return f"--kv-budget must be a positive number (elements, or a fraction <= 1), got {v}"


def _kv_bytes(opt: Option, v) -> str | None:
    if math.isfinite(v) and v > 0:
        return None
    return f"--kv-bytes must be a positive number (bytes per token, or a fraction <= 1 of the source's), got {v}"


def _kv_balance(opt: Option, v) -> str | None:
    if not math.isfinite(v):
        return f"--kv-balance must be a positive number, got {v}"
    return _positive(opt, v)


def _calib_samples(opt: Option, v) -> str | None:
    return None if v > 0 else "--calib-samples and --calib-seq-len must be positive"


def _calib_seq_len(opt: Option, v) -> str | None:
    if v <= 0:
        return "--calib-samples and --calib-seq-len must be positive"
    return None if v >= 2 else "--calib-seq-len must be at least 2 (a window's attention needs a key before its query)"


def _calib_echo(opt: Option, v) -> str | None:
    return None if 0 <= v <= 0.5 else f"--calib-echo must be from 0 to 0.5 (a share of each window), got {v}"


def _refine_seq_len(opt: Option, v) -> str | None:
    return None if v >= 16 else f"--refine-seq-len must be at least 16 tokens, got {v}"


def _auto(opt: Option, value: str | None, what: str, kind: type = int):
    """`auto` (None: resolved by the plan) or `what`, a value of `kind`."""
    if value is None or value == "auto":
        return None
    try:
        return kind(value)
    except ValueError:
        raise UserError(f"{opt.flag} must be auto or {what}, got {value!r}") from None


def _steps(opt: Option, value: str | None) -> int | None:
    return _auto(opt, value, "a number of steps")


def _count(opt: Option, value: str | None) -> int | None:
    return _auto(opt, value, "a number of positions")


def _processes(opt: Option, value: str | None) -> int | None:
    return _auto(opt, value, "a number of processes")


def _rate(opt: Option, value: str | None) -> float | None:
    return _auto(opt, value, "a learning rate", float)


def _at_least_one(opt: Option, v) -> str | None:
    return None if v >= 1 else f"{opt.flag} must be auto or 1 or more, got {v}"


def _balance(opt: Option, value: str | None) -> float | None:
    """A number, `none` (None: the blocks unscaled), or the default where the flag is not given."""
    if value is None:
        return opt.default
    if value.lower() == "none":
        return None
    try:
        return float(value)
    except ValueError:
        raise UserError(f"{opt.flag} must be a number or none, got {value!r}") from None


def _calib_data(opt: Option, value: list[str] | None) -> str | None:
    """Repeated --calib-data options are the parts of one weighted mixture; `none`: no calibration text."""
    joined = ",".join(value or ["self"])
    return None if joined.lower() == "none" else joined


# -------------------------------------------------------------------------------------------------- the conversion's


@dataclass
class ConvertOptions:
    """The conversion's options (`mla_convert.convert.convert(source, out, ConvertOptions(...))`); `dataclasses.asdict`
    of them, in this order, is what provenance.json and the resume fingerprint record. None: a default resolved from
    the other options or the source (see each help text and conversion.pipeline.make_plan)."""

    rank: int | None = option(None, "--rank", "-r", help="Latent dims d_c cached per token per layer.")
    kv_budget: float | None = option(None, "--kv-budget", check=_kv_budget, help=(
        "Instead of --rank: cache elements per token per layer (d_c + d_r), or a fraction <= 1 of the source's cache "
        "(e.g. 0.25)."))
    kv_bytes: float | None = option(None, "--kv-bytes", check=_kv_bytes, why="a-cache-budget-in-bytes", help=(
        "Instead of --rank/--kv-budget: the cache's bytes per token over all layers, or a fraction <= 1 of the "
        "source's 16-bit cache bytes (e.g. 0.125). The plan chooses the latent's width and the cache type it is "
        "stored in (f16, q8_0, q4_0: a wider latent in fewer bits) on the measured frontier, and says where the "
        "source's own quantized cache does better at these bytes."))
    cache_type: str | None = option(None, "--cache-type", choices=tuple(policy.LATENT_CACHE_COST),
                                    why="a-cache-budget-in-bytes", help=(
        "The cache type the latent is served in (llama.cpp's blocks of 32, as `eval --cache-type` and "
        "--cache-type-k store it): with --kv-bytes, the only type considered; recorded in the config "
        "(latent_cache_type: eval and generate read the cache so), each layer's row a whole number of blocks, and a "
        "quantized type stores the latent in the balanced basis (as `mla-convert rebase`). Default: f16, or "
        "--kv-bytes' choice."))
    # None: conversion.plan.default_rope_dims (docs/decisions.md#rope-key-width)
    rope_dims: int | None = option(None, "--rope-dims", why="rope-key-width", help=(
        "Dims d_r of the shared RoPE key (even). Default: a third of --kv-budget, at most three quarters of head_dim "
        "(with --target deepseek half of it as a power of two, up to all of head_dim), and at most 64, the rope "
        "width vLLM's MLA kernels take; head_dim/2 (same caps) with --rank."))
    # None: conversion.plan.default_nope_dims (docs/decisions.md#nope-key-width)
    nope_dims: int | None = option(None, "--nope-dims", why="nope-key-width", help=(
        "Dims d_n of each head's nope query/key (the value keeps head_dim). Default: head_dim - d_r where d_r <= "
        "head_dim/2 with merged pairs (query/key as wide as the source's: attention costs what the source's does; "
        "the score energy kept per layer is in provenance.json), else head_dim."))
    # rope.STRATEGIES; the flag's None tells the --target deepseek resolution (conversion.target) that it was not given
    rope_strategy: str = option("attention", "--rope-strategy", cli_default=None, why="closed-form-options",
                                choices=("high", "low", "uniform", "2-norm", "attention"), help=(
        "Which frequency pairs keep RoPE: high, low, uniform, 2-norm or attention (the pairs whose score would suffer "
        "most under the calibration attention). Default: attention (2-norm without calibration text; "
        "docs/decisions.md#closed-form-options); with --target deepseek high, the fastest pairs (uniform when those do "
        "not fit)."))
    rope_merge: bool = option(True, "--rope-merge/--no-rope-merge", why="closed-form-options", help=(
        "Merge RoPE pairs across kv heads (PCA per frequency)."))
    factorization: str = option("joint", "--factorization", choices=("joint", "split"),
                                why="factorization-and-method", help="joint (K and V share the latent) or split.")
    method: str = option("activation", "--method", choices=("weight", "activation"),  # lowrank.METHODS
                         why="factorization-and-method",
                         help="activation (whitened by calibration inputs) or weight (plain SVD).")
    # kv: error in K/V; attention: keys by query-key score error, values by error after o_proj; scores: keys by score
    # error, values by their own (lowrank.OBJECTIVES)
    objective: str = option("kv", "--objective", choices=("kv", "attention", "scores"), cli_default=None,
                            why="closed-form-options", help=(
        "What the low-rank factorization keeps: kv (K/V outputs), attention (keys by their query-key score error, "
        "values by their error after o_proj) or scores (keys by score error, values by their own). Default: kv "
        "(docs/decisions.md#closed-form-options)."))
    kv_balance: float | None = option(1.0, "--kv-balance", cli_default=None, cli_type=Optional[str], parse=_balance,
                                      check=_kv_balance, why="closed-form-options", help=(
        "Scale the key block so its energy is this multiple of the value block's before a joint factorization; none: "
        "no scaling (keys and values as the source makes them). Default: 1 (balanced)."))
    dropped_rope: str = option("expected", "--dropped-rope", choices=("unrotated", "expected"), cli_default=None,
                               why="closed-form-options", help=(
        "Pairs that lose RoPE: unrotated (plain nope dims) or expected (the query keeps the rotation expected under "
        "the head's calibration attention over distances). Default: expected (unrotated without calibration text)."))
    # files/datasets and their weights: mla_convert.calibration; None: weight-only statistics
    calib_data: str | None = option("self", "--calib-data", cli_default=None, cli_type=Optional[list[str]],
                                    parse=_calib_data, show_default=False, why="calibration-text", help=(
        "Calibration text: 'self' (text sampled from the source itself, seeded and cached: no data set needed; chat "
        "answers through its chat template), 'self-doc' (sampled documents, one unbroken document per window, from "
        "the BOS token), a local .txt/.raw/.tokens/.jsonl file or a datasets name[:config[:split]]; 'none' for "
        "weight-only statistics. Mix several with weights: repeat the option or join with commas, each NAME or "
        "NAME:WEIGHT (e.g. --calib-data wiki.valid.tokens:0.5 --calib-data self:0.5; the windows are shared by "
        "weight). Never the text you evaluate on. Default: self."))
    # None: conversion.plan.default_calib_samples of the share of the source's cache kept; the refinement trains on
    # the first refine_seq_len tokens of all but one window
    calib_samples: int | None = option(None, "--calib-samples", check=_calib_samples, show_default=False,
                                       why="calibration-windows", help=(
        f"Calibration windows. Default: {policy.rule_text(policy.CALIB_SAMPLES)} "
        "(docs/decisions.md#calibration-windows)."))
    # as long as the evaluation windows: the attention profiles see those distances
    calib_seq_len: int = option(2048, "--calib-seq-len", check=_calib_seq_len, why="calibration-windows", help=(
        "Tokens per calibration window (the attention profiles see distances up to this; match the contexts you "
        "serve)."))
    # 0: the windows as the text gives them (why: docs/decisions.md#calibration-windows)
    calib_echo: float = option(0.0, "--calib-echo", check=_calib_echo, why="calibration-windows", help=(
        "Share of each calibration window whose last tokens repeat a span from earlier in the same window (0 to 0.5), "
        "so that the statistics and the refinement see the source copy text from far back, as it does when a long "
        "prompt is asked about. Default: 0."))
    # None: selftext.calib_temperature of the share of the cache kept, resolved by conversion.pipeline.make_plan
    # (docs/decisions.md#self-text-temperature-length-and-batch)
    calib_temperature: float | None = option(None, "--calib-temperature", check=_positive_finite, show_default=False,
                                             why="self-text-temperature-length-and-batch", help=(
        "Sampling temperature of the 'self' and 'self-doc' calibration text (above 1: more varied text). Default: "
        f"{policy.rule_text(policy.CALIB_TEMPERATURE)} (docs/decisions.md#self-text-temperature-length-and-batch)."))
    calib_sample_tokens: int = option(256, "--calib-sample-tokens", check=_positive,
                                      why="self-text-temperature-length-and-batch", help=(
        "New tokens at most per sampled 'self' answer (an answer ends earlier at its EOS; a 'self-doc' document "
        "fills a window)."))
    calib_propagate: str = option("source", "--calib-propagate", choices=("source", "converted"),
                                  why="calibration-stream", help=(
        "Later layers calibrate (and refine) on the source's (source) or the converted earlier layers' activations "
        "(converted: each layer fit to do what the source layer does with the inputs it will see)."))
    # None: energy with calibration text, else uniform (options.resolve_allocation): docs/decisions.md#rank-allocation
    rank_allocation: str | None = option(None, "--rank-allocation", choices=("uniform", "energy"),
                                         why="rank-allocation", help=(
        "uniform: every layer gets the same latent dims. energy: the same total, shared among layers by their "
        "calibrated spectra (relative error removed per dim; per-layer kv_lora_rank, none above the vLLM MLA width "
        "the uniform rank needs). Default: energy (uniform without calibration text or with --target deepseek)."))
    value_inputs: str = option("attended", "--value-inputs", choices=("token", "attended"),
                               why="closed-form-options", help=(
        "attended (default): the value up-projection fits values on the attention-averaged inputs they are consumed "
        "through (calibrated). token: per token, as keys."))
    key_inputs: str = option("attended", "--key-inputs", choices=("token", "attended"), why="closed-form-options",
                             help=(
        "attended (default): each calibration token counts by the attention its key receives (calibrated). token: "
        "every token alike."))
    latent_rounds: int = option(0, "--latent-rounds", check=_non_negative, why="closed-form-options", help=(
        "With --value-inputs attended: rounds of refining the shared latent so that keys (on token inputs) and "
        "values (on attended inputs) are both fit (0: only the value up-projection is refit)."))
    # None: auto (refine.resolve_steps), resolved by conversion.pipeline.make_plan so that provenance records the number
    # that ran
    refine_steps: int | None = option(None, "--refine-steps", cli_default="auto", cli_type=Optional[str],
                                      parse=_steps, check=_non_negative, why="refinement-steps-rate-and-window", help=(
        "After the factorization, train each converted layer this many Adam steps so that its outputs match the "
        "source's on the calibration text (real softmax and RoPE; kept only where a held-out calibration sequence "
        f"improves). auto (default): on a GPU {policy.rule_text(policy.REFINE_STEPS)}; on the CPU "
        f"{policy.rule_text(policy.REFINE_STEPS_CPU)} at --refine-queries positions a step (a GPU's at every "
        "position), when the plan estimates at most 1.5 h; 0: off "
        "(docs/decisions.md#refinement-steps-rate-and-window)."))
    refine_lr: float = option(1e-3, "--refine-lr", check=_positive, why="refinement-steps-rate-and-window",
                              help="Learning rate of --refine-steps (Adam, cosine).")
    # each step trains on refine.STEP_TOKENS tokens
    refine_seq_len: int = option(2048, "--refine-seq-len", check=_refine_seq_len,
                                 why="refinement-steps-rate-and-window", help=(
        "Tokens per refinement window, from each calibration sequence's start (at most --calib-seq-len); each step "
        "trains on 2048 tokens (one window of 2048, two of 1024)."))
    # refine.layer_update_at; its cost and quality: docs/decisions.md#refinement-on-a-cpu-positions-and-steps
    refine_queries: int | None = option(None, "--refine-queries", cli_default="auto", cli_type=Optional[str],
                                        parse=_count, check=_non_negative,
                                        why="refinement-on-a-cpu-positions-and-steps", help=(
        "Positions of each refinement window a step takes the whole layer's loss at (random each step; every key of "
        "the window is still formed and attended to): fewer cost less a step and refine less. auto (default): on the "
        f"CPU {policy.rule_text(policy.REFINE_QUERIES_CPU)}; on a GPU 0; 0: every position."))
    # conversion.workers; measured: docs/decisions.md#refinement-workers
    refine_workers: int | None = option(None, "--refine-workers", cli_default="auto", cli_type=Optional[str],
                                        parse=_processes, check=_at_least_one, why="refinement-workers", help=(
        "Processes that refine layers at once, each with its share of the CPU threads (on the source's calibration "
        "stream the layers are independent). auto (default): 2 on a CPU with 2 or more threads where the refinement "
        "is estimated at 2 minutes or more, else 1 (on a GPU, with --calib-propagate converted); 1: one layer at a "
        "time in the conversion's own process."))
    # refine.SCOPES; docs/decisions.md#refinement-scope-and-the-mlps-rate
    refine_scope: str = option("layer", "--refine-scope", choices=("attention", "layer"),
                               why="refinement-scope-and-the-mlps-rate", help=(
        "What --refine-steps trains: layer (default: the whole decoder layer, MLP and norms too, to what the source "
        "layer adds to the residual stream) or attention (the converted attention, to the source attention's "
        "outputs; about half the refinement time)."))
    refine_mlp_lr_scale: float = option(1.0, "--refine-mlp-lr-scale", check=_non_negative,
                                        why="refinement-scope-and-the-mlps-rate", help=(
        "With --refine-scope layer: the learning rate of the MLP and norms, as a multiple of --refine-lr (0: the "
        "attention alone trains, to the whole layer's target)."))
    # the model stage (refine.refine_model); None: auto (refine.resolve_model_steps), resolved by make_plan
    refine_model_steps: int | None = option(None, "--refine-model-steps", cli_default="auto", cli_type=Optional[str],
                                            parse=_steps, check=_non_negative, why="the-model-stage", help=(
        "The model stage, after the layers: train every converted attention this many Adam steps end to end so that "
        "the model's next-token distributions match the source's on the calibration windows (KL; one window held out "
        "and checked 8 times, the best weights seen kept). Holds the whole model in memory. auto (default): 64 on a "
        f"GPU; on the CPU {policy.rule_text(policy.MODEL_STEPS_CPU)}, when the plan estimates at most 30 min and half "
        "the machine's memory; 0: off (docs/decisions.md#the-model-stage)."))
    # None: auto (refine.resolve_model_lr), resolved by make_plan
    refine_model_lr: float | None = option(None, "--refine-model-lr", cli_default="auto", cli_type=Optional[str],
                                           parse=_rate, check=_positive_finite, why="the-model-stage", help=(
        "Learning rate of --refine-model-steps (Adam, warmup then cosine). auto (default): 1e-4 for 64 steps or "
        "more, 2e-4 for fewer."))
    refine_model_scope: str = option("attention", "--refine-model-scope", choices=("attention", "layer"),
                                     why="the-model-stage", help=(  # refine.MODEL_SCOPES
        "What --refine-model-steps trains: attention (default: every converted attention) or layer (every decoder "
        "layer whole: attention, MLP and norms)."))
    # auto: resolved by make_plan (refine.resolve_precision); refine.PRECISIONS; docs/decisions.md#refinement-precision
    refine_precision: str = option("auto", "--refine-precision", choices=("auto", "float32", "bfloat16"),
                                   why="refinement-precision", help=(
        "What the training steps of --refine-steps and --refine-model-steps compute in: auto (default: bfloat16 on "
        "CPUs with AVX512-BF16 or AMX for models of hidden size 256 or more, float32 elsewhere and on GPUs), "
        "float32, or bfloat16 (autocast). Weights, targets and held-out checks stay float32 "
        "(docs/decisions.md#refinement-precision)."))
    seed: int = option(0, "--seed", why="defaults-no-measurement-chose", help="Seed for calibration sampling.")
    # auto is resolved by the CLI (conversion.pipeline.resolve_device): provenance records the device that ran
    device: str = option("cpu", "--device", why="defaults-no-measurement-chose", help=(
        "Where each layer's calibration and factorization run: cpu, cuda, cuda:N or auto (cuda when available). "
        "Layers stream one at a time either way; the checkpoint is written from the CPU."))
    # None: the source's (float32 for GGUF); dtypes.DTYPES
    dtype: str | None = option(None, "--dtype", choices=("float32", "bfloat16", "float16"),
                               why="defaults-no-measurement-chose",
                               help="Output dtype: float32, bfloat16 or float16. Default: the source's.")
    force: bool = option(False, "--force", help=(
        "Convert even when the MLA cache is not smaller than the source's (no saving)."))
    # ignored for sources without per-head q/k norms
    qk_norm: str = option("exact", "--qk-norm", choices=("exact", "calibrated"), why="qwen3s-key-norm", help=(
        "Sources with per-head q/k RMS norms (Qwen3): exact (the key is normalized per token at attention time: "
        "exact at full rank, expanded attention every step) or calibrated (the key's RMS replaced by its calibration "
        "RMS per layer and kv group: plain MLA keys, absorbed decode, an approximation; benchmarks/qwen3/README.md). "
        "Default: exact. Ignored for other sources."))


# ----------------------------------------------------------------------------------------- the command line's own


@dataclass
class CommandLine:
    """The convert commands' own options, beside the conversion's (not recorded in provenance.json): where the result
    goes and in what form. The commands take `output` first, then every `ConvertOptions` option, then the rest."""

    output: Path | None = option(None, "--output", "-o", help="Output folder (must not exist or be empty).")
    revision: str | None = option(None, "--revision", help="Hub revision when MODEL is a hub id.")
    overwrite: bool = option(False, "--overwrite", help="Replace a non-empty output folder.")
    dry_run: bool = option(False, "--dry-run", help="Print the plan (shapes, cache sizes, memory) only.")
    # checked by cli.convert.resolve_target
    target: str | None = option(None, "--target", why="defaults-no-measurement-chose", help=(
        "native: any options. deepseek: choose (or refuse) options up front so the result exports exactly to stock "
        "DeepSeek-V3 (one geometric RoPE frequency set: --rope-strategy uniform/high, merged across kv heads); warns "
        "when vLLM/FlashMLA kernels will not take the layout. Default: --format's."))
    format: str = option("native", "--format", why="defaults-no-measurement-chose", help=(
        "native: write the MLA checkpoint to OUT. deepseek: implies --target deepseek; write the native checkpoint "
        "to OUT-native and its verified DeepSeek-V3 export (for vLLM/SGLang, docs/serving.md) to OUT. gguf: implies "
        "--target deepseek; OUT is NAME.gguf (f32, for llama.cpp), the native checkpoint goes to NAME-native."))


CONVERSION = options_of(ConvertOptions)  # the fields of ConvertOptions, in order
_OWN = options_of(CommandLine, cli_only=True)
# the convert commands' options, in --help's order
OPTIONS: tuple[Option, ...] = (_OWN[0], *(o for o in CONVERSION if not o.library_only), *_OWN[1:])
BY_NAME = {o.name: o for o in (*CONVERSION, *_OWN)}
DEFAULTS = {o.name: o.default for o in CONVERSION}


def choices(name: str) -> tuple[str, ...]:
    return BY_NAME[name].choices


# ------------------------------------------------------------------------------------------- rules between options

# (broken when, the error line formatted with the options as `o`): checks of options together that need no source.
# Checks against the source's config (ranks, rope and nope dims, q/k norms) stay in conversion.plan.make_geometry.
RULES: tuple[tuple[Callable[[Any], bool], str], ...] = (
    (lambda o: sum(v is not None for v in (o.rank, o.kv_budget, o.kv_bytes)) > 1,
     "give one of --rank (latent dims), --kv-budget (cache per token per layer) or --kv-bytes (bytes per token), "
     "not more"),
    (lambda o: o.rank is None and o.kv_budget is None and o.kv_bytes is None,
     "give --rank (latent dims), --kv-budget (elements per token per layer, or a fraction) or --kv-bytes (bytes per "
     "token, or a fraction of the source's)"),
    (lambda o: o.calib_data is None and o.objective != "kv",
     "--objective {o.objective} needs calibration text: pass --calib-data FILE or --objective kv"),
    (lambda o: o.latent_rounds and (o.value_inputs != "attended" or o.factorization != "joint"),
     "--latent-rounds refines a joint latent for attended values: use it with --value-inputs attended and "
     "--factorization joint (or drop it)"),
    (lambda o: o.refine_steps and o.calib_data is None,
     "--refine-steps trains each layer on calibration text: pass --calib-data (or --refine-steps 0)"),
    (lambda o: o.calib_echo and o.calib_data is None,
     "--calib-echo repeats spans of the calibration windows: pass --calib-data (or drop --calib-echo)"),
    (lambda o: o.refine_model_steps and o.calib_data is None,
     "--refine-model-steps trains on calibration text: pass --calib-data (or --refine-model-steps 0)"),
    (lambda o: (o.refine_workers or 1) > 1 and not o.device.startswith("cpu"),
     "--refine-workers {o.refine_workers} refines layers in CPU processes; on --device {o.device} they refine one at "
     "a time: drop --refine-workers (or pass 1)"),
    (lambda o: (o.refine_workers or 1) > 1 and o.calib_propagate != "source",
     "--refine-workers {o.refine_workers} refines layers at once, which needs each layer's inputs from the source's "
     "stream: use --calib-propagate source (or --refine-workers 1)"),
    (lambda o: o.refine_model_steps and o.calib_propagate != "source",
     "--refine-model-steps distils the source's outputs on the calibration stream, which --calib-propagate converted "
     "does not carry: use --calib-propagate source (or --refine-model-steps 0)"),
)


def check_options(options) -> None:
    """Raise a UserError naming the flag and the fix for the first option whose value is wrong on its own, then for
    the first broken rule between options (`RULES`)."""
    for option in CONVERSION:
        line = option.error(getattr(options, option.name))
        if line is not None:
            raise UserError(line)
    for broken, line in RULES:
        if broken(options):
            raise UserError(line.format(o=options))


# ------------------------------------------------------------------------------------------------ the reference page


def _default_text(o: Option) -> str:
    if o.type is bool and o.flags:
        pair = o.flags[0].split("/")
        return f"`{pair[0] if o.default else pair[1]}`" if len(pair) == 2 else "off"
    value = o.default if o.flag_default is None else o.flag_default
    if value is None:
        return "see description" if "Default" in o.help else "none"
    return f"`{value}`"


def markdown() -> str:
    """docs/options.md: the reference of the convert commands' options and the library's, made from `ConvertOptions`
    and `CommandLine` (`OPTIONS`, then any library-only option)."""
    lines = [
        "# Conversion options",
        "",
        "The options of `mla-convert convert` and of the per-family commands (`llama`, `qwen`, `phi3`, `gemma`, "
        "`olmo2`), which share them. The library takes the same options as `mla_convert.convert.ConvertOptions` "
        "fields (the names below; `cli only` marks the command line's own). Every command also takes `-v`/`--verbose` "
        "and `-q`/`--quiet`.",
        "",
        "Generated from `mla_convert/schema.py` by `python -m mla_convert.schema --markdown > "
        "docs/options.md`; do not edit by hand (tests/test_options.py checks it is current).",
        "",
        "| Option | Field | Default | Values | Description |",
        "|---|---|---|---|---|",
    ]
    for o in (*OPTIONS, *(o for o in CONVERSION if o.library_only)):
        flags = ", ".join(f"`{f}`" for f in o.flags) or "library only"
        values = ", ".join(o.choices) if o.choices else {bool: "flag", Path: "path", str: "text"}.get(o.type,
                                                                                                    o.type.__name__)
        values = f"auto, {values}" if o.parse is _steps else values
        name = "cli only" if o.cli_only else f"`{o.name}`"
        default = _default_text(o) + (f" ([why](decisions.md#{o.why}))" if o.why else "")
        lines.append(f"| {flags} | {name} | {default} | {values} | {o.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m mla_convert.schema --markdown")
    sys.stdout.write(markdown())
