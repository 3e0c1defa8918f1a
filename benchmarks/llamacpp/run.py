"""llama.cpp benchmark: the GGUF export of SmolLM2-135M conversions run in llama.cpp against transformers, and their
decode speed against the source model's GGUF, same type, same threads, same run.

For each KV budget: a `--target deepseek` conversion (closed form by default: `--refine-steps 0 --refine-model-steps 0`,
calibrated on WikiText-2 validation; the acceptance here is engine parity, not conversion quality), exported with
`mla-convert export --format gguf` (f32); perplexity in llama.cpp (`eval --engine llamacpp`'s protocol) and in
transformers (the native checkpoint) on the first WINDOWS x SEQ_LEN tokens of WikiText-2 test, from the same token
ids; greedy continuations of 3 prompts in both; the KV bytes per token llama.cpp allocates (its log) against the
plan's (elements per token x 2 bytes, llama.cpp's f16 cache). The source GGUF is the embedded Q4_1 file re-typed to
f32 by llama.cpp's own quantizer (the same weights transformers de-quantizes).

Decode (benchmarks/llamacpp/decode_worker.py): the source GGUF and the budgets' GGUFs loaded in one llama.cpp process; every
sequence grown to each context length in turn, then DECODE_TOKENS single-token steps timed per model, ROUNDS rounds
interleaved (the order reversed every other round; the best round kept), the 1-minute load average read before and
after every timing. The stages run apart (`--stages quality`, `--stages decode --decode-tag NAME`, several decode
runs side by side) and merge into results.json; `--stages readme` writes README.md and decode.png again from it.

    python benchmarks/llamacpp/run.py [--budgets 0.5 0.25 0.125] [--windows 4] [--contexts 2048 8192 16384]
        [--flash-attn] [--max-context 50%=8192]

Needs .venv-llamacpp (scripts/install-llamacpp.sh). Writes benchmarks/llamacpp/{results.json,README.md,decode.png}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent  # this benchmark's folder: its llama.cpp workers
sys.path.insert(0, str(ROOT))
from benchmarks.common import harness  # noqa: E402  (timed mla-convert processes, the machine record)

from mla_convert import evaluate  # noqa: E402
from mla_convert.serving import engine, llamacpp  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
OUT = ROOT / "benchmarks" / "llamacpp"
QUIET_LOAD = 2.5  # 1-minute load average on the 2-core machine at or under which a decode run counts as quiet
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]


def sh(cmd: list, env: dict | None = None) -> float:
    """Run `cmd` (harness.mla(...) for mla-convert), its output shown as it comes; its wall seconds."""
    return harness.timed(cmd, env=env, echo=True, tee=True).wall_s


def retype(src: Path, out: Path, ftype: str) -> Path:
    """`src` re-typed to LLAMA_FTYPE_`ftype` by llama.cpp's quantizer (llama_model_quantize), once."""
    if not out.exists():
        code = ("import sys, llama_cpp as l; p = l.llama_model_quantize_default_params(); "
                f"p.ftype = l.LLAMA_FTYPE_{ftype}; p.allow_requantize = True; "
                "sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))")
        sh([llamacpp.llamacpp_python(), "-c", code, src, out])
    return out


def source_gguf(work: Path) -> Path:
    """The embedded SmolLM2 GGUF re-typed to f32."""
    from mla_convert.checkpoint import default_model_path

    return retype(Path(default_model_path()), work / "source-f32.gguf", "ALL_F32")


def load_results(args) -> dict:
    """results.json as far as it was measured (a stage run alone keeps the other stage's numbers)."""
    path = OUT / "results.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    # the machine of the engine-parity runs; each decode or profile run records its own
    here = old.get("machine") if "quality" not in args.stages and old.get("machine") else harness.machine()
    results = {"machine": here,
               "windows": args.windows, "seq_len": args.seq_len, "convert_args": args.convert_args,
               "budgets": [], "source": {}, "decode": {}}  # fmt: skip
    for key in ("budgets", "source", "decode", "profile", "threads", "commands"):
        if key in old:
            results[key] = old[key]
    results.setdefault("commands", [])
    if args.stages != ["readme"]:
        results["commands"].append("python benchmarks/llamacpp/run.py " + " ".join(sys.argv[1:]))
    return results


