"""Benchmark the DeepSeek-V3 export: perplexity of the export loaded in stock transformers vs the native MLA model.

    OMP_NUM_THREADS=2 nice python benchmarks/export/run.py  # SmolLM2-135M at 50% of its cache -> benchmarks/export/

Steps, the same as `mla-convert llama --kv-budget 0.5 --target deepseek --format deepseek` (plus a bfloat16 export):
resolve DeepSeek-exportable conversion options from the source config (`convert.deepseek_convert_options`), convert
the embedded SmolLM2-135M-Instruct (activation-aware joint SVD calibrated on wikitext-2 *validation*), export it with
float32 and (unless --no-bfloat16) bfloat16 weights, then score the source, the native model and the exports on the
same windows of wikitext-2 raw *test* with `mla_convert.evaluate.perplexity` (the protocol of `mla-convert eval`:
non-overlapping windows scored on their own, float32 compute). Each perplexity runs in its own subprocess; the
exports' subprocesses load `DeepseekV3ForCausalLM` from stock transformers and never import mla_convert (checked and
recorded). Results are cached in WORK/results.json, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common import harness  # noqa: E402  (the machine record)
from benchmarks.common import stock_score  # noqa: E402  (scoring in a process that never imports mla_convert)

DATA = ROOT.parent / "shared" / "data" / "wikitext-2"

def score(kind: str, folder: Path, ids_path: Path, args) -> dict:
    """benchmarks/common/stock_score.py's result for one model (its own interpreter; the stock one never imports mla_convert)."""
    res = stock_score.run(kind, folder, ids_path, args.seq_len, args.windows, args.threads, cwd=args.work)
    return dict(res, perplexity=res["perplexity"]["text"], tokens=res["tokens"]["text"])


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mla-bench-export",
                    help="folder for the checkpoints (default: mla-bench-export in the system's temporary folder)")
    ap.add_argument("--kv-budget", type=float, default=0.5, help="fraction of the source's KV cache")
    ap.add_argument("--calib", default=str(DATA / "wiki.valid.tokens"))
    ap.add_argument("--eval", default=str(DATA / "wiki.test.raw"))
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-bfloat16", action="store_true", help="skip the bfloat16 export and its perplexity")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "export" / "README.md")
    return ap.parse_args()


def open_cache(args):
    """The results of earlier runs with the same settings (in --work), and the function that saves them."""
    cache_path = args.work / "results.json"
    key = f"{args.kv_budget}|{args.calib}|{args.eval}|{args.windows}|{args.seq_len}"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    if cache.get("key") != key:
        cache = {"key": key}
    cache.setdefault("machine", harness.machine())  # where the cached numbers were measured (the first run of them)

    def save():
        cache_path.write_text(json.dumps(cache, indent=1))

    return cache, save


def build(args, cache: dict, save):
    """The native conversion and its DeepSeek-V3 exports (each reused from --work when there): (native folder,
    export dtypes, the notes of `--target deepseek`)."""
    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert, deepseek_convert_options
    from mla_convert.export import ExportOptions, export

    native = args.work / "native"
    timings = cache.setdefault("timings", {})
    options, notes = deepseek_convert_options(open_source(None).config, ConvertOptions(kv_budget=args.kv_budget,
                                                                                       calib_data=args.calib))
    if "convert" not in timings or not (native / "config.json").is_file():
        t0 = time.time()
        convert(open_source(None), native, options, overwrite=True, progress=False)
        timings["convert"] = time.time() - t0
        cache.pop("records", None)
        cache.pop("ppl", None)
        save()
    records = cache.setdefault("records", {})
    dtypes = ["float32"] + ([] if args.no_bfloat16 else ["bfloat16"])
    for dtype in dtypes:
        if dtype not in records:
            t0 = time.time()
            rec = export(native, args.work / f"deepseek-{dtype}", ExportOptions(dtype=dtype), overwrite=True)
            timings[f"export {dtype} (incl. verification)"] = time.time() - t0
            records[dtype] = {k: v for k, v in rec.items() if k != "identity_norm_scales"}
            save()
    return native, dtypes, notes


