"""The `mla-convert eval` and `generate` commands."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Optional

import typer

from mla_convert.cli.base import QuietOpt, VerboseOpt, app, friendly, setup_logging
from mla_convert.errors import UserError
from mla_convert.writes import room_for

# vLLM's own KV-cache types (its --kv-cache-dtype) that `eval --engine vllm --cache-type` passes on
VLLM_CACHE_TYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


# ---------------------------------------------------------------------------------------------------------- eval

LongContextOpt = typer.Option(
    False, "--long-context", help="Measure long context instead: perplexity by position bucket over windows of the "
    "model's full context (--seq-len defaults to it), and a pass-key retrieval check on generated filler text "
    "(greedy answer, scored exactly); transformers or --engine llamacpp, the same prompts and token ids.")
LengthsOpt = typer.Option(None, "--lengths", help="With --long-context: retrieval prompt lengths in tokens, answer "
                          "included (default: those of 1024,2048,4096,8192 the model's context holds).")
DepthsOpt = typer.Option(None, "--depths", help="With --long-context: where the key sits, as the share of the filler "
                         "before it (default 0.1,0.5,0.9).")
TrialsOpt = typer.Option(None, "--trials", help="With --long-context: keys (and fillers) per length and depth "
                         "(default 3).")
ReferenceOpt = typer.Option(None, "--reference", help="With --long-context: the --json of the same measure on "
                            "another model (e.g. the source): each bucket's perplexity is also given as a ratio to it.")


@app.command("eval")
@friendly
def eval_command(
    model: Optional[str] = typer.Argument(
        None, help="A model folder (source or converted) or a .gguf file. Default: the embedded SmolLM2-135M."
    ),
    data: str = typer.Option(
        ..., "--data", help="Evaluation text: a local file or datasets name[:config[:split]] (never calibration text)."
    ),
    seq_len: Optional[int] = typer.Option(
        None, "--seq-len", help="Tokens per window (default 2048; with --long-context the model's context)."),
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
    cache_type: Optional[str] = typer.Option(
        None, "--cache-type", help="Score with the KV cache stored in a llama.cpp cache type (f16, q8_0, q5_1, q5_0, "
        "q4_1, q4_0, iq4_nl; ggml's blocks, bit for bit): a converted model's cached latent and rope key, or a "
        "source's keys and values as llama.cpp stores them (its Hadamard rotation included). With --engine llamacpp: "
        "llama.cpp's own --cache-type-k/-v (flash attention on for quantized types). With --engine vllm: vLLM's "
        "own --kv-cache-dtype (fp8, fp8_e4m3, fp8_e5m2)."
    ),
    long_context: bool = LongContextOpt,
    lengths: Optional[str] = LengthsOpt,
    depths: Optional[str] = DepthsOpt,
    trials: Optional[int] = TrialsOpt,
    reference: Optional[Path] = ReferenceOpt,
    verbose: int = VerboseOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Perplexity over fixed windows and the KV-cache bytes per token the model really stores (with --long-context:
    perplexity by position and pass-key retrieval up to the model's context)."""
    setup_logging(verbose, quiet)
    from mla_convert import evaluate, longctx
    from mla_convert.conversion.calibration import calibration_overlap
    from mla_convert.data import load_text

    evaluate.check_device(device)
    long_run = longctx.options(long_context, lengths, depths, trials, reference, record, engine, data)
    if json_out is not None:
        evaluate.check_results_file(json_out, overwrite)
    if record:
        _check_record(model)
    text = load_text(data)
    warning = calibration_overlap(model, data, text)
    if warning:
        typer.echo(f"warning: {warning}", err=True)
    _check_engine_cache_type(engine, cache_type)
    if long_run is not None:
        return _long_context(model, text, data, seq_len, windows, dtype, device, engine, cache_type, json_out,
                             overwrite, quiet, **long_run)
    seq_len = 2048 if seq_len is None else seq_len
    result, label = _score(engine, model, text, seq_len, windows, dtype, device, quiet, cache_type)
    result.update(model=label, data=data, dtype=dtype)
    cache_type = result.get("cache_type", cache_type)
    cache = dtype if cache_type is None else f"{cache_type} cache: ggml's blocks, as llama.cpp stores them"
    if engine == "vllm":
        cache = f"{cache_type or dtype}, as vLLM allocates it, {result['attention_backend']}"
    elif engine == "llamacpp":
        cache = f"{(result.get('kv_cache_log') or {}).get('k_type', 'unknown')} cache, as llama.cpp allocates it"
    typer.echo(
        f"{label}: perplexity {result['perplexity']:.3f} over {result['windows']} x {seq_len} tokens ({data}); "
        f"KV cache {format(kv, 'g') if (kv := result['kv_cache_bytes_per_token']) is not None else 'unknown'} "
        f"bytes/token ({cache})"
    )
    if json_out is not None:
        evaluate.write_results_file(json_out, result, overwrite)
    if record:
        _record(model, result, data, seq_len, dtype, engine)