def save(results: dict, *keys: str) -> None:
    """results.json with `keys` (all when none) from `results`: the other stage, run beside this one, keeps its own."""
    path = OUT / "results.json"
    merged = json.loads(path.read_text()) if path.exists() and keys else {}
    merged.update({k: results[k] for k in (keys or results)})
    if keys:  # the other stage's numbers back into this process's copy, for the README
        results.update({k: v for k, v in merged.items() if k not in keys})
    path.write_text(json.dumps(merged, indent=2) + "\n")


def label(budget: float) -> str:
    return f"{budget * 100:g}%"


def quality(args, results: dict, env: dict, src: Path, text: str) -> None:
    """Per budget: conversion, f32 GGUF export, perplexity and greedy tokens in both engines, KV bytes per token."""
    rows = {r["budget"]: r for r in results["budgets"]}
    for budget in args.budgets:
        name = f"smol-{int(budget * 1000)}"
        native = args.work / name
        seconds = None
        log = args.work / f"{name}.log"  # a conversion started beside this run (same options) logs there: wait for it
        while not (native / "config.json").is_file() and log.exists() and time.time() - log.stat().st_mtime < 300:
            time.sleep(20)
        if not (native / "config.json").is_file():
            seconds = harness.convert(["llama", "--kv-budget", budget, "--target", "deepseek",
                                       *args.convert_args.split(), "--calib-data", DATA / "wiki.valid.tokens",
                                       "--dtype", "float32", "-q"], native, env=env, echo=True, tee=True).run.wall_s
        gguf = args.work / f"{name}.gguf"
        if not gguf.exists() or gguf.stat().st_mtime < (native / "config.json").stat().st_mtime:
            sh(harness.mla("export", native, "--format", "gguf", "-o", gguf, "--overwrite"), env=env)
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
            "gguf_mib": gguf.stat().st_size / 2**20,
            "ppl_transformers": hf["perplexity"], "ppl_llamacpp": cpp["perplexity"],
            "ppl_rel_diff": cpp["perplexity"] / hf["perplexity"] - 1, "tokens": cpp["tokens"],
            "greedy_transformers": greedy_hf, "greedy_llamacpp": greedy_cpp, "greedy_equal": greedy_hf == greedy_cpp,
            "greedy_text_llamacpp": [tokenizer.decode(g) for g in greedy_cpp],
            "plan_kv_elements_per_token": per_layer * layers, "plan_kv_bytes_per_token_f16": 2 * per_layer * layers,
            "llamacpp_kv_log": cpp["kv_cache_log"],
        }  # fmt: skip
        print(json.dumps({k: v for k, v in row.items() if not k.startswith("greedy_")}), flush=True)
        rows[budget] = row
        results["budgets"] = [rows[b] for b in sorted(rows, reverse=True)]
        save(results, "budgets")  # kept if a later step stops
    if not results["source"] or args.redo_source:
        # the source, for reference: its f32 GGUF in llama.cpp against the embedded model in transformers
        ids = evaluate.tokenize(llamacpp.gguf_tokenizer(src), text)
        with torch.inference_mode():
            model, _, _ = evaluate.load_model(None, "float32", "cpu")
            hf = evaluate.perplexity(model, ids, args.seq_len, args.windows, progress=False)
            del model
        cpp = llamacpp.llamacpp_perplexity(src, ids, args.seq_len, args.windows, threads=args.threads)
        results["source"] = {"gguf": "embedded SmolLM2-135M-Instruct Q4_1 re-typed to f32 by llama.cpp",
                             "gguf_mib": src.stat().st_size / 2**20,
                             "ppl_transformers": hf["perplexity"], "ppl_llamacpp": cpp["perplexity"],
                             "llamacpp_kv_log": cpp["kv_cache_log"]}  # fmt: skip
        print("source", json.dumps(results["source"]), flush=True)
        save(results, "source")


def decode_models(args, src: Path, text: str) -> tuple[list[int], dict[str, str]]:
    """The token ids a decode run starts from, and its models (label -> GGUF): the source and each budget's."""
    ids = evaluate.tokenize(llamacpp.gguf_tokenizer(src), text)[:4096].tolist()
    models = {"source": str(src)}
    for b in args.decode_budgets or args.budgets:
        models[label(b)] = str((args.work / f"smol-{int(b * 1000)}.gguf").resolve())
    return ids, models


