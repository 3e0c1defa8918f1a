"""The `mla-convert export`, `finetune` and `push` commands."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from mla_convert.cli.base import QuietOpt, VerboseOpt, app, friendly, setup_logging
from mla_convert.errors import UserError


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
        "none", "--pad-latent", help="none, vllm (kv_lora_rank + rope dims = 320 or 576), flashmla (512 + 64) or "
        "llamacpp (kv_lora_rank + rope dims a multiple of 64, whole steps of llama.cpp's CPU dot product): exact zero "
        "padding to a layout the engines' MLA kernels take faster or at all; the cache grows."
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
    setup_logging(verbose, quiet)
    from mla_convert.export import ExportOptions, export, report_export

    if format == "gguf":
        from mla_convert.export.gguf import export_gguf, report_gguf

        given = {"--dtype": dtype != "auto", "--allow-approx": allow_approx, "--drop-biases": drop_biases,
                 "--keep-biases": keep_biases}
        if any(given.values()):
            raise UserError(f"{', '.join(k for k, v in given.items() if v)} apply to --format deepseek; the GGUF "
                            "export is exact or refused (types: --gguf-type)")
        report_gguf(export_gguf(model, output, gguf_type, overwrite=overwrite, pad_latent=pad_latent), output,
                    typer.echo)
        return

    options = ExportOptions(
        format=format, dtype=dtype, allow_approx=allow_approx, drop_biases=drop_biases, keep_biases=keep_biases, pad_latent=pad_latent,
        verify=verify,
    )  # fmt: skip
    report_export(export(model, output, options, overwrite=overwrite), output, typer.echo)


@app.command("rebase")
@friendly
def rebase_command(
    model: Path = typer.Argument(..., help="A native MLA checkpoint folder (the output of `mla-convert llama`)."),
    output: Path = typer.Option(..., "-o", "--output", help="Folder to write the re-based checkpoint to."),
    basis: str = typer.Option(
        "balanced", "--basis", help="balanced (the latent's spread and its error's cost made equal, then rotated: "
        "what 4-bit cache blocks hold best), rotation (a seeded random rotation) or native (a copy)."
    ),
    calib_data: str = typer.Option(
        "self", "--calib-data", help="Text the balanced basis is fitted on, as for a conversion (default: self, the "
        "text the conversion sampled from its source)."
    ),
    calib_samples: int = typer.Option(4, "--calib-samples", help="Windows of calibration text."),
    calib_seq_len: int = typer.Option(2048, "--calib-seq-len", help="Tokens per calibration window."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output folder mla-convert wrote."),
    verbose: int = VerboseOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Store a converted model's latent in a basis block-quantized caches hold well (llama.cpp's --cache-type-k q4_0,
    `eval --cache-type`): the same model in 32-bit arithmetic, the change measured and recorded."""
    setup_logging(verbose, quiet)
    from mla_convert.rebase import rebase_checkpoint

    record = rebase_checkpoint(model, output, basis, calib_data, calib_samples, calib_seq_len, overwrite)
    typer.echo(f"wrote {output}: latent basis {basis} (largest logit change {record['max_rel_logit_change']:.2e} of "
               f"the largest logit); serve it with a quantized cache, e.g. `mla-convert eval {output} --cache-type "
               f"q4_0`, or export it (`mla-convert export {output} --format gguf`) for llama.cpp's --cache-type-k")


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
    setup_logging(max(verbose, 1), quiet)
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
    setup_logging(verbose, quiet)
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