def _long_context(model, text, data, seq_len, windows, dtype, device, engine, cache_type, json_out, overwrite, quiet,
                  **run) -> None:
    """`eval --long-context`: the tables printed, and written to --json."""
    from mla_convert import evaluate, longctx

    if engine == "llamacpp":
        _check_llamacpp_model(model, device, dtype)
    result, label = longctx.long_context_eval(engine, model, text, seq_len, windows, dtype, device, cache_type,
                                               progress=not quiet, **run)
    result.update(model=label, data=data, dtype=dtype)
    typer.echo(f"{label}: {result['engine']}, {result['cache_type'] or dtype} cache, context "
               f"{result['long_context']['context']} positions; {data}")
    typer.echo(longctx.render(result))
    if json_out is not None:
        evaluate.write_results_file(json_out, result, overwrite)


def _check_llamacpp_model(model: Optional[str], device: str, dtype: str) -> None:
    if model is None or Path(model).suffix != ".gguf" or not Path(model).is_file():
        raise UserError("--engine llamacpp needs a .gguf file (mla-convert export OUT --format gguf -o NAME.gguf)")
    if device != "cpu" or dtype != "float32":
        raise UserError("--device and --dtype apply to --engine transformers; llama.cpp runs the GGUF's own "
                        "tensor types on the CPU (drop them)")


def _check_record(model: Optional[str]) -> None:
    """`eval --record` needs a folder mla-convert wrote whose card can be rewritten: checked before any scoring."""
    from mla_convert.card import render_model_card
    from mla_convert.provenance import FILENAME

    if model is None or not (Path(model) / FILENAME).is_file():
        raise UserError(f"--record writes into the {FILENAME} of a folder mla-convert wrote; "
                        f"{model or 'the embedded default'} has none: drop --record")
    render_model_card(model)  # a card that cannot be rewritten fails now, before provenance.json is changed


def _check_engine_cache_type(engine: str, cache_type: Optional[str]) -> None:
    """vLLM takes its own cache types, transformers and llama.cpp llama.cpp's: a type for the other engine is an error
    that names the fix."""
    if engine == "vllm" and cache_type is not None and cache_type not in VLLM_CACHE_TYPES:
        raise UserError(f"with --engine vllm, --cache-type takes vLLM's own cache types "
                        f"({', '.join(VLLM_CACHE_TYPES)}); {cache_type} is a llama.cpp type: use --engine transformers "
                        "or llamacpp for it")
    if engine != "vllm" and cache_type in VLLM_CACHE_TYPES:
        from mla_convert.kvquant import CACHE_TYPES

        raise UserError(f"--cache-type {cache_type} is vLLM's: add --engine vllm (transformers and llama.cpp take "
                        f"{', '.join(CACHE_TYPES)})")


def _score(engine: str, model: Optional[str], text: str, seq_len: int, windows: int, dtype: str, device: str,
           quiet: bool, cache_type: Optional[str] = None) -> tuple[dict, str]:
    """The perplexity result of `model` on `text` in `engine`, and the model's label."""
    from mla_convert import evaluate

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
        return (vllm_perplexity(model, evaluate.tokenize(tokenizer, text), seq_len, windows, dtype,
                                kv_cache_dtype=cache_type or "auto"), str(model))
    if engine == "llamacpp":
        from mla_convert.serving.llamacpp import gguf_tokenizer, llamacpp_perplexity

        _check_llamacpp_model(model, device, dtype)
        ids = evaluate.tokenize(gguf_tokenizer(model), text)
        return llamacpp_perplexity(model, ids, seq_len, windows, cache_type=cache_type or "f16"), str(model)
    if engine == "transformers":
        import torch

        with torch.inference_mode():
            net, tokenizer, label = evaluate.load_model(model, dtype, device)
            cache_type, stored = evaluate.read_cache_as_served(net, cache_type)
            result = evaluate.perplexity(net, evaluate.tokenize(tokenizer, text), seq_len, windows, progress=not quiet)
            held = stored is None or evaluate.holds_cache_type(net)  # else a source's cache type: its bytes, computed
            result["kv_cache_bytes_per_token"] = evaluate.kv_cache_bytes_per_token(net) if held else stored
            result["cache_type"] = cache_type
        return result, label
    raise UserError(f"--engine must be transformers, vllm or llamacpp, got {engine}")