def add_extra(args, models: dict[str, str]) -> dict[str, dict]:
    """Add --decode-extra's models (LABEL=PATH[@CACHE_TYPE][+fa|-fa]; PATH may be the label of a model already named)
    to `models`; their own settings (cache type, flash attention) by label."""
    settings = {}
    for spec in args.decode_extra:
        name, path = spec.split("=", 1)
        own = {}
        for flag, value in (("+fa", True), ("-fa", False)):
            if path.endswith(flag):
                path, own["flash_attn"] = path[: -len(flag)], value
        if "@" in path:
            path, own["cache_type"] = path.rsplit("@", 1)
        models[name] = models[path] if path in models else str(Path(path).resolve())
        if own:
            settings[name] = own
    return settings


def decode(args, results: dict, src: Path, text: str) -> None:
    """Decode tokens/s, every model in one llama.cpp process (benchmarks/llamacpp/decode_worker.py), timings interleaved."""
    ids, models = decode_models(args, src, text)
    settings = add_extra(args, models)
    limit = {}
    for spec in args.max_context:  # LABEL=N
        name, n = spec.rsplit("=", 1)
        limit[name] = int(n)
    n_ctx = max(args.contexts) + len(args.contexts) * args.rounds * args.decode_tokens + 256
    request = {"models": models, "n_ctx": n_ctx, "threads": args.threads, "contexts": args.contexts,
               "tokens": args.decode_tokens, "rounds": args.rounds, "ids": ids, "max_context": limit,
               "flash_attn": args.flash_attn, "fill_threads": args.fill_threads or args.threads,
               "settings": settings}  # fmt: skip
    tag = args.decode_tag
    req, res, log = (args.work / f"decode-{tag}-{x}" for x in ("request.json", "result.json", "log.txt"))
    req.write_text(json.dumps(request))
    res.unlink(missing_ok=True)
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    print(f"+ decode: {list(models)} at {args.contexts} (llama.cpp log: {log})", flush=True)
    load_start = os.getloadavg()
    with open(log, "w") as f:
        proc = subprocess.run([str(llamacpp.llamacpp_python()), str(HERE / "decode_worker.py"),
                               str(req), str(res)], stderr=f, stdout=f, env=run_env)  # fmt: skip
    text_log = log.read_text(errors="replace")
    if not res.exists():
        sys.exit(f"decode run failed (exit {proc.returncode}): " + "\n".join(text_log.splitlines()[-10:]))
    out = json.loads(res.read_text())
    kv_lines = llamacpp.KV_LINE.findall(text_log)
    kv = {}
    for name, found in zip(out["order"], kv_lines):
        kv[name] = llamacpp.kv_cache_from_log("llama_kv_cache: size = {} MiB ({} cells, {} layers, 1/1 seqs), "
                                              "K ({}): {} MiB, V ({}): {} MiB".format(*found))
    summary = {}
    for name in out["order"]:
        per = {}
        for n in args.contexts:
            steps = [s for s in out["steps"] if s["model"] == name and s["context"] == n]
            if not steps:
                continue
            best = max(steps, key=lambda s: s["tokens_per_s"])
            fill = [f for f in out["fills"] if f["model"] == name and f["context"] == n]
            per[str(n)] = {"best_tokens_per_s": best["tokens_per_s"], "rounds": [s["tokens_per_s"] for s in steps],
                           "cpu_seconds_per_token": [s["cpu_seconds"] / s["tokens"] for s in steps if "cpu_seconds" in s],
                           "load": [[s["load_before"], s["load_after"]] for s in steps],
                           "fill_seconds": fill[0]["seconds"] if fill else None}  # fmt: skip
        summary[name] = {"kv_log": kv.get(name), "contexts": per, **settings.get(name, {}),
                         "gguf_mib": Path(models[name]).stat().st_size / 2**20,
                         "weights_read_mib": weights_read_mib(models[name])}  # fmt: skip
    fresh = json.loads((OUT / "results.json").read_text()).get("decode", {}) if (OUT / "results.json").exists() else {}
    results["decode"] = {**fresh, tag: {
        "command": results["commands"][-1], "threads": args.threads, "fill_threads": args.fill_threads or args.threads,
        "tokens": args.decode_tokens,
        "rounds": args.rounds, "n_ctx": n_ctx, "contexts": args.contexts, "flash_attn": args.flash_attn,
        "max_context": limit, "models": summary, "load_average_start": load_start, "machine": harness.machine(),
        "load_average_end": os.getloadavg(), "exit": proc.returncode}}  # fmt: skip
    print(json.dumps({k: {c: v["best_tokens_per_s"] for c, v in m["contexts"].items()} for k, m in summary.items()}),
          flush=True)
    save(results, "decode")


