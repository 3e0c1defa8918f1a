"""Serving benchmark: the converted model in vLLM (its CPU build here) against transformers, same folder, same tokens.

For each KV budget: the default conversion (native checkpoint, served through mla-convert's vLLM plugin) scored by
vLLM in bfloat16 and float32 and by transformers in float32 on the first WINDOWS x SEQ_LEN tokens of WikiText-2 test
(each window on its own, as `mla-convert eval` does); greedy continuations compared; vLLM's decode tokens/s for the
source model and the converted ones; the KV-cache bytes per token vLLM allocates (read from its cache tensors and
block count). With --deepseek, also (at the first budget) the `--target deepseek` conversion's DeepSeek-V3 export
(padded to 512 + 64 for vLLM's CPU MLA kernel) to show what that route costs.

--domains measures only the domain section (the rows above stay as serving.json has them, and a run without it keeps
that section): the DeepSeek-V3 export the default pipeline makes (`mla-convert llama --kv-budget B --target deepseek
--format deepseek`) at each budget, scored on WikiText-2 test, the Debian Reference and the GNU Coding Standards
(benchmarks/common/domain_texts.py): by benchmarks/common/score_domains.py in stock transformers' DeepseekV3ForCausalLM (float32, a
process that never imports mla_convert) and in vLLM's own DeepseekV3ForCausalLM with no plugin loaded (bfloat16, the
export padded to vLLM's CPU row of 512 + 64, with vLLM's cache bytes a token), and as a GGUF by `mla-convert eval
--engine llamacpp`; beside the native default's and the source's scores on the same windows
(benchmarks/quality/quality.jsonl).
Writes benchmarks/serving/README.md and benchmarks/serving/serving.json (the domain scores' own JSON files in
benchmarks/serving/domains/).

    python benchmarks/serving/run.py [--budgets 0.5 0.25] [--windows 16] [--deepseek] [--domains] [--reuse]

Needs .venv-vllm (scripts/install-vllm.sh). Conversions are made with `mla-convert` if their folder is missing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "serving"  # this benchmark's folder: README.md (the report) and its data
sys.path.insert(0, str(ROOT))
from benchmarks.common import harness  # noqa: E402  (mla-convert processes, the machine record)

from mla_convert import evaluate  # noqa: E402
from mla_convert.serving import engine  # noqa: E402

DATA = ROOT.parent / "shared" / "data" / "wikitext-2"


def run(cmd: list[str]) -> None:
    """`mla-convert ...` (cmd as recorded: its first word is mla-convert), its output shown as it comes."""
    harness.timed(harness.mla(*cmd[1:]), echo=True, tee=True)


def source_folder(out: Path) -> Path:
    """The embedded default as a safetensors folder (vLLM reads folders; the source ships as GGUF)."""
    folder = out / "source-hf"
    if not (folder / "config.json").exists():
        model, tokenizer, _ = evaluate.load_model(None)
        # transformers refuses to save a model loaded from GGUF; the de-quantized weights go into a plain copy
        config = type(model.config).from_dict(
            {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"})
        plain = type(model)(config)
        plain.load_state_dict(model.state_dict())
        plain.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    return folder


def windows_of(folder: Path, count: int, seq_len: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = evaluate.tokenize(tokenizer, (DATA / "wiki.test.raw").read_text())
    return evaluate.eval_windows(ids, seq_len, count).tolist()


def bytes_per_token(report: dict) -> float | None:
    return report.get("bytes_per_token")


def relative(text: str) -> str:
    """`text` with this checkout's and the data folder's paths written relative to the repository."""
    return text.replace(str(ROOT) + "/", "").replace(str(ROOT.parent / "shared"), "../shared")

# --domains: the texts (name as benchmarks/quality/quality.jsonl names them -> file), and where their scores go
DOMAIN_TEXTS = {"wikitext": DATA / "wiki.test.raw",
                "debian-reference": ROOT / "out" / "domains" / "debian-reference.txt",
                "gnu-standards": ROOT / "out" / "domains" / "gnu-standards.txt"}  # fmt: skip
DOMAINS = BENCH / "domains"
QUALITY = ROOT / "benchmarks" / "quality" / "quality.jsonl"


def default_exports(out: Path, budget: float) -> tuple[Path, Path, Path, list[str]]:
    """The default pipeline's DeepSeek-V3 export at `budget` (converted if missing), its copy padded to vLLM's CPU row
    (512 + 64, bfloat16), its GGUF (f32 weights) for llama.cpp, and the commands that make them."""
    folder = out / f"ds-default-{int(budget * 1000)}"
    padded, gguf = folder.with_name(folder.name + "-576"), folder.with_name(folder.name + ".gguf")
    conv = ["mla-convert", "llama", "--kv-budget", str(budget), "--target", "deepseek", "--format", "deepseek",
            "-o", str(folder)]  # fmt: skip
    pad = ["mla-convert", "export", str(folder) + "-native", "--format", "deepseek", "--pad-latent", "flashmla",
           "--dtype", "bfloat16", "-o", str(padded)]  # fmt: skip
    to_gguf = ["mla-convert", "export", str(folder) + "-native", "--format", "gguf", "-o", str(gguf)]
    for cmd, made in ((conv, folder / "config.json"), (pad, padded / "config.json"), (to_gguf, gguf)):
        if not made.exists():
            run(cmd)
    shown = [relative(" ".join(cmd)) for cmd in (conv, pad, to_gguf)]
    return folder, padded, gguf, shown


def reusable(path: Path, label: str, protocol: dict, args) -> dict | None:
    """With --reuse, the score record at `path` when it holds `label` measured under `protocol` (every key equal in
    its "protocol", or in its "how" for the label where the protocol does not name it); else None."""
    if not (args.reuse and path.exists()):
        return None
    old = json.loads(path.read_text())
    how = old.get("how", {}).get(label)
    recorded = {**(how if isinstance(how, dict) else {}), **old["protocol"]}
    same = all(recorded.get(k) == v for k, v in protocol.items())
    return old if same and label in old["results"] else None


def score_llamacpp(label: str, gguf: Path, args) -> dict:
    """`mla-convert eval GGUF --engine llamacpp` on each of DOMAIN_TEXTS, as one record like score_texts' (with
    llama.cpp's cache bytes a token), written to DOMAINS/LABEL.json; --reuse reads a record of the same protocol."""
    path = DOMAINS / f"{label}.json"
    protocol = {"windows": args.windows, "seq_len": args.seq_len, "engine": "llamacpp"}
    if old := reusable(path, label, protocol, args):
        return old
    results, how = {}, {}
    for name, text in DOMAIN_TEXTS.items():
        res = harness.score(gguf, text, args.seq_len, args.windows, engine="llamacpp")
        print(label, name, res["perplexity"], flush=True)
        results[name] = res["perplexity"]
        how[name] = {key: res.get(key) for key in ("engine", "kv_cache_bytes_per_token", "wall_s")}
        how[name]["command"] = res["command"].split(" --json ")[0]  # without the temporary JSON file's path
    record = {"protocol": protocol, "results": {label: results}, "how": {label: how}}
    text = relative(json.dumps(record, indent=1))
    path.write_text(text + "\n")
    return json.loads(text)


