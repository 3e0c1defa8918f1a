"""Benchmark the DeepSeek-V3 export: perplexity of the export loaded in stock transformers vs the native MLA model.

    nice python scripts/bench_export.py                 # SmolLM2-135M at 50% of its KV cache -> benchmarks/export.md

Steps: convert the embedded SmolLM2-135M-Instruct with DeepSeek-exportable options (uniform RoPE pairs merged across
kv heads, activation-aware joint SVD calibrated on wikitext-2 validation), export it (float32 and bfloat16 weights),
then score the source, the native model and both exports on the same windows of wikitext-2 raw *test* (the same
protocol as `mla-convert eval`: non-overlapping windows scored on their own, float32 compute). The exports are loaded
with `DeepseekV3ForCausalLM` from stock transformers; mla_convert is not involved in their forward pass.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int, windows: int) -> float:
    total, count = 0.0, 0
    for w in range(windows):
        chunk = ids[w * seq_len : (w + 1) * seq_len].unsqueeze(0)
        logits = model(input_ids=chunk, use_cache=False).logits[0, :-1].float()
        total += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += seq_len - 1
    return math.exp(total / count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=Path, default=Path("/tmp/mla-bench-export"), help="folder for the checkpoints")
    ap.add_argument("--kv-budget", type=float, default=0.5, help="fraction of the source's KV cache")
    ap.add_argument("--rope-dims", type=int, default=32)
    ap.add_argument("--rope-strategy", default="uniform", choices=("uniform", "high"))
    ap.add_argument("--calib", default=str(DATA / "wiki.valid.tokens"))
    ap.add_argument("--eval", default=str(DATA / "wiki.test.raw"))
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "export.md")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    import mla_convert  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3ForCausalLM

    from mla_convert.checkpoint import default_model_path, open_source
    from mla_convert.convert import ConvertOptions, convert
    from mla_convert.export import ExportOptions, export

    native = args.work / "native"
    timings = {}
    t0 = time.time()
    options = ConvertOptions(
        kv_budget=args.kv_budget, rope_dims=args.rope_dims, rope_strategy=args.rope_strategy, rope_merge=True,
        calib_data=args.calib,
    )  # fmt: skip
    convert(open_source(None), native, options, overwrite=True, progress=False)
    timings["convert"] = time.time() - t0
    records = {}
    for dtype in ("float32", "bfloat16"):
        t0 = time.time()
        records[dtype] = export(native, args.work / f"deepseek-{dtype}", ExportOptions(dtype=dtype), overwrite=True)
        timings[f"export {dtype}"] = time.time() - t0

    tokenizer = AutoTokenizer.from_pretrained(native)
    text = Path(args.eval).read_text(encoding="utf-8")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    gguf = default_model_path()
    rows = []
    for label, load in (
        ("source SmolLM2-135M-Instruct (GGUF, de-quantized)",
         lambda: AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)),
        ("native MLA (mla_convert)", lambda: AutoModelForCausalLM.from_pretrained(native, dtype=torch.float32)),
        ("DeepSeek-V3 export, float32 weights (stock DeepseekV3ForCausalLM)",
         lambda: DeepseekV3ForCausalLM.from_pretrained(args.work / "deepseek-float32", dtype=torch.float32)),
        ("DeepSeek-V3 export, bfloat16 weights (stock, float32 compute)",
         lambda: DeepseekV3ForCausalLM.from_pretrained(args.work / "deepseek-bfloat16", dtype=torch.float32)),
    ):  # fmt: skip
        t0 = time.time()
        model = load().eval()
        ppl = perplexity(model, ids, args.seq_len, args.windows)
        timings[label] = time.time() - t0
        rows.append((label, ppl))
        print(f"{label}: {ppl:.4f}", file=sys.stderr)
        del model

    native_ppl = rows[1][1]
    rec32, rec16 = records["float32"], records["bfloat16"]
    m32, m16 = rec32["measurements"], rec16["measurements"]
    prov = json.loads((native / "provenance.json").read_text())
    kv = prov.get("kv_cache", {})
    lines = [
        "# DeepSeek-V3 export: stock transformers vs the native MLA model",
        "",
        "Command (2 CPU cores, float32 compute; the numbers below come from this run):",
        "",
        "```",
        f"nice python scripts/bench_export.py --windows {args.windows} --seq-len {args.seq_len}",
        "```",
        "",
        "which runs the equivalent of",
        "",
        "```",
        f"mla-convert llama --kv-budget {args.kv_budget} --rope-dims {args.rope_dims} --rope-strategy "
        f"{args.rope_strategy} --rope-merge --calib-data ../shared/data/wikitext-2/wiki.valid.tokens -o NATIVE",
        "mla-convert export NATIVE --format deepseek -o DS_F32 --dtype float32",
        "mla-convert export NATIVE --format deepseek -o DS_BF16 --dtype bfloat16",
        "```",
        "",
        f"Model: SmolLM2-135M-Instruct (embedded GGUF) converted to {args.kv_budget:.0%} of its KV cache "
        f"({kv.get('elements_per_token_per_layer_before')} -> {kv.get('elements_per_token_per_layer_after')} "
        f"values per token per layer: latent {prov['plan']['ranks'][0]} + rope key {prov['plan']['rope_dim']}).",
        f"Export: kv_lora_rank {rec32['kv_lora_rank']} + qk_rope_head_dim {rec32['qk_rope_head_dim']}, rope_theta "
        f"{rec32['rope_theta']:.6g} (exact RoPE mapping: {rec32['rope_exact']}), q_lora_rank {rec32['q_lora_rank']}, "
        f"residual scale {rec32['residual_scale']:.6g} (source rms_norm_eps -> 1e-6).",
        "",
        f"Perplexity on wikitext-2 raw test, first {args.windows} non-overlapping windows of {args.seq_len} tokens "
        "(each scored on its own):",
        "",
        "| model | perplexity | vs native |",
        "|---|---:|---:|",
    ]
    for label, ppl in rows:
        lines.append(f"| {label} | {ppl:.4f} | {ppl / native_ppl - 1:+.2e} |")
    lines += [
        "",
        "Built-in export verification (stock DeepseekV3ForCausalLM in a subprocess without mla_convert, "
        "`measurements` in the export's provenance.json):",
        "",
        "| export | max relative logit error | greedy tokens match |",
        "|---|---:|:---:|",
        f"| float32 | {m32['export_max_rel_logit_error']:.3g} | {m32['export_greedy_tokens_match']} |",
        f"| bfloat16 | {m16['export_max_rel_logit_error']:.3g} | {m16['export_greedy_tokens_match']} |",
        "",
        f"Protocol of that check: {m32['export_verify_protocol']}.",
        "",
        "Serving notes the export printed:",
        "",
    ]
    lines += [f"- {w}" for w in rec32["warnings"]] or ["- none"]
    lines += ["", "Wall time (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()), ""]
    args.out.write_text("\n".join(lines))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