def top_nodes(models: dict, keep: int = 24) -> dict:
    """The profile worker's result with each step's `keep` costliest node groups (the rest summed in their totals)."""
    return {name: {c: {**x, "nodes": x["nodes"][:keep]} for c, x in per.items()} for name, per in models.items()}


def profile(args, results: dict, src: Path, text: str) -> None:
    """CPU time per decode step and per graph node (benchmarks/llamacpp/profile_worker.py), load-independent."""
    ids, models = decode_models(args, src, text)
    settings = add_extra(args, models)
    tag = args.decode_tag
    request = {"models": models, "n_ctx": max(args.contexts) + 4 * args.decode_tokens + 256, "threads": 1,
               "contexts": args.contexts, "tokens": args.decode_tokens, "ids": ids, "flash_attn": args.flash_attn,
               "settings": settings}
    req, res, log = (args.work / f"profile-{tag}-{x}" for x in ("request.json", "result.json", "log.txt"))
    req.write_text(json.dumps(request))
    res.unlink(missing_ok=True)
    run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    print(f"+ profile: {list(models)} at {args.contexts} (llama.cpp log: {log})", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run([str(llamacpp.llamacpp_python()), str(HERE / "profile_worker.py"),
                               str(req), str(res)], stderr=f, stdout=f, env=run_env)  # fmt: skip
    if not res.exists():
        sys.exit(f"profile run failed (exit {proc.returncode}): " + "\n".join(log.read_text().splitlines()[-10:]))
    path = OUT / "results.json"
    fresh = json.loads(path.read_text()).get("profile", {}) if path.exists() else {}
    results["profile"] = {**fresh, tag: {"command": results["commands"][-1], "flash_attn": args.flash_attn,
                                         "tokens": args.decode_tokens, "models": top_nodes(json.loads(res.read_text())),
                                         "settings": settings, "machine": harness.machine()}}
    save(results, "profile")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    p.add_argument("--stages", nargs="+", choices=["quality", "decode", "profile", "readme"], default=["quality", "decode"],
                   help="readme alone: README.md and decode.png again from results.json")
    p.add_argument("--windows", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 16384])
    p.add_argument("--decode-budgets", type=float, nargs="+", help="budgets timed in decode (default: --budgets)")
    p.add_argument("--max-context", nargs="*", default=[], metavar="LABEL=N",
                   help="a model timed only up to context N (e.g. 50%%=8192), where the longest fill takes too long")
    p.add_argument("--decode-extra", nargs="*", default=[], metavar="LABEL=PATH[@TYPE][+fa|-fa]",
                   help="more GGUF files timed in the decode run (e.g. 25%%-pad64=out/smol-250-pad.gguf), or a model "
                   "already named with its own cache type and flash attention (e.g. 25%%-bf16=25%%@bf16-fa, "
                   "source-q8=source@q8_0+fa)")
    p.add_argument("--decode-tokens", type=int, default=16)
    p.add_argument("--decode-tag", default="main", help="name of this decode run in results.json (runs side by side)")
    p.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention in the decode run")
    p.add_argument("--rounds", type=int, default=3, help="timings per model per context, interleaved; best kept")
    p.add_argument("--threads", type=int, default=1,
                   help="llama.cpp threads (1 by default: on a shared machine OpenMP's spinning threads are slowed "
                        "most by other work)")  # fmt: skip
    p.add_argument("--fill-threads", type=int,
                   help="llama.cpp batch threads growing the sequences in the decode run (default: --threads); the "
                        "timed single-token steps use --threads")  # fmt: skip
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--redo-source", action="store_true")
    p.add_argument("--work", type=Path, default=ROOT / "out")
    p.add_argument("--convert-args", default="--refine-steps 0 --refine-model-steps 0 --calib-samples 4 --calib-seq-len 512",
                   help="extra `mla-convert llama` options (default: closed form, 4 x 512 calibration tokens)")
    args = p.parse_args()
    if llamacpp.llamacpp_python() is None:
        sys.exit("needs .venv-llamacpp: bash scripts/install-llamacpp.sh")
    args.work.mkdir(parents=True, exist_ok=True)
    OUT.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    results = load_results(args)
    results["threads"] = args.threads
    save(results, "machine", "windows", "seq_len", "convert_args", "threads", "commands")
    src = source_gguf(args.work)
    text = (DATA / "wiki.test.raw").read_text()
    if "quality" in args.stages:
        quality(args, results, env, src, text)
    if "decode" in args.stages:
        decode(args, results, src, text)
    if "profile" in args.stages:
        profile(args, results, src, text)
    for run in (results.get("decode") or {}).values():  # results of an earlier version of this script
        for name, m in run["models"].items():
            if "weights_read_mib" not in m:
                path = src if name == "source" else args.work / f"smol-{int(float(name[:-1]) * 10)}.gguf"
                m["weights_read_mib"] = weights_read_mib(path)
                save(results, "decode")
    save(results, "threads")
    write_readme(results)
    plot(results)


