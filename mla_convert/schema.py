"""The conversion's options, declared once: name, type, default, help, choices, flags and check.

From this table come `ConvertOptions` (the library's options, recorded in provenance.json: its fields are the entries
that are not `cli_only`, in this order), the options of the convert commands (`mla-convert convert|llama|qwen|...`,
mla_convert/cli/convert.py), their single-option checks (`check_options`, called by `make_plan`), and the option
reference docs/options.md (`python -m mla_convert.schema --markdown`). Adding an option is one entry here;
what the option does is then the pipeline's business.

This module imports no torch (the CLI builds its options from it before any model code loads). The defaults chosen
by measurement say why in one line and point into docs/decisions.md; each option with a default names its record there
(`Option.why`), which docs/options.md links.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from mla_convert import policy
from mla_convert.errors import UserError

_SAME = object()  # Option.cli_default: the flag's default is the library's


@dataclass(frozen=True)
class Option:
    name: str  # the ConvertOptions field (and the CLI parameter)
    type: type  # the value's type: int, float, str, bool (Path for an output)
    default: Any  # the library's default (ConvertOptions); None: resolved later (see the help)
    flags: tuple[str, ...]  # the CLI's spellings; a bool's "--x/--no-x" pair is one string
    help: str
    choices: tuple[str, ...] | None = None
    nullable: bool = False  # None is a value (not given: a default resolved from other options or the source)
    check: Callable[[Option, Any], str | None] | None = None  # beyond the choices: the error line, or None when fine
    cli_default: Any = _SAME  # what the flag holds when not given, where that differs from `default`
    cli_type: Any = None  # the flag's annotation, where it differs from `type` (text such as `auto` or a list)
    parse: Callable[[Option, Any], Any] | None = None  # the flag's value -> the option's (raises UserError)
    show_default: bool = True  # whether --help shows "[default: ...]"
    cli_only: bool = False  # a flag of the convert commands that is no conversion option (output, target, ...)
    why: str | None = None  # the docs/decisions.md record of the default (its anchor), linked from docs/options.md

    @property
    def flag(self) -> str:
        return self.flags[0].split("/")[0]

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


# -------------------------------------------------------------------------------------------------------- the table

OPTIONS: tuple[Option, ...] = (
    Option("output", Path, None, ("--output", "-o"), "Output folder (must not exist or be empty).", cli_only=True),
    Option("rank", int, None, ("--rank", "-r"), "Latent dims d_c cached per token per layer.", nullable=True),
    Option("kv_budget", float, None, ("--kv-budget",), "Instead of --rank: cache elements per token per layer "
           "(d_c + d_r), or a fraction <= 1 of the source's cache (e.g. 0.25).", nullable=True, check=_kv_budget),
    # None: conversion.plan.default_rope_dims (docs/decisions.md#rope-key-width)
    Option("rope_dims", int, None, ("--rope-dims",), "Dims d_r of the shared RoPE key (even). Default: a third of "
           "--kv-budget, at most three quarters of head_dim (with --target deepseek half of it as a power of "
           "two, up to all of head_dim), and at most 64, the rope width vLLM's MLA kernels take; head_dim/2 (same caps) with --rank.", nullable=True,
           why="rope-key-width"),
    # None: conversion.plan.default_nope_dims (docs/decisions.md#nope-key-width)
    Option("nope_dims", int, None, ("--nope-dims",), "Dims d_n of each head's nope query/key (the value keeps "
           "head_dim). Default: head_dim - d_r where d_r <= head_dim/2 with merged pairs (query/key as wide as the "
           "source's: attention costs what the source's does; the score energy kept per layer is in "
           "provenance.json), else head_dim.", nullable=True, why="nope-key-width"),
    # the flag's None tells the --target deepseek resolution (conversion.target) that it was not given
    Option("rope_strategy", str, "attention", ("--rope-strategy",), "Which frequency pairs keep RoPE: high, low, "
           "uniform, 2-norm or attention (the pairs whose score would suffer most under the calibration attention). "
           "Default: attention (2-norm without calibration text; docs/decisions.md#closed-form-options); with "
           "--target deepseek high, the fastest pairs (uniform when those do not fit).",
           choices=("high", "low", "uniform", "2-norm", "attention"), cli_default=None,
           why="closed-form-options"),  # rope.STRATEGIES
    Option("rope_merge", bool, True, ("--rope-merge/--no-rope-merge",), "Merge RoPE pairs across kv heads (PCA per "
           "frequency).", why="closed-form-options"),
    Option("factorization", str, "joint", ("--factorization",), "joint (K and V share the latent) or split.",
           choices=("joint", "split"), why="factorization-and-method"),
    Option("method", str, "activation", ("--method",), "activation (whitened by calibration inputs) or weight (plain "
           "SVD).", choices=("weight", "activation"), why="factorization-and-method"),  # lowrank.METHODS
    # kv: error in K/V; attention: keys by query-key score error, values by error after o_proj; scores: keys by score
    # error, values by their own (lowrank.OBJECTIVES)
    Option("objective", str, "kv", ("--objective",), "What the low-rank factorization keeps: kv (K/V outputs), "
           "attention (keys by their query-key score error, values by their error after o_proj) or scores (keys by "
           "score error, values by their own). Default: kv (docs/decisions.md#closed-form-options).",
           choices=("kv", "attention", "scores"), cli_default=None, why="closed-form-options"),
    Option("kv_balance", float, 1.0, ("--kv-balance",), "Scale the key block so its energy is this multiple of the "
           "value block's before a joint factorization; none: no scaling (keys and values as the source makes them). "
           "Default: 1 (balanced).", nullable=True, cli_default=None, cli_type=Optional[str], parse=_balance,
           check=_kv_balance, why="closed-form-options"),
    Option("dropped_rope", str, "expected", ("--dropped-rope",), "Pairs that lose RoPE: unrotated (plain nope dims) or "
           "expected (the query keeps the rotation expected under the head's calibration attention over distances). "
           "Default: expected (unrotated without calibration text).", choices=("unrotated", "expected"),
           cli_default=None, why="closed-form-options"),
    # files/datasets and their weights: mla_convert.calibration; None: weight-only statistics
    Option("calib_data", str, "self", ("--calib-data",), "Calibration text: 'self' (text sampled from the source "
           "itself, seeded and cached: no data set needed; chat answers through its chat template), 'self-doc' "
           "(sampled documents, one unbroken document per window, from the BOS token), a local "
           ".txt/.raw/.tokens/.jsonl file or a datasets name[:config[:split]]; 'none' for weight-only statistics. Mix "
           "several with weights: repeat the option or join with commas, each NAME or NAME:WEIGHT (e.g. --calib-data "
           "wiki.valid.tokens:0.5 --calib-data self:0.5; the windows are shared by weight). Never the text you "
           "evaluate on. Default: self.", nullable=True, cli_default=None, cli_type=Optional[list[str]],
           parse=_calib_data, show_default=False, why="calibration-text"),
    # None: conversion.plan.default_calib_samples of the share of the source's cache kept; the refinement trains on
    # the first refine_seq_len tokens of all but one window
    Option("calib_samples", int, None, ("--calib-samples",), "Calibration windows. Default: "
           f"{policy.rule_text(policy.CALIB_SAMPLES)} (docs/decisions.md#calibration-windows).", nullable=True,
           check=_calib_samples, show_default=False, why="calibration-windows"),
    # as long as the evaluation windows: the attention profiles see those distances
    Option("calib_seq_len", int, 2048, ("--calib-seq-len",), "Tokens per calibration window (the attention profiles "
           "see distances up to this; match the contexts you serve).", check=_calib_seq_len, why="calibration-windows"),
    # None: selftext.calib_temperature of the share of the cache kept, resolved in `convert`
    # (docs/decisions.md#self-text-temperature-length-and-batch)
    Option("calib_temperature", float, None, ("--calib-temperature",), "Sampling temperature of the 'self' and "
           "'self-doc' calibration text (above 1: more varied text). Default: "
           f"{policy.rule_text(policy.CALIB_TEMPERATURE)} (docs/decisions.md#self-text-temperature-length-and-batch).", nullable=True,
           check=_positive_finite, show_default=False, why="self-text-temperature-length-and-batch"),
    Option("calib_sample_tokens", int, 256, ("--calib-sample-tokens",), "New tokens at most per sampled 'self' answer "
           "(an answer ends earlier at its EOS; a 'self-doc' document fills a window).", check=_positive,
           why="self-text-temperature-length-and-batch"),
    Option("calib_propagate", str, "source", ("--calib-propagate",), "Later layers calibrate (and refine) on the "
           "source's (source) or the converted earlier layers' activations (converted: each layer fit to do what the "
           "source layer does with the inputs it will see).", choices=("source", "converted"),
           why="calibration-stream"),
    # None: energy with calibration text, else uniform (options.resolve_allocation): docs/decisions.md#rank-allocation
    Option("rank_allocation", str, None, ("--rank-allocation",), "uniform: every layer gets the same latent dims. "
           "energy: the same total, shared among layers by their calibrated spectra (relative error removed per dim; "
           "per-layer kv_lora_rank, none above the vLLM MLA width the uniform rank needs). Default: energy (uniform "
           "without calibration text or with --target deepseek).", choices=("uniform", "energy"), nullable=True,
           why="rank-allocation"),
    Option("value_inputs", str, "attended", ("--value-inputs",), "attended (default): the value up-projection fits "
           "values on the attention-averaged inputs they are consumed through (calibrated). token: per token, as keys.",
           choices=("token", "attended"), why="closed-form-options"),
    Option("key_inputs", str, "attended", ("--key-inputs",), "attended (default): each calibration token counts by the "
           "attention its key receives (calibrated). token: every token alike.", choices=("token", "attended"),
           why="closed-form-options"),
    Option("latent_rounds", int, 0, ("--latent-rounds",), "With --value-inputs attended: rounds of refining the shared "
           "latent so that keys (on token inputs) and values (on attended inputs) are both fit (0: only the value "
           "up-projection is refit).", check=_non_negative, why="closed-form-options"),
    # None: auto (refine.resolve_steps), resolved in `convert` so that provenance records the number that ran
    Option("refine_steps", int, None, ("--refine-steps",), "After the factorization, train each converted layer this "
           "many Adam steps so that its outputs match the source's on the calibration text (real softmax and RoPE; "
           "kept only where a held-out calibration sequence improves). auto (default): on a GPU "
           f"{policy.rule_text(policy.REFINE_STEPS)}; on the CPU {policy.rule_text(policy.REFINE_STEPS_CPU)} at "
           "--refine-queries positions a step (a GPU's at every position), when the plan estimates at most 1.5 h; 0: "
           "off (docs/decisions.md#refinement-steps-rate-and-window).", nullable=True, cli_default="auto",
           cli_type=Optional[str], parse=_steps, check=_non_negative, why="refinement-steps-rate-and-window"),
    Option("refine_lr", float, 1e-3, ("--refine-lr",), "Learning rate of --refine-steps (Adam, cosine).",
           check=_positive, why="refinement-steps-rate-and-window"),
    # each step trains on refine.STEP_TOKENS tokens
    Option("refine_seq_len", int, 2048, ("--refine-seq-len",), "Tokens per refinement window, from each calibration "
           "sequence's start (at most --calib-seq-len); each step trains on 2048 tokens (one window of 2048, two of "
           "1024).", check=_refine_seq_len, why="refinement-steps-rate-and-window"),
    # refine.layer_update_at; its cost and quality: docs/decisions.md#refinement-on-a-cpu-positions-and-steps
    Option("refine_queries", int, None, ("--refine-queries",), "Positions of each refinement window a step takes the "
           "whole layer's loss at (random each step; every key of the window is still formed and attended to): "
           "fewer cost less a step and refine less. auto (default): on the CPU "
           f"{policy.rule_text(policy.REFINE_QUERIES_CPU)}; on a GPU 0; 0: every position.", nullable=True,
           cli_default="auto", cli_type=Optional[str], parse=_count, check=_non_negative,
           why="refinement-on-a-cpu-positions-and-steps"),
    # conversion.workers; measured: docs/decisions.md#refinement-workers
    Option("refine_workers", int, None, ("--refine-workers",), "Processes that refine layers at once, each with its "
           "share of the CPU threads (on the source's calibration stream the layers are independent). auto "
           "(default): 2 on a CPU with 2 or more threads where the refinement is estimated at 2 minutes or more, else "
           "1 (on a GPU, with --calib-propagate converted); 1: one layer at a time in the conversion's own process.", nullable=True, cli_default="auto",
           cli_type=Optional[str], parse=_processes, check=_at_least_one, why="refinement-workers"),
    # docs/decisions.md#refinement-scope-and-the-mlps-rate
    Option("refine_scope", str, "layer", ("--refine-scope",), "What --refine-steps trains: layer (default: the whole "
           "decoder layer, MLP and norms too, to what the source layer adds to the residual stream) or attention (the "
           "converted attention, to the source attention's outputs; about half the refinement time).",
           choices=("attention", "layer"), why="refinement-scope-and-the-mlps-rate"),  # refine.SCOPES
    Option("refine_mlp_lr_scale", float, 1.0, ("--refine-mlp-lr-scale",), "With --refine-scope layer: the learning "
           "rate of the MLP and norms, as a multiple of --refine-lr (0: the attention alone trains, to the whole "
           "layer's target).", check=_non_negative, why="refinement-scope-and-the-mlps-rate"),
    # the model stage (refine.refine_model); None: auto (refine.resolve_model_steps), resolved in `convert`
    Option("refine_model_steps", int, None, ("--refine-model-steps",), "The model stage, after the layers: train every "
           "converted attention this many Adam steps end to end so that the model's next-token distributions match "
           "the source's on the calibration windows (KL; one window held out and checked 8 times, the best weights "
           "seen kept). Holds the whole model in memory. auto (default): 64 on a GPU; on the CPU "
           f"{policy.rule_text(policy.MODEL_STEPS_CPU)}, when the plan estimates at most 30 min and half the "
           "machine's memory; 0: off (docs/decisions.md#the-model-stage).",
           nullable=True, cli_default="auto", cli_type=Optional[str], parse=_steps, check=_non_negative,
           why="the-model-stage"),
    # None: auto (refine.resolve_model_lr), resolved in `convert`
    Option("refine_model_lr", float, None, ("--refine-model-lr",), "Learning rate of --refine-model-steps (Adam, "
           "warmup then cosine). auto (default): 1e-4 for 64 steps or more, 2e-4 for fewer.", nullable=True,
           cli_default="auto", cli_type=Optional[str], parse=_rate, check=_positive_finite, why="the-model-stage"),
    Option("refine_model_scope", str, "attention", ("--refine-model-scope",), "What --refine-model-steps trains: "
           "attention (default: every converted attention) or layer (every decoder layer whole: attention, MLP and "
           "norms).", choices=("attention", "layer"), why="the-model-stage"),  # refine.MODEL_SCOPES
    # auto: resolved in `convert` (refine.resolve_precision); docs/decisions.md#refinement-precision
    Option("refine_precision", str, "auto", ("--refine-precision",), "What the training steps of --refine-steps and "
           "--refine-model-steps compute in: auto (default: bfloat16 on CPUs with AVX512-BF16 or AMX for models of "
           "hidden size 256 or more, float32 elsewhere and on GPUs), float32, or bfloat16 (autocast). Weights, "
           "targets and held-out checks stay float32 (docs/decisions.md#refinement-precision).",
           choices=("auto", "float32", "bfloat16"), why="refinement-precision"),  # refine.PRECISIONS
    Option("seed", int, 0, ("--seed",), "Seed for calibration sampling.", why="defaults-no-measurement-chose"),
    # auto is resolved by the CLI (conversion.pipeline.resolve_device): provenance records the device that ran
    Option("device", str, "cpu", ("--device",), "Where each layer's calibration and factorization run: cpu, cuda, "
           "cuda:N or auto (cuda when available). Layers stream one at a time either way; the checkpoint is written "
           "from the CPU.", why="defaults-no-measurement-chose"),
    # None: the source's (float32 for GGUF)
    Option("dtype", str, None, ("--dtype",), "Output dtype: float32, bfloat16 or float16. Default: the source's.",
           choices=("float32", "bfloat16", "float16"), nullable=True,
           why="defaults-no-measurement-chose"),  # dtypes.DTYPES
    Option("revision", str, None, ("--revision",), "Hub revision when MODEL is a hub id.", cli_only=True),
    Option("overwrite", bool, False, ("--overwrite",), "Replace a non-empty output folder.", cli_only=True),
    Option("dry_run", bool, False, ("--dry-run",), "Print the plan (shapes, cache sizes, memory) only.", cli_only=True),
    Option("force", bool, False, ("--force",), "Convert even when the MLA cache is not smaller than the source's (no "
           "saving)."),
    # checked by export.driver.resolve_target
    Option("target", str, None, ("--target",), "native: any options. deepseek: choose (or refuse) options up front so "
           "the result exports exactly to stock DeepSeek-V3 (one geometric RoPE frequency set: --rope-strategy "
           "uniform/high, merged across kv heads); warns when vLLM/FlashMLA kernels will not take the layout. "
           "Default: --format's.", cli_only=True, why="defaults-no-measurement-chose"),
    Option("format", str, "native", ("--format",), "native: write the MLA checkpoint to OUT. deepseek: implies "
           "--target deepseek; write the native checkpoint to OUT-native and its verified DeepSeek-V3 export (for "
           "vLLM/SGLang, docs/serving.md) to OUT. gguf: implies --target deepseek; OUT is NAME.gguf (f32, for "
           "llama.cpp), the native checkpoint goes to NAME-native.", cli_only=True,
           why="defaults-no-measurement-chose"),
    # ignored for sources without per-head q/k norms
    Option("qk_norm", str, "exact", ("--qk-norm",), "Sources with per-head q/k RMS norms (Qwen3): exact (the key is "
           "normalized per token at attention time: exact at full rank, expanded attention every step) or calibrated "
           "(the key's RMS replaced by its calibration RMS per layer and kv group: plain MLA keys, absorbed decode, "
           "an approximation; benchmarks/qwen3/README.md). Default: exact. Ignored for other sources.",
           choices=("exact", "calibrated"), why="qwen3s-key-norm"),
)

BY_NAME = {o.name: o for o in OPTIONS}
CONVERSION = tuple(o for o in OPTIONS if not o.cli_only)  # the fields of ConvertOptions, in order
DEFAULTS = {o.name: o.default for o in CONVERSION}


def choices(name: str) -> tuple[str, ...]:
    return BY_NAME[name].choices


def dataclass_fields() -> list[tuple[str, Any, Any]]:
    """(name, type, default) of every conversion option, for `dataclasses.make_dataclass`."""
    import dataclasses

    return [(o.name, o.type | None if o.nullable or o.default is None else o.type, dataclasses.field(default=o.default))
            for o in CONVERSION]


# ------------------------------------------------------------------------------------------- rules between options

# (broken when, the error line formatted with the options as `o`): checks of options together that need no source.
# Checks against the source's config (ranks, rope and nope dims, q/k norms) stay in conversion.plan.make_plan.
RULES: tuple[tuple[Callable[[Any], bool], str], ...] = (
    (lambda o: o.rank is not None and o.kv_budget is not None,
     "give --rank (latent dims) or --kv-budget (cache per token per layer), not both"),
    (lambda o: o.rank is None and o.kv_budget is None,
     "give --rank (latent dims) or --kv-budget (elements per token per layer, or a fraction)"),
    (lambda o: o.calib_data is None and o.objective != "kv",
     "--objective {o.objective} needs calibration text: pass --calib-data FILE or --objective kv"),
    (lambda o: o.latent_rounds and (o.value_inputs != "attended" or o.factorization != "joint"),
     "--latent-rounds refines a joint latent for attended values: use it with --value-inputs attended and "
     "--factorization joint (or drop it)"),
    (lambda o: o.refine_steps and o.calib_data is None,
     "--refine-steps trains each layer on calibration text: pass --calib-data (or --refine-steps 0)"),
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


def _default_text(option: Option) -> str:
    if option.type is bool:
        pair = option.flags[0].split("/")
        return f"`{pair[0] if option.default else pair[1]}`" if len(pair) == 2 else "off"
    value = option.default if option.flag_default is None else option.flag_default
    if value is None:
        return "see description" if "Default" in option.help else "none"
    return f"`{value}`"


def markdown() -> str:
    """docs/options.md: the reference of the convert commands' options, made from `OPTIONS`."""
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
    for o in OPTIONS:
        flags = ", ".join(f"`{f}`" for f in o.flags)
        values = ", ".join(o.choices) if o.choices else {bool: "flag", Path: "path", str: "text"}.get(o.type, o.type.__name__)
        values = f"auto, {values}" if o.parse is _steps else values
        field = "cli only" if o.cli_only else f"`{o.name}`"
        default = _default_text(o) + (f" ([why](decisions.md#{o.why}))" if o.why else "")
        lines.append(f"| {flags} | {field} | {default} | {values} | {o.help.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m mla_convert.schema --markdown")
    sys.stdout.write(markdown())