def score_texts(label: str, folder: Path, engine: str, dtype: str, args) -> dict:
    """benchmarks/common/score_domains.py's record for `folder` on DOMAIN_TEXTS (one model), written to DOMAINS/LABEL.json; with
    --reuse, an existing record of the same protocol is read instead."""
    from benchmarks.common import score_domains

    path = DOMAINS / f"{label}.json"
    texts = {name: str(file) for name, file in DOMAIN_TEXTS.items()}
    protocol = {"windows": args.windows, "seq_len": args.seq_len, "dtype": dtype, "engine": engine,
                **({"plugins": ""} if engine == "vllm" else {})}  # vLLM with no plugin loaded
    if old := reusable(path, label, protocol, args):
        return old
    argv = ["--models", f"{label}={folder}", "--texts", ",".join(f"{n}={f}" for n, f in texts.items()),
            "--windows", str(args.windows), "--seq-len", str(args.seq_len), "--dtype", dtype, "--engine", engine,
            "--json", str(path), *(["--vllm-plugins", "none"] if engine == "vllm" else [])]  # fmt: skip
    print("$ python benchmarks/common/score_domains.py " + " ".join(argv), flush=True)
    score_domains.main(argv)
    text = relative(path.read_text())
    path.write_text(text)
    return json.loads(text)