def weights_read_mib(path: str | Path) -> float:
    """MiB of weights a decode step reads: every tensor of the GGUF, less the embedding table where the file has its
    own output matrix (one row of it is looked up; a tied model reads the table whole as its output layer)."""
    import gguf

    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors}
    if "output.weight" in tensors:
        tensors.pop("token_embd.weight", None)
    return sum(tensors.values()) / 2**20


def traffic_mib(model: dict, context: int) -> float:
    """MiB a decode step reads at least: its weights once plus the cached K/V of `context` tokens."""
    return model["weights_read_mib"] + (model["kv_log"] or {}).get("bytes_per_token", 0) * context / 2**20


def fit(model: dict) -> tuple[float, float] | None:
    """Least squares of seconds per decoded token = a + b x context over the contexts timed (best rounds): a is
    the per-step cost that does not grow with the context (weights, logits), b the cost per cached token."""
    pts = [(int(c), 1 / x["best_tokens_per_s"]) for c, x in model["contexts"].items()]
    if len(pts) < 2:
        return None
    mx, my = sum(c for c, _ in pts) / len(pts), sum(t for _, t in pts) / len(pts)
    b = sum((c - mx) * (t - my) for c, t in pts) / sum((c - mx) ** 2 for c, _ in pts)
    return my - b * mx, b


def decode_section(tag: str, d: dict) -> list[str]:
    contexts, models = d["contexts"], d["models"]
    limited = ", ".join(f"{k} up to {v:,}" for k, v in (d.get("max_context") or {}).items())
    lines = [
        "", f"### Run `{tag}`", "", f"`{d.get('command', '')}`" + (f" ({limited} only)" if limited else "")
        + (f" ({d['note']})" if d.get("note") else "")
        + (", llama.cpp flash attention on" if d.get("flash_attn") else ", llama.cpp flash attention off "
           "(llama-cpp-python's default)") + (f"; {harness.describe(d['machine'])}" if d.get("machine") else "")
        + ".", "",
        f"{d['tokens']} steps x {d['rounds']} rounds per model and context, KV cache {d['n_ctx']:,} cells. Best "
        "round in tokens/s (wall clock), in brackets the ratio to the source GGUF at that context:",
        "",
        "| model | cache, flash attention | GGUF MiB | KV bytes/token | " + " | ".join(f"{c:,} ctx" for c in contexts)
        + " |",
        "| --- | --- | --- | --- | " + " | ".join("---" for _ in contexts) + " |",
    ]
    src = models.get("source", {}).get("contexts", {})
    for name, m in models.items():
        cells = []
        for c in contexts:
            x = m["contexts"].get(str(c))
            if x is None:
                cells.append("(not reached)")
                continue
            ref = src.get(str(c))
            ratio = f" ({x['best_tokens_per_s'] / ref['best_tokens_per_s']:.2f}x)" if ref and name != "source" else ""
            cells.append(f"{x['best_tokens_per_s']:.2f}{ratio}")
        mode = f"{m.get('cache_type', 'f16')}, {'on' if m.get('flash_attn', d.get('flash_attn')) else 'off'}"
        lines.append(f"| {name} | {mode} | {m['gguf_mib']:.0f} | "
                     f"{(m['kv_log'] or {}).get('bytes_per_token', float('nan')):,.0f} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Every round (tokens/s, 1-minute load average before -> after):", ""]
    for name, m in models.items():
        for c, x in m["contexts"].items():
            rounds = ", ".join(f"{t:.2f} ({a:.2f}->{b2:.2f})" for t, (a, b2) in zip(x["rounds"], x["load"]))
            fill = f"; fill {x['fill_seconds']:.0f} s" if x.get("fill_seconds") is not None else ""
            cpu = x.get("cpu_seconds_per_token")
            cpu = f"; least CPU time {1e3 * min(cpu):.1f} ms per token" if cpu else ""
            lines.append(f"- {name} at {int(c):,}: {rounds}{fill}{cpu}")
    lines += ["", "MiB a decode step has to read at least (its f32 weights once, the embedding table only where it "
              "is the tied output layer, + the cached K/V of the context), and a least-squares fit of the best "
              "rounds' wall-clock seconds per token = a + b x context (under the shared load: compare rows, not "
              "machines):", "",
              "| model | weights read MiB | " + " | ".join(f"MiB read at {c:,}" for c in contexts)
              + " | a (ms) | b (us per cached token) |",
              "| --- | --- | " + " | ".join("---" for _ in contexts) + " | --- | --- |"]
    for name, m in models.items():
        ab = fit(m)
        lines.append(f"| {name} | {m['weights_read_mib']:.0f} | "
                     + " | ".join(f"{traffic_mib(m, c):.0f}" for c in contexts)
                     + (f" | {1e3 * ab[0]:.1f} | {1e6 * ab[1]:.2f} |" if ab else " | | |"))
    la, lb = d["load_average_start"], d["load_average_end"]
    lines += ["", f"Load average (1, 5, 15 min) at the start of the decode run: {la[0]:.2f}, {la[1]:.2f}, "
              f"{la[2]:.2f}; at its end: {lb[0]:.2f}, {lb[1]:.2f}, {lb[2]:.2f}."]
    return lines