def eval_ids(args, native: Path) -> Path:
    """The evaluation text's token ids, saved once in --work (the scoring processes read them)."""
    ids_path = args.work / "eval-ids.safetensors"
    if not ids_path.is_file():
        from transformers import AutoTokenizer

        from mla_convert.evaluate import tokenize

        ids = tokenize(AutoTokenizer.from_pretrained(native), Path(args.eval).read_text(encoding="utf-8"))
        if ids.numel() < args.windows * args.seq_len:
            raise SystemExit(f"{args.eval} has fewer than {args.windows} x {args.seq_len} tokens")
        from safetensors.torch import save_file

        save_file({"text": ids.contiguous()}, str(ids_path))
    return ids_path


def report_head(args, cache: dict, native: Path, notes: list[str], models: list) -> list[str]:
    """The report up to the perplexity table: the command, what it runs, the model, the table's rows."""
    ppl, rec32 = cache["ppl"], cache["records"]["float32"]
    native_ppl = ppl["native"]["perplexity"]
    prov = json.loads((native / "provenance.json").read_text())
    kv = prov.get("kv_cache", {})
    ranks, d_r = prov["plan"]["ranks"], prov["plan"]["rope_dims"]
    calib = os.path.relpath(args.calib, ROOT)
    lines = [
        "# DeepSeek-V3 export: stock transformers vs the native MLA model",
        "",
        f"Command ({harness.describe(cache['machine'])}, float32 compute; every number below comes from this run):",
        "",
        "```",
        f"OMP_NUM_THREADS=2 nice python benchmarks/export/run.py --kv-budget {args.kv_budget} --windows "
        f"{args.windows} --seq-len {args.seq_len}" + (" --no-bfloat16" if args.no_bfloat16 else ""),
        "```",
        "",
        "It runs, through the library, what these commands run:",
        "",
        "```",
        f"mla-convert llama --kv-budget {args.kv_budget} --target deepseek --format deepseek \\",
        f"    --calib-data {calib} -o DS_F32          # writes DS_F32-native/ (native MLA) and DS_F32/ (export)",
        "mla-convert export DS_F32-native --format deepseek --dtype bfloat16 -o DS_BF16",
        f"mla-convert eval DS_F32-native --data {os.path.relpath(args.eval, ROOT)} --seq-len {args.seq_len} "
        f"--windows {args.windows}",
        "```",
        "",
        "(the exports are scored in a process that loads stock `DeepseekV3ForCausalLM` and never imports mla_convert, "
        "which `mla-convert eval` cannot promise since it imports mla_convert itself).",
        "",
        f"Model: SmolLM2-135M-Instruct (the embedded default) converted to {args.kv_budget:.0%} of its KV cache "
        f"({kv.get('elements_per_token_per_layer_before')} -> {kv.get('elements_per_token_per_layer_after'):g} "
        f"values per token per layer: latent {ranks[0]} + rope key {d_r}).",
        f"Options chosen by `--target deepseek`: {notes[0].split(': ', 1)[1]}.",
        f"Export: kv_lora_rank {rec32['kv_lora_rank']} + qk_rope_head_dim {rec32['qk_rope_head_dim']}, rope_theta "
        f"{rec32['rope_theta']:.6g} (exact RoPE mapping: {rec32['rope_exact']}), q_lora_rank {rec32['q_lora_rank']}, "
        f"residual scale {rec32['residual_scale']:.6g} (source rms_norm_eps -> 1e-6).",
        "",
        f"Perplexity on wikitext-2 raw test, first {args.windows} non-overlapping windows of {args.seq_len} tokens "
        "(each scored on its own):",
        "",
        "| model | class in the scoring process | perplexity | vs native |",
        "|---|---|---:|---:|",
    ]
    for name, label, _, _ in models:
        r = ppl[name]
        lines.append(f"| {label} | {r['class']} | {r['perplexity']:.4f} | {r['perplexity'] / native_ppl - 1:+.2e} |")
    return lines