def quality_rows(budget: float, windows: int) -> dict:
    """The source's and the native default's perplexities on DOMAIN_TEXTS (same windows) from the quality benchmark's
    rows: {"source": {text: ppl}, "native": {text: ppl}, "native_command": ...}; {} where it has none."""
    source_cache = 2 * 3 * 64  # SmolLM2-135M: 3 kv heads of 64 dims, keys and values (values a token a layer)
    found = {}
    for row in harness.read_jsonl(QUALITY):
        if row.get("windows") != windows or not row.get("texts"):
            continue
        scores = {name: v["perplexity"] for name, v in row["texts"].items() if name in DOMAIN_TEXTS}
        if row["method"] == "source":
            found["source"] = scores
        elif row["method"] == "mla-convert" and row.get("budget") == round(budget * source_cache):
            found["native"], found["native_command"] = scores, row["command"]
    return found


def measure_domains(args) -> dict:
    """The --domains section: per budget, the export in stock transformers and in vLLM, with the references."""
    missing = [str(f) for f in DOMAIN_TEXTS.values() if not f.exists()]
    if missing:
        raise SystemExit(f"missing {', '.join(missing)}: run python benchmarks/common/domain_texts.py first")
    DOMAINS.mkdir(parents=True, exist_ok=True)
    section = {"windows": args.windows, "seq_len": args.seq_len, "budgets": [], "commands": [],
               "machine": harness.machine()}
    for budget in args.budgets:
        folder, padded, gguf, commands = default_exports(args.out, budget)
        section["commands"] += commands
        tag = f"ds-default-{int(budget * 1000)}"
        hf = score_texts(tag, folder, "transformers", "float32", args)
        vl = score_texts(tag + "-576", padded, "vllm", "bfloat16", args)
        how = vl["how"][tag + "-576"]
        cpp = score_llamacpp(tag + "-gguf", gguf, args)
        cpp_how = next(iter(cpp["how"][tag + "-gguf"].values()))
        section["budgets"].append({
            "budget": budget, **quality_rows(budget, args.windows),
            "transformers": hf["results"][tag], "transformers_how": hf["how"][tag],
            "vllm": vl["results"][tag + "-576"], "vllm_kv_cache": how["kv_cache"], "vllm_class": how["model_class"],
            "vllm_backend": how["attention_backend"], "vllm_plugins": how["plugins"],
            "vllm_version": how["vllm_version"],
            "llamacpp": cpp["results"][tag + "-gguf"], "llamacpp_engine": cpp_how["engine"],
            "llamacpp_kv_bytes_per_token": cpp_how["kv_cache_bytes_per_token"],
        })  # fmt: skip
    return section