def profile_section(tag: str, p: dict) -> list[str]:
    models = p["models"]
    contexts = sorted({int(c) for m in models.values() for c in m})
    lo, hi = contexts[0], contexts[-1]
    lines = ["", f"## CPU time per decode step, flash attention {'on' if p['flash_attn'] else 'off'} (run `{tag}`)", "", f"`{p['command']}`, llama.cpp flash attention "
             f"{'on' if p['flash_attn'] else 'off'}, 1 thread"
             + (f", {harness.describe(p['machine'])}" if p.get("machine") else "")
             + ". `benchmarks/llamacpp/profile_worker.py`: the CPU time of the "
             "thread llama.cpp computes on (CLOCK_THREAD_CPUTIME_ID, so other processes on the machine do not enter "
             f"it), per decode step ({p['tokens']} steps after growing the sequence to each context), and per graph "
             "node (llama.cpp's scheduler callback computing the nodes one at a time, the least of the steps per "
             "node). From the two contexts: a = the CPU time per step that does not grow with the context, b = the "
             "CPU time per cached token (attention), and a + b x context at 8K and 16K (tokens/s = 1 / that, one "
             "unloaded core).", "",
             "| model | " + " | ".join(f"CPU ms/step at {c:,}" for c in contexts)
             + " | a (ms) | b (us per cached token) | b vs source | a + b x 8,192 (tok/s) | a + b x 16,384 (tok/s) |",
             "| --- | " + " | ".join("---" for _ in contexts) + " | --- | --- | --- | --- | --- |"]
    slopes, settings = {}, p.get("settings") or {}

    def shown(name: str) -> str:  # a model with its own cache type or flash attention says which
        own = settings.get(name)
        if not own:
            return name
        fa = own.get("flash_attn", p["flash_attn"])
        return f"{name} ({own.get('cache_type', 'f16')} cache, flash attention {'on' if fa else 'off'})"

    for name, m in models.items():
        t_lo, t_hi = m[str(lo)]["cpu_step_seconds"], m[str(hi)]["cpu_step_seconds"]
        b = (t_hi - t_lo) / (hi - lo)
        a = t_lo - b * lo
        slopes[name] = b
        rel = b / slopes["source"] if "source" in slopes and slopes["source"] > 0 else float("nan")
        proj = [(a + b * c) for c in (8192, 16384)]
        lines.append(f"| {shown(name)} | " + " | ".join(f"{1e3 * m[str(c)]['cpu_step_seconds']:.1f}" for c in contexts)
                     + f" | {1e3 * a:.1f} | {1e6 * b:.2f} | {rel:.2f} | "
                     + " | ".join(f"{1e3 * t:.0f} ms ({1 / t:.1f})" for t in proj) + " |")
    lines += ["", f"Graph nodes at {hi:,} (CPU ms per step, grouped by operation and name; the largest first):", ""]
    for name, m in models.items():
        top = m[str(hi)]["nodes"][:7]
        lines.append(f"- {shown(name)}: " + ", ".join(f"{x['op']}{' ' + x['name'] if x['name'] else ''} x{x['count_per_step']}"
                                              f" {x['ms_per_step']:.1f}" for x in top))
    return lines


