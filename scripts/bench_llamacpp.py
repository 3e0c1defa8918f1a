"""llama.cpp benchmark: the GGUF export of SmolLM2-135M conversions run in llama.cpp against transformers, and their
decode speed against the source model's GGUF, same type, same threads, same run.

For each KV budget: a `--target deepseek` conversion (closed form by default: `--refine-steps 0 --refine-model-steps 0`,
calibrated on WikiText-2 validation; the acceptance here is engine parity, not conversion quality), exported with
`mla-convert export --format gguf` (f32); perplexity in llama.cpp (`eval --engine llamacpp`'s protocol) and in
transformers (the native checkpoint) on the first WINDOWS x SEQ_LEN tokens of WikiText-2 test, from the same token
ids; greedy continuations of 3 prompts in both; the KV bytes per token llama.cpp allocates (its log) against the
plan's (elements per token x 2 bytes, llama.cpp's f16 cache). The source GGUF is the embedded Q4_1 file re-typed to
f32 by llama.cpp's own quantizer (the same weights transformers de-quantizes). Decode: for each context length, the
sequence grown to that many tokens, then DECODE_TOKENS single-token steps timed.

    python scripts/bench_llamacpp.py [--budgets 0.5 0.25 0.125] [--windows 4] [--contexts 2048 8192 16384]

Needs .venv-llamacpp (scripts/install-llamacpp.sh). Writes benchmarks/llamacpp/{results.json,README.md,decode.png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mla_convert import evaluate  # noqa: E402
from mla_convert.serving import engine, llamacpp  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
OUT = ROOT / "benchmarks" / "llamacpp"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def sh(cmd: list[str], **kw) -> float:
    print("+", " ".join(map(str, cmd)), flush=True)
    t0 = time.time()
    subprocess.run(list(map(str, cmd)), check=True, cwd=ROOT, **kw)
    return time.time() - t0


def source_gguf(work: Path) -> Path:
    """The embedded SmolLM2 GGUF re-typed to f32 by llama.cpp's quantizer (llama_model_quantize, ALL_F32)."""
    from mla_convert.checkpoint import default_model_path

    out = work / "source-f32.gguf"
    if not out.exists():
        code = ("import sys, llama_cpp as l; p = l.llama_model_quantize_default_params(); "
                "p.ftype = l.LLAMA_FTYPE_ALL_F32; p.allow_requantize = True; "
                "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
        sh([llamacpp.llamacpp_python(), "-c", code, default_model_path(), out])
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--work", type=Path, default=ROOT / "out")
    p.add_argument("--convert-args", default="--refine-steps 0 --refine-model-steps 0 --calib-samples 4 --calib-seq-len 512",
                   help="extra `mla-convert llama` options (default: closed form, 4 x 512 calibration tokens)")
    args = p.parse_args()
    if llamacpp.llamacpp_python() is None:
        sys.exit("needs .venv-llamacpp: bash scripts/install-llamacpp.sh")
    args.work.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    cli = [sys.executable, "-m", "mla_convert.cli"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(args.threads))
    results = {"machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
               "threads": args.threads, "windows": args.windows, "seq_len": args.seq_len,
               "convert_args": args.convert_args, "budgets": [], "source": {}, "decode": {}}  # fmt: skip
    src = source_gguf(args.work)
    text = (DATA / "wiki.test.raw").read_text()
    rows = []
    for budget in args.budgets:
        name = f"smol-{int(budget * 1000)}"
        native = args.work / name
        seconds = None
        log = args.work / f"{name}.log"  # a conversion started beside this run (same options) logs there: wait for it
        while not (native / "config.json").is_file() and log.exists() and time.time() - log.stat().st_mtime < 300:
            time.sleep(20)
        if not (native / "config.json").is_file():
            seconds = sh([*cli, "llama", "--kv-budget", budget, "--target", "deepseek", *args.convert_args.split(),
                          "--calib-data", DATA / "wiki.valid.tokens", "--dtype", "float32", "-o", native, "-q"], env=env)
        gguf = args.work / f"{name}.gguf"
        if not gguf.exists() or gguf.stat().st_mtime < (native / "config.json").stat().st_mtime:
            sh([*cli, "export", native, "--format", "gguf", "-o", gguf, "--overwrite"], env=env)
        tokenizer = llamacpp.gguf_tokenizer(gguf)
        ids = evaluate.tokenize(tokenizer, text)
        with torch.inference_mode():
            model, _, _ = evaluate.load_model(str(native), "float32", "cpu")
            hf = evaluate.perplexity(model, ids, args.seq_len, args.windows, progress=False)
            del model
        cpp = llamacpp.llamacpp_perplexity(gguf, ids, args.seq_len, args.windows, threads=args.threads)
        prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in PROMPTS]
        greedy_hf = engine.score_in_transformers(native, prompts=prompts, new_tokens=args.new_tokens)["greedy"]
        greedy_cpp = llamacpp.run_llamacpp(gguf, prompts=prompts, new_tokens=args.new_tokens, n_ctx=256,
                                           threads=args.threads)["greedy"]
        prov = json.loads((native / "provenance.json").read_text())
        per_layer = prov["kv_cache"]["elements_per_token_per_layer_after"]
        layers = json.loads((native / "config.json").read_text())["num_hidden_layers"]
        record = json.loads(subprocess.run(
            [sys.executable, "-c", "import gguf, sys; f = gguf.GGUFReader(sys.argv[1]).fields['mla_convert.export']; "
             "print(bytes(f.parts[f.data[0]]).decode())", gguf], capture_output=True, text=True, check=True).stdout)
        row = {
            "budget": budget, "folder": str(native.relative_to(ROOT)) if native.is_relative_to(ROOT) else str(native),
            "convert_seconds": seconds, "kv_lora_rank": record["kv_lora_rank"],
            "qk_rope_head_dim": record["qk_rope_head_dim"], "q_factorization": record["q_factorization"],
            "ppl_transformers": hf["perplexity"], "ppl_llamacpp": cpp["perplexity"],
            "ppl_rel_diff": cpp["perplexity"] / hf["perplexity"] - 1, "tokens": cpp["tokens"],
            "greedy_transformers": greedy_hf, "greedy_llamacpp": greedy_cpp, "greedy_equal": greedy_hf == greedy_cpp,
            "plan_kv_elements_per_token": per_layer * layers, "plan_kv_bytes_per_token_f16": 2 * per_layer * layers,
            "llamacpp_kv_log": cpp["kv_cache_log"],
        }  # fmt: skip
        print(json.dumps({k: v for k, v in row.items() if k not in ("greedy_transformers", "greedy_llamacpp")}),
              flush=True)
        rows.append(row)
        results["budgets"] = rows
        (OUT / "results.json").write_text(json.dumps(results, indent=2) + "\n")  # kept if a later step stops
    results["budgets"] = rows
    # the source, for reference: its f32 GGUF in llama.cpp against the embedded model in transformers
    ids = evaluate.tokenize(llamacpp.gguf_tokenizer(src), text)
    with torch.inference_mode():
        model, _, _ = evaluate.load_model(None, "float32", "cpu")
        hf = evaluate.perplexity(model, ids, args.seq_len, args.windows, progress=False)
        del model
    cpp = llamacpp.llamacpp_perplexity(src, ids, args.seq_len, args.windows, threads=args.threads)
    results["source"] = {"gguf": "embedded SmolLM2-135M-Instruct Q4_1 re-typed to f32 by llama.cpp",
                         "ppl_transformers": hf["perplexity"], "ppl_llamacpp": cpp["perplexity"],
                         "llamacpp_kv_log": cpp["kv_cache_log"]}  # fmt: skip
    # decode, same run, same threads, one process per model with the cache allocated for the longest context
    n_ctx = max(args.contexts) + len(args.contexts) * args.decode_tokens + 256
    results.update(decode_tokens=args.decode_tokens, decode_n_ctx=n_ctx)
    decode_ids = ids[:4096].tolist()
    models = {"source": src, **{f"{int(r['budget'] * 100 * 10) / 10:g}%": args.work / f"smol-{int(r['budget'] * 1000)}.gguf"
                                for r in rows}}
    for label, path in models.items():
        res = llamacpp.run_llamacpp(path, n_ctx=n_ctx, threads=args.threads,
                                    decode={"contexts": args.contexts, "tokens": args.decode_tokens, "ids": decode_ids})
        results["decode"][label] = {"steps": res["decode"], "kv_log": res["kv_cache"]}
        print(label, json.dumps(res["decode"]), json.dumps(res["kv_cache"]), flush=True)
    results["load_average"] = os.getloadavg()
    (OUT / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    write_readme(results)
    plot(results)


def write_readme(r: dict) -> None:
    lines = [
        "# llama.cpp: the GGUF export against transformers, and decode speed against the source GGUF",
        "",
        f"`python scripts/bench_llamacpp.py` ({r['machine']}, {r['threads']} threads, llama.cpp through "
        "llama-cpp-python from scripts/install-llamacpp.sh). SmolLM2-135M converted with `--target deepseek "
        f"{r['convert_args']}` (closed form: engine parity is measured here, not conversion quality), calibrated on "
        "WikiText-2 validation, exported with `mla-convert export OUT --format gguf` (f32). Perplexity on the first "
        f"{r['windows']} x {r['seq_len']} tokens of WikiText-2 test, each window on its own, from the same token ids "
        "in both engines.",
        "",
        "| budget | kv_lora_rank + rope | ppl transformers | ppl llama.cpp | difference | greedy (3 prompts) | "
        "KV bytes/token: plan (f16) | llama.cpp log |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in r["budgets"]:
        kv = b["llamacpp_kv_log"] or {}
        lines.append(f"| {b['budget'] * 100:g}% | {b['kv_lora_rank']} + {b['qk_rope_head_dim']} | "
                     f"{b['ppl_transformers']:.3f} | {b['ppl_llamacpp']:.3f} | {100 * b['ppl_rel_diff']:+.3f}% | "
                     f"{'equal' if b['greedy_equal'] else 'DIFFER'} | {b['plan_kv_bytes_per_token_f16']} | "
                     f"{kv.get('bytes_per_token', float('nan')):.1f} ({kv.get('mib')} MiB / {kv.get('cells')} cells) |")
    s = r["source"]
    kv = s["llamacpp_kv_log"] or {}
    lines += [f"| source | GQA 3 kv heads x 64 | {s['ppl_transformers']:.3f} | {s['ppl_llamacpp']:.3f} | "
              f"{100 * (s['ppl_llamacpp'] / s['ppl_transformers'] - 1):+.3f}% | | 2 x 30 x 384 = 23040 | "
              f"{kv.get('bytes_per_token', float('nan')):.1f} |", ""]
    contexts = [d["context"] for d in next(iter(r["decode"].values()))["steps"]]
    lines += [f"Decode tokens/s: one sequence per model, grown to each context length in turn (WikiText-2 test "
              f"tokens), then {r['decode_tokens']} single-token steps timed; llama.cpp's f16 KV cache allocated for "
              f"{r['decode_n_ctx']} cells; same threads, same run, models one after another:", "",
              "| model | KV MiB allocated | " + " | ".join(f"{c} ctx" for c in contexts) + " |",
              "| --- | --- | " + " | ".join("---" for _ in contexts) + " |"]
    for label, d in r["decode"].items():
        lines.append(f"| {label} | {(d['kv_log'] or {}).get('mib')} | "
                     + " | ".join(f"{x['tokens_per_s']:.1f}" for x in d["steps"]) + " |")
    lines += ["", f"Load average at the end: {', '.join(f'{x:.2f}' for x in r['load_average'])} (a shared machine).", ""]
    (OUT / "README.md").write_text("\n".join(lines))


def plot(r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{x['budget'] * 100:g}%" for x in r["budgets"]]
    xs = range(len(labels))
    a.bar([x - 0.2 for x in xs], [x["ppl_transformers"] for x in r["budgets"]], 0.4, label="transformers")
    a.bar([x + 0.2 for x in xs], [x["ppl_llamacpp"] for x in r["budgets"]], 0.4, label="llama.cpp (f32 GGUF)")
    a.set_xticks(list(xs), labels)
    a.set_ylabel("WikiText-2 test perplexity")
    a.set_title("same conversion, same token ids")
    a.legend()
    for label, d in r["decode"].items():
        b.plot([x["context"] for x in d["steps"]], [x["tokens_per_s"] for x in d["steps"]], marker="o", label=label)
    b.set_xlabel("context (tokens)")
    b.set_ylabel("decode tokens/s")
    b.set_title(f"llama.cpp decode, f32, {r['threads']} threads")
    b.legend()
    fig.tight_layout()
    fig.savefig(OUT / "decode.png", dpi=110)


if __name__ == "__main__":
    main()