def domains_report(section: dict) -> list[str]:
    """README lines of the --domains section."""
    names = list(DOMAIN_TEXTS)
    lines = [
        "", "## The default pipeline's DeepSeek-V3 export on three domains", "",
        "Command: `python benchmarks/serving/run.py --domains` (its conversions and exports below; each score is "
        "benchmarks/common/score_domains.py's JSON in benchmarks/serving/domains/). Perplexity on the first "
        f"{section['windows']} windows of {section['seq_len']} tokens of each text, each window on its own. "
        "Stock transformers: `DeepseekV3ForCausalLM` in float32 in a process that never imports mla_convert. vLLM: "
        "its CPU build with no plugin loaded (`VLLM_PLUGINS` empty), its own `DeepseekV3ForCausalLM` (the class it "
        "built is recorded) on the export padded to its CPU row (512 + 64, exact), bfloat16; its cache bytes a token "
        "are its own report. llama.cpp: the same conversion as a GGUF (`mla-convert eval FILE --engine llamacpp`), "
        "its cache bytes from its own log (f16 cache, within its log's 0.01 MiB resolution). The source and the "
        "native default (mla-convert's own checkpoint) are benchmarks/quality's rows on the same windows. Machine: "
        f"{harness.describe(section['machine']) if section.get('machine') else 'not recorded'}.", "",
        "```", *section["commands"], "```", "",
        "| budget | model | served by | " + " | ".join(names) + " | KV bytes a token |",
        "|---|---|---|" + "---:|" * len(names) + "---:|",
    ]  # fmt: skip

    def cells(scores: dict, ref: dict | None, digits: int = 1) -> str:
        return " | ".join(f"{scores[n]:.2f}" + (f" ({scores[n] / ref[n] - 1:+.{digits}%})" if ref else "")
                          for n in names)

    for b in section["budgets"]:
        pct = f"{b['budget']:.0%}"
        kv = b["vllm_kv_cache"]["bytes_per_token"]
        plugin = ", mla-convert's plugin loaded (its CPU rotary fix)" if b["vllm_plugins"] is None else ", no plugin"
        if b.get("source"):
            lines.append(f"| {pct} | source | transformers | {cells(b['source'], None)} | |")
        if b.get("native"):
            lines.append(f"| {pct} | native default | transformers | {cells(b['native'], None)} | |")
        lines.append(f"| {pct} | DeepSeek-V3 export | stock transformers fp32 (vs native default) | "
                     f"{cells(b['transformers'], b.get('native'))} | |")
        lines.append(f"| {pct} | DeepSeek-V3 export, padded 576 | vLLM {b['vllm_version']} "
                     f"{b['vllm_class'].rsplit('.', 1)[-1]} bf16, {b['vllm_backend']}{plugin} (vs transformers) | "
                     f"{cells(b['vllm'], b['transformers'], 2)} | {kv:,.0f} |")
        if b.get("llamacpp"):
            lines.append(f"| {pct} | DeepSeek-V3 GGUF, f32 weights | {b['llamacpp_engine']} deepseek2, f16 cache (vs "
                         f"transformers) | {cells(b['llamacpp'], b['transformers'], 2)} | "
                         f"{b['llamacpp_kv_bytes_per_token']:,.0f} |")
    return lines


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25])
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=ROOT / "out" / "bench-serving")
    ap.add_argument("--deepseek", action="store_true", help="also the --target deepseek export route")
    ap.add_argument("--domains", action="store_true",
                    help="only the default pipeline's DeepSeek-V3 export on three domains (the other rows are kept)")
    ap.add_argument("--reuse", action="store_true", help="keep rows of benchmarks/serving/serving.json (same protocol)")
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--decode-only", action="store_true", help="re-measure decode speed of the serving.json rows")
    ap.add_argument("--report-only", action="store_true", help="rewrite README.md from benchmarks/serving/serving.json")
    return ap.parse_args()


def redo_decode(args) -> None:
    """Decode speed measured again for the rows of benchmarks/serving/serving.json (a quieter machine)."""
    path = BENCH / "serving.json"
    result = json.loads(path.read_text())
    decode = {"batch": args.decode_batch, "prompt_tokens": args.decode_prompt, "new_tokens": args.decode_tokens}
    for row in result["rows"]:
        res = engine.score_in_vllm(ROOT / row["folder"], dtype="bfloat16", max_model_len=args.seq_len + 64,
                                   decode=decode)
        row["vllm_bfloat16"]["decode_tokens_per_s"] = res["decode_tokens_per_s"]
        print(row["label"], res["decode_tokens_per_s"], flush=True)
    result["decode"], result["decode_separate_run"], result["decode_machine"] = decode, True, harness.machine()
    path.write_text(json.dumps(result, indent=1))
    write_report(result, BENCH / "README.md")


def measure_row(label: str, folder: Path, budget: float | None, route: str, args, windows, prompts, decode: dict,
                meta: dict) -> dict:
    """One model in vLLM (bfloat16 and float32) and in transformers: perplexity, greedy tokens, KV cache, decode."""
    row = {"label": label, "folder": str(folder.relative_to(ROOT)), "budget": budget, "route": route}
    for dtype in ("bfloat16", "float32"):
        t0 = time.time()
        res = engine.score_in_vllm(folder, windows, prompts, new_tokens=24, dtype=dtype,
                                   max_model_len=args.seq_len + 64, decode=decode if dtype == "bfloat16" else None)
        row[f"vllm_{dtype}"] = {
            "perplexity": engine.perplexity(res["logprobs"]), "greedy": res["greedy"],
            "kv_cache": res["kv_cache"], "backend": res["attention_backend"],
            "decode_tokens_per_s": res.get("decode_tokens_per_s"), "seconds": time.time() - t0,
        }  # fmt: skip
        row[f"vllm_{dtype}"]["logprobs"] = res["logprobs"]
        meta["vllm_version"] = res["vllm_version"]
        print(label, dtype, row[f"vllm_{dtype}"]["perplexity"], flush=True)
    t0 = time.time()
    hf = engine.score_in_transformers(folder, windows, prompts, new_tokens=24, dtype=torch.float32)
    row["transformers_float32"] = {"perplexity": engine.perplexity(hf["logprobs"]), "greedy": hf["greedy"],
                                   "seconds": time.time() - t0}
    for dtype in ("bfloat16", "float32"):
        v = row[f"vllm_{dtype}"]
        v["max_abs_logprob_diff"] = engine.max_logprob_difference(hf["logprobs"], v.pop("logprobs"))
        v["greedy_tokens_equal"] = sum(a == b for p, q in zip(hf["greedy"], v["greedy"]) for a, b in zip(p, q))
    print(label, "transformers", row["transformers_float32"]["perplexity"], flush=True)
    return row