def quiet_runs(runs: dict) -> list[str]:
    """The decode runs whose every timing saw a 1-minute load average at most QUIET_LOAD."""
    return [tag for tag, d in runs.items()
            if max(x for m in d["models"].values() for c in m["contexts"].values() for pair in c["load"] for x in pair)
            <= QUIET_LOAD]  # fmt: skip


def write_readme(r: dict) -> None:
    runs = r.get("decode") or {}
    quiet = quiet_runs(runs)
    lines = [
        "# llama.cpp: the GGUF export against transformers, and decode speed against the source GGUF",
        "",
        "Commands run, in this order:", "",
        *[f"- `{c}`" for c in dict.fromkeys(r.get("commands", []))],
        "",
        f"{harness.describe(r['machine'])}, llama.cpp through llama-cpp-python from scripts/install-llamacpp.sh, "
        f"{r['threads']} thread{'s' * (r['threads'] > 1)}. SmolLM2-135M converted with `mla-convert llama --kv-budget B --target deepseek {r['convert_args']}` (closed "
        "form: engine parity is measured here, not conversion quality), calibrated on WikiText-2 validation, exported "
        "with `mla-convert export OUT --format gguf` (f32). The source GGUF is the embedded SmolLM2-135M-Instruct Q4_1 "
        "file re-typed to f32 by llama.cpp's own quantizer (the weights transformers de-quantizes).",
        "",
        f"**Quiet-machine decode runs: {', '.join(f'`{t}`' for t in quiet) or 'none'}** (every timing's 1-minute load "
        f"average at most {QUIET_LOAD}, the fill's threads included). The others ran under other engineers' load (the "
        "load average is recorded before and after every timing, below): they compare models measured side by side "
        "in one process, interleaved, not absolute speeds.",
        "",
        "## Engine parity",
        "",
        f"Perplexity on the first {r['windows']} x {r['seq_len']} tokens of WikiText-2 test, each window on its own, "
        "from the same token ids in both engines; greedy continuations (24 tokens) of 3 prompts; KV bytes per token "
        "from the plan (the conversion's cached elements x 2 bytes, llama.cpp's f16 cache) and from llama.cpp's log "
        "line `llama_kv_cache: size = ...` (the decode run's, where the cache has the most cells and the log's "
        "rounding the least weight).",
        "",
        "| budget | kv_lora_rank + rope | ppl transformers | ppl llama.cpp | difference | greedy (3 prompts) | "
        "KV bytes/token: plan (f16) | llama.cpp log | vs source (log) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    models = max(runs.values(), key=lambda d: d["n_ctx"])["models"] if runs else {}
    src_kv = ((models.get("source") or {}).get("kv_log") or (r.get("source") or {}).get("llamacpp_kv_log") or {})
    for b in r["budgets"]:
        kv = (models.get(label(b["budget"])) or {}).get("kv_log") or b["llamacpp_kv_log"] or {}
        ratio = kv["bytes_per_token"] / src_kv["bytes_per_token"] if kv and src_kv else float("nan")
        lines.append(f"| {label(b['budget'])} | {b['kv_lora_rank']} + {b['qk_rope_head_dim']} | "
                     f"{b['ppl_transformers']:.3f} | {b['ppl_llamacpp']:.3f} | {100 * b['ppl_rel_diff']:+.4f}% | "
                     f"{'equal' if b['greedy_equal'] else 'DIFFER'} | {b['plan_kv_bytes_per_token_f16']:,.0f} | "
                     f"{kv.get('bytes_per_token', float('nan')):,.1f} +- {kv.get('bytes_per_token_resolution', 0):.1f} "
                     f"({kv.get('mib')} MiB / {kv.get('cells')} cells) | "
                     f"{ratio:.3f} |")
    s = r.get("source") or {}
    if s:
        lines.append(f"| source | GQA 3 kv heads x 64 | {s['ppl_transformers']:.3f} | {s['ppl_llamacpp']:.3f} | "
                     f"{100 * (s['ppl_llamacpp'] / s['ppl_transformers'] - 1):+.4f}% | | 2 x 30 x 384 = 23,040 | "
                     f"{src_kv.get('bytes_per_token', float('nan')):,.1f} +- {src_kv.get('bytes_per_token_resolution', 0):.1f} "
                     f"({src_kv.get('mib')} MiB / "
                     f"{src_kv.get('cells')} cells) | 1 |")
    greedy = [b for b in r["budgets"] if b.get("greedy_text_llamacpp")]
    if greedy:
        b = greedy[0]
        lines += ["", f"llama.cpp's greedy continuation at {label(b['budget'])} of \"{PROMPTS[0]}\": "
                  f"{json.dumps(b['greedy_text_llamacpp'][0])} (token for token what transformers gives on the native "
                  "checkpoint)."]
    if runs:
        lines += ["", "## Decode speed", "",
                  "`benchmarks/llamacpp/decode_worker.py` (run by the bench): every model of a run loaded in one llama.cpp "
                  "process, each with its own f16 KV cache; each sequence grown (WikiText-2 test tokens) to each "
                  "context length in turn, then single-token decode steps timed per model in rounds, the model "
                  "order reversed every other round, the 1-minute load average read before and after every timing. "
                  "Same type (f32 weights, f16 cache), same threads (1), same process. The quiet-machine runs first, "
                  "then the others in the order of their weight for issue 48 (the 25% GGUF against the source)."]
    order = ["no-fa-8k", "fa", "no-fa", "fa-50-12.5"]
    for tag in sorted(runs, key=lambda t: (t not in quiet, order.index(t) if t in order else len(order))):
        lines += decode_section(tag, runs[tag])
    for tag, p in (r.get("profile") or {}).items():
        lines += profile_section(tag, p)
    marker = "<!-- written by hand from here on: benchmarks/llamacpp/run.py keeps it -->"
    old = (OUT / "README.md").read_text() if (OUT / "README.md").exists() else ""
    if marker in old:
        lines += ["", marker + old.split(marker, 1)[1].rstrip()]
    (OUT / "README.md").write_text("\n".join(lines) + "\n")


def plot(r: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.2))
    labels = [label(x["budget"]) for x in r["budgets"]]
    xs = range(len(labels))
    a.bar([x - 0.2 for x in xs], [x["ppl_transformers"] for x in r["budgets"]], 0.4, label="transformers")
    a.bar([x + 0.2 for x in xs], [x["ppl_llamacpp"] for x in r["budgets"]], 0.4, label="llama.cpp (f32 GGUF)")
    a.set_xticks(list(xs), labels)
    a.set_ylabel("WikiText-2 test perplexity")
    a.set_title("same conversion, same token ids")
    a.legend()
    colors = {"source": "black", "50%": "tab:blue", "25%": "tab:orange", "12.5%": "tab:green"}
    runs = r.get("decode") or {}
    quiet = {tag: d for tag, d in runs.items() if tag in quiet_runs(runs)}
    runs = quiet or runs  # the quiet-machine runs where there are some: the others only compare models side by side
    markers = "os^vD"
    for i, (tag, d) in enumerate(runs.items()):
        for name, m in d["models"].items():
            pts = sorted((int(c), x["best_tokens_per_s"]) for c, x in m["contexts"].items())
            b.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], color=colors.get(name),
                   linestyle="-" if i == 0 else "--", label=f"{name} ({tag})" if len(runs) > 1 else name)
    b.set_xscale("log", base=2)
    b.set_xlabel("context (tokens)")
    b.set_ylabel("decode tokens/s (best of rounds)")
    b.set_title(f"llama.cpp decode, f32, {r.get('threads')} thread(s), {'quiet' if quiet else 'shared'} machine")
    b.legend(fontsize=7)
    for tag, p in (r.get("profile") or {}).items():
        style = "-" if p["flash_attn"] else ":"
        for name, m in p["models"].items():
            pts = sorted((int(k), 1e3 * x["cpu_step_seconds"]) for k, x in m.items())
            (line,) = c.plot([q[0] for q in pts], [q[1] for q in pts], marker="o", linestyle="none",
                             color=colors.get(name))
            (lo, t_lo), (hi, t_hi) = pts[0], pts[-1]
            slope = (t_hi - t_lo) / (hi - lo)
            xs = [lo, 16384]
            c.plot(xs, [t_lo + slope * (x - lo) for x in xs], linestyle=style, color=line.get_color(),
                   label=f"{name}, flash attention {'on' if p['flash_attn'] else 'off'}")
    c.set_xlabel("context (tokens)")
    c.set_ylabel("CPU ms per decode step (1 thread)")
    c.set_title("CPU time per step: measured (dots), a + b x context (lines)")
    c.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "decode.png", dpi=110)


if __name__ == "__main__":
    main()