def report_tail(args, cache: dict, native: Path, models: list, dtypes: list[str]) -> list[str]:
    """The report after the perplexity table: the export's own verification, the serving notes, the times."""
    from mla_convert.checkpoint import open_source
    from mla_convert.export import deepseek_layout_notes

    ppl, records, timings = cache["ppl"], cache["records"], cache["timings"]
    rec32 = records["float32"]
    prov = json.loads((native / "provenance.json").read_text())
    ranks, d_r = prov["plan"]["ranks"], prov["plan"]["rope_dims"]
    lines = [
        "",
        "The native model's perplexity is the one-shot conversion's (no fine-tuning; how to convert better is the "
        "subject of benchmarks/quality/README.md). This benchmark measures what the export changes: the `vs native` "
        "column.",
        "",
        "Built-in export verification (stock DeepseekV3ForCausalLM in a subprocess without mla_convert, "
        "`measurements` in the export's provenance.json):",
        "",
        "| export | max relative logit error | argmax agreement | greedy tokens match |",
        "|---|---:|---:|:---:|",
    ]
    for dt in dtypes:
        m = records[dt]["measurements"]
        lines.append(f"| {dt} | {m['export_max_rel_logit_error']:.3g} | {m['export_argmax_agreement']:.4f} | "
                     f"{m['export_greedy_tokens_match']} |")
    lines += [
        "",
        f"Protocol of that check: {rec32['measurements']['export_verify_protocol']}.",
        "",
        "Serving notes (printed by `--target deepseek` before converting, and by the export):",
        "",
    ]
    lines += [f"- {w}" for w in deepseek_layout_notes(open_source(None).config, ranks, d_r)] or ["- none"]
    lines += [
        "",
        "Not run by this benchmark: the engines. The notes above are read from their code (docs/serving.md). vLLM's "
        "CPU build serving folders made the same way (its own conversions) is measured in benchmarks/serving/README.md "
        "(benchmarks/serving/run.py); SGLang is not run.",
        "",
        f"transformers {ppl['native']['transformers']}. Wall time (s): "
        + ", ".join(f"{k} {v:.0f}" for k, v in timings.items())
        + ", " + ", ".join(f"perplexity {n} {ppl[n]['seconds']:.0f}" for n, *_ in models),
        "",
    ]  # fmt: skip


def main() -> None:
    args = parse_args()
    import torch

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args.work.mkdir(parents=True, exist_ok=True)
    cache, save = open_cache(args)
    native, dtypes, notes = build(args, cache, save)
    ids_path = eval_ids(args, native)
    from mla_convert.checkpoint import default_model_path

    models = [
        ("source", "source SmolLM2-135M-Instruct (embedded Q4_1 GGUF, de-quantized)", "gguf", default_model_path()),
        ("native", "native MLA (mla_convert's MLAForCausalLM)", "native", native),
    ] + [
        (f"export-{dt}", f"DeepSeek-V3 export, {dt} weights (stock DeepseekV3ForCausalLM, float32 compute)", "stock",
         args.work / f"deepseek-{dt}")
        for dt in dtypes
    ]  # fmt: skip
    ppl = cache.setdefault("ppl", {})
    for name, label, kind, folder in models:
        if name not in ppl:
            ppl[name] = score(kind, folder, ids_path, args)
            save()
        print(f"{label}: {ppl[name]['perplexity']:.4f} ({ppl[name]['seconds']:.0f} s)", file=sys.stderr)

    lines = report_head(args, cache, native, notes, models) + report_tail(args, cache, native, models, dtypes)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