def main() -> None:
    args = parse_args()
    if args.decode_only:
        return redo_decode(args)
    if args.report_only:
        write_report(json.loads((BENCH / "serving.json").read_text()), BENCH / "README.md")
        return
    if args.domains:  # only the domain section; the WikiText rows stay as measured
        args.out.mkdir(parents=True, exist_ok=True)
        result = json.loads((BENCH / "serving.json").read_text())
        result["domains"] = measure_domains(args)
        (BENCH / "serving.json").write_text(json.dumps(result, indent=1))
        write_report(result, BENCH / "README.md")
        return
    measure_all(args)


def measure_all(args) -> None:
    """The source, each budget's default conversion (and with --deepseek its export), measured and reported."""
    args.out.mkdir(parents=True, exist_ok=True)
    calib = str(DATA / "wiki.valid.tokens")
    src = source_folder(args.out)
    windows = windows_of(src, args.windows, args.seq_len)
    prompts = [w[:32] for w in windows[:3]]
    decode = {"batch": args.decode_batch, "prompt_tokens": args.decode_prompt, "new_tokens": args.decode_tokens}
    rows, commands, result_meta = [], [], {"machine": harness.machine()}
    bench = BENCH
    previous = json.loads((bench / "serving.json").read_text()) if (bench / "serving.json").exists() else {}
    if previous.get("domains"):  # measured on its own (--domains): kept as it is
        result_meta["domains"] = previous["domains"]
    done = {}
    if args.reuse and previous:  # rows measured by an earlier run with the same protocol
        if (previous["windows"], previous["seq_len"]) == (args.windows, args.seq_len):
            done = {r["label"]: r for r in previous["rows"]}

    def save() -> dict:
        result = {"rows": rows, "commands": commands, "windows": args.windows, "seq_len": args.seq_len,
                  "decode": decode, "vllm_version": result_meta.get("vllm_version"),
                  "torch_threads": torch.get_num_threads(), "machine": result_meta["machine"]}
        if "domains" in result_meta:
            result["domains"] = result_meta["domains"]
        text = relative(json.dumps(result, indent=1))
        (bench / "serving.json").write_text(text)
        return json.loads(text)

    def measure_once(label, folder, budget, route):
        rows.append(done.get(label) or measure_row(label, folder, budget, route, args, windows, prompts, decode,
                                                   result_meta))  # fmt: skip
        save()

    measure_once("source SmolLM2-135M-Instruct (Llama, GQA)", src, None, "vLLM LlamaForCausalLM")
    for budget in args.budgets:
        folder = args.out / f"native-{int(budget * 1000)}"
        cmd = ["mla-convert", "llama", "--kv-budget", str(budget), "--calib-data", calib, "-o", str(folder)]
        if not (folder / "config.json").exists():
            run(cmd)
        commands.append(" ".join(cmd))
        measure_once(f"mla-convert default, {budget:.0%} cache", folder, budget, "vLLM + mla-convert plugin")
        if args.deepseek and budget == args.budgets[0]:  # one budget shows what the route costs
            ds_native, ds = args.out / f"ds-{int(budget * 1000)}-native", args.out / f"ds-{int(budget * 1000)}"
            conv = ["mla-convert", "llama", "--kv-budget", str(budget), "--target", "deepseek", "--rope-dims", "32",
                    "--calib-data", calib, "-o", str(ds_native)]
            exp = ["mla-convert", "export", str(ds_native), "--format", "deepseek", "--pad-latent", "flashmla",
                   "--dtype", "bfloat16", "-o", str(ds)]
            if not (ds / "config.json").exists():
                if not (ds_native / "config.json").exists():
                    run(conv)
                run(exp)
            commands += [" ".join(conv), " ".join(exp)]
            measure_once(f"--target deepseek export, {budget:.0%} cache", ds, budget, "vLLM DeepseekV3ForCausalLM")
    result = save()
    write_report(result, bench / "README.md")