def _record(model: str, result: dict, data: str, seq_len: int, dtype: str, engine: str) -> None:
    """`eval --record`: the perplexity into the folder's provenance.json, and its card rewritten."""
    from mla_convert import provenance

    kind = (provenance.load(model) or {}).get("kind", "converted")
    key = {"convert": "converted", "finetune": "finetuned", "export": "exported"}.get(kind, kind)
    protocol = f"{data}, {result['windows']} x {seq_len} windows, {dtype}" + (", vLLM" if engine == "vllm" else "")
    folder = Path(model)
    path, card = folder / provenance.FILENAME, folder / "README.md"
    needed = path.stat().st_size + (card.stat().st_size if card.is_file() else 0) + 4096  # the new copies
    with _restored_on_failure(path), room_for(folder, needed, "the record in"):
        if provenance.add_measurements(model, perplexity={key: result["perplexity"], "protocol": protocol}):
            from mla_convert.card import write_model_card

            write_model_card(folder)


@contextlib.contextmanager
def _restored_on_failure(path: Path):
    """`path` as it was when the block fails: the record and its card change together or not at all. The old file
    stays reachable under a second name (which takes no room on a full disk) until the block is done."""
    backup = path.with_name(f".{path.name}.before-record")
    backup.unlink(missing_ok=True)
    try:
        os.link(path, backup)
    except OSError:  # a file system without hard links: the record is still written whole or not at all
        backup = None
    try:
        yield
    except BaseException:
        if backup is not None and path.exists() and os.path.samefile(backup, path):
            backup.unlink()  # not replaced yet (rename does nothing between two names of one file)
        elif backup is not None:
            os.replace(backup, path)
        raise
    if backup is not None:
        backup.unlink()


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
    cache_type: Optional[str] = typer.Option(
        None, "--cache-type", help="Generate with the KV cache read as a llama.cpp cache type stores it (f16, q8_0, "
        "q5_1, q5_0, q4_1, q4_0; see eval --cache-type)."
    ),
    verbose: int = VerboseOpt,
    quiet: bool = QuietOpt,
) -> None:
    """Generate text, and print tokens per second and the KV-cache size the model really holds."""
    setup_logging(verbose, quiet)
    from mla_convert.generate import check_settings

    check_settings(max_new_tokens, sample, temperature, prompt, cache)
    from mla_convert import evaluate
    from mla_convert.generate import encode_prompt, generate

    evaluate.check_device(device)
    net, tokenizer, label = evaluate.load_model(model, dtype, device)
    evaluate.check_generation_config(net, label)
    cache_type, stored = evaluate.read_cache_as_served(net, cache_type)
    ids = encode_prompt(tokenizer, prompt, label, chat, device)
    run = generate(net, tokenizer, ids, max_new_tokens, sample=sample, temperature=temperature, seed=seed, cache=cache)
    typer.echo(run.text)
    typer.echo("---")
    line = (f"{label} ({net.config.model_type}, {dtype}, {device}): prompt {run.prompt_tokens} tokens, generated "
            f"{run.new_tokens} in {run.seconds:.2f} s = {run.new_tokens / run.seconds:.1f} tokens/s")
    if run.decode_rate is not None:
        line += f" (first token {run.first_token_seconds:.2f} s, then {run.decode_rate:.1f} tokens/s decode"
        line += ", after the compiling first decode step)" if run.compiled_first_step else ")"
    typer.echo(line)
    total = run.cache_bytes
    held = stored is not None and cache == "dynamic" and evaluate.holds_cache_type(net)
    kind = f"{cache_type} blocks, as llama.cpp stores them" if held else dtype
    if run.capacity is None:
        typer.echo(f"KV cache: {run.bytes_per_token} bytes/token ({kind}, all layers); {run.cached_tokens} tokens "
                   f"cached = {total} bytes ({total / 2**20:.2f} MiB)")
    else:  # preallocated: the bytes are the capacity's, whatever was written
        typer.echo(f"KV cache: {run.bytes_per_token} bytes/token ({kind}, all layers); {run.cached_tokens} tokens "
                   f"cached in a static cache of {run.capacity} tokens = {total} bytes ({total / 2**20:.2f} MiB)")
    if stored is not None and not held:
        typer.echo(f"read as a {cache_type} cache: {stored:g} bytes/token as llama.cpp stores it (this process holds "
                   "the values it reads back, de-quantized, at the size above)")