def write_report(result: dict, path: Path) -> None:
    rows = result["rows"]
    src_bytes = bytes_per_token(rows[0]["vllm_bfloat16"]["kv_cache"])
    lines = [
        "# Serving in vLLM: the converted model against transformers, same folder, same tokens",
        "",
        "Command (vLLM's CPU build 0.32.0 in `.venv-vllm` from `scripts/install-vllm.sh`; "
        f"{harness.describe(result['machine']) if result.get('machine') else '2 CPU cores'}):",
        "",
        "```",
        "python benchmarks/serving/run.py " + ("--deepseek" if any("deepseek" in r["route"] for r in rows) else ""),
        "```",
        "",
        "Conversions it ran (calibration on the validation text only):",
        "",
        "```",
        *result["commands"],
        "```",
        "",
        f"Perplexity on the first {result['windows']} windows of {result['seq_len']} tokens of WikiText-2 raw test "
        "(each window on its own; vLLM: `SamplingParams(prompt_logprobs=0)`, transformers: float32 forward). "
        "KV bytes/token: vLLM's own cache tensors divided by the tokens its blocks hold (bfloat16 run, all layers; "
        "the token count is the one vLLM's log prints as `KV cache size`).",
        "",
        "| model | served by | vLLM bf16 ppl | vLLM fp32 ppl | transformers fp32 ppl | vLLM bf16 vs transformers | "
        "max abs log-prob diff fp32 / bf16 | greedy tokens equal (bf16, of 72) | vLLM KV bytes/token (bf16) | "
        "vs source | decode tok/s (vLLM bf16) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        b, f, h = r["vllm_bfloat16"], r["vllm_float32"], r["transformers_float32"]
        kv = bytes_per_token(b["kv_cache"])
        lines.append(
            f"| {r['label']} | {r['route']} ({b['backend']}) | {b['perplexity']:.3f} | {f['perplexity']:.3f} | "
            f"{h['perplexity']:.3f} | {b['perplexity'] / h['perplexity'] - 1:+.2%} | "
            f"{f['max_abs_logprob_diff']:.2g} / {b['max_abs_logprob_diff']:.2g} | {b['greedy_tokens_equal']} | "
            f"{kv:.0f} | {kv / src_bytes:.2f}x | {b['decode_tokens_per_s']:.1f} |"
        )
    d = result["decode"]
    lines += [
        "",
        f"Decode: batch {d['batch']}, {d['prompt_tokens']}-token prompts, {d['new_tokens']} new tokens, greedy, "
        "`enforce_eager=True`; tokens/s = batch x (new tokens - 1) / (time of the full run - time of a prefill-only "
        "run of the same prompts)"
        + (" (`--decode-only`: measured one model after another in a separate run, nothing else running)."
           if result.get("decode_separate_run") else "."),
    ]
    lines += [
        "",
        "Reading it:",
        "",
        "- float32: vLLM computes what transformers computes (log-probabilities equal to about 1e-4), for the native",
        "  checkpoint through the plugin and for the stock export alike. bfloat16 moves perplexity by under 0.5%; a",
        "  greedy continuation can part ways at the first near-tie and then differ in every later token.",
        "- The KV bytes are vLLM's: its MLA kernels on CPU take only 512 + 64 values per token per layer, so every",
        "  MLA model here is padded to 576 (exactly, with zeros), which is 1.5x this small source's GQA cache. The",
        "  saving needs sources whose cache exceeds 576 values per token per layer (7-8B Llama/Qwen: 1024-2048).",
        "- Decode speed on CPU compares vLLM's CPU_MLA backend, which vLLM describes as a reference implementation",
        "  (naive prefill, a decode kernel for 576 only), with its optimized CPU attention for the source: it says",
        "  nothing about MLA on GPUs, where the engines' MLA kernels are the tuned path.",
    ]
    if result.get("domains"):
        lines += domains_report(result["domains"])
    path.write_text("\n".join(lines) + "\n")
    print(path.read_text())


if __name__ == "__main__":
    main()
