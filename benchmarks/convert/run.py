#!/usr/bin/env python
"""The README's main job on the embedded default, measured, and a fresh-process load check of its outputs.

    nice python benchmarks/quality/run.py --budgets 192,96    # converts and evaluates (its mla-convert rows)
    python benchmarks/convert/run.py              # -> benchmarks/convert/README.md, benchmarks/convert/convert.json

`scripts/main.sh` (the README's first command after the install) runs `mla-convert llama --kv-budget 0.25
--calib-data ../shared/data/wikitext-2/wiki.valid.tokens -o OUT` and `mla-convert eval` of source and result on
WikiText-2 raw test (16 x 2048 windows). benchmarks/quality/run.py runs exactly those commands (budget 96 = 25% and
192 = 50% of SmolLM2-135M's 384 elements per token per layer), each in its own timed process with its peak RSS; this
script takes those rows (one measurement, not two) and adds the check a new user would do next: a fresh Python
process imports mla_convert, loads each converted folder with AutoModelForCausalLM (no trust_remote_code), generates
greedily, and measures the KV-cache bytes per token in the cache tensors against the plan in provenance.json.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common import harness  # noqa: E402  (timed processes, the machine record)

BENCH = ROOT / "benchmarks" / "convert"  # this benchmark's folder: README.md (the report) and its data
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"

CHECK = r"""
import json, sys, time
import torch
import mla_convert  # registers the MLA model type
from transformers import AutoModelForCausalLM, AutoTokenizer
from mla_convert.evaluate import kv_cache_bytes_per_token
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
tok = AutoTokenizer.from_pretrained(folder)
ids = tok("The history of the Roman Empire", return_tensors="pt").input_ids
with torch.inference_mode():
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=24, do_sample=False)
    seconds = time.perf_counter() - start
    measured = kv_cache_bytes_per_token(model)
plan = json.load(open(f"{folder}/provenance.json"))["kv_cache"]
print(json.dumps({"class": type(model).__name__, "text": tok.decode(out[0][ids.shape[1]:], skip_special_tokens=True),
                  "new_tokens_per_s": 24 / seconds, "measured_bytes_per_token": measured,
                  "plan_bytes_per_token": plan["bytes_per_token_after"], "source_bytes_per_token": plan["bytes_per_token_before"]}))
"""


def main() -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), HF_HUB_OFFLINE="1")
    results = ROOT / "benchmarks" / "quality" / "quality.jsonl"
    rows = harness.read_jsonl(results)
    pick = {(r["method"], r["budget"]): r for r in rows if r.get("windows") == 16}
    source = pick[("source", None)]
    result: dict = {"machine": harness.machine(), "commit": harness.commit(),
        "source": {"perplexity": source["perplexity"], "kv_bytes": source["kv_bytes_per_token"],
                   "eval_s": source["eval_s"], "eval_rss_mb": source["eval_rss_mb"]}}  # fmt: skip
    for budget, share in ((192, "50%"), (96, "25%")):
        row = pick[("mla-convert", budget)]
        folder = ROOT / "out" / "bench-quality" / f"mlaconvert-{budget}"
        load = None
        if (folder / "config.json").is_file():  # a run of bench_quality older than its keep rule removed some
            text = harness.timed([sys.executable, "-c", CHECK, folder], env=env).output
            load = json.loads(text.strip().splitlines()[-1])
        result[share] = {"command": f"mla-convert llama --kv-budget {budget / 384:g} --calib-data "
                         "../shared/data/wikitext-2/wiki.valid.tokens -o OUT",
                         "d_c": row["d_c"], "d_r": row["d_r"], "convert_s": row["convert_s"],
                         "convert_rss_mb": row["convert_rss_mb"], "perplexity": row["perplexity"],
                         "kv_bytes": row["kv_bytes_per_token"], "eval_s": row["eval_s"],
                         "load": load}  # fmt: skip
    result["quiet"] = time_conversions(env)
    BENCH.mkdir(exist_ok=True)
    (BENCH / "convert.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result)


def time_conversions(env) -> list[dict]:
    """The conversion alone, each budget in its own process, on the machine as it is now (run this when nothing else
    runs: the load averages before and after are recorded to show it)."""
    out = []
    for share, fraction in (("50%", 0.5), ("25%", 0.25)):
        folder = ROOT / "out" / "bench-convert-time"
        load_before = os.getloadavg()[0]
        run = harness.convert(["llama", "--kv-budget", fraction, "--calib-data", DATA / "wiki.valid.tokens",
                               "--overwrite", "-q"], folder, env=env).run  # fmt: skip
        wall, rss = run.wall_s, run.peak_rss
        out.append({"share": share, "command": f"mla-convert llama --kv-budget {fraction:g} --calib-data "
                    "../shared/data/wikitext-2/wiki.valid.tokens -o OUT", "wall_s": round(wall, 1),
                    "peak_rss_mb": round(rss / 2**20), "threads": env["OMP_NUM_THREADS"],
                    "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)})  # fmt: skip
        shutil.rmtree(folder, ignore_errors=True)
    return out


def write_markdown(r: dict) -> None:
    src = r["source"]
    total = sum(r[k]["convert_s"] + r[k]["eval_s"] for k in ("25%",)) + src["eval_s"]
    lines = [
        "# Converting the embedded default (SmolLM2-135M-Instruct) end to end",
        "",
        f"Written by `python benchmarks/convert/run.py` at commit {r['commit']} on {harness.describe(r['machine'])} "
        "(CPU, float32), from "
        "the timed processes of `benchmarks/quality/run.py` (see benchmarks/quality/README.md) plus a fresh-process "
        "load "
        "check. The machine was shared with other benchmark jobs while those ran: their times are upper bounds (the "
        "quiet-machine conversion times are below).",
        "",
        "README's first command, `bash scripts/install.sh && bash scripts/main.sh`: after the install, the conversion "
        f"to 25% and the two evaluations took {total / 60:.1f} min of wall time in all (sum of the rows below).",
        "",
        "| model | command | d_c + d_r | KV cache bytes/token (measured) | perplexity (wikitext-2 raw test, 16 x 2048) "
        "| convert wall s | convert peak RSS MB | eval wall s |",
        "|---|---|---|---|---|---|---|---|",
        f"| source (GQA, 384 elements/token/layer) | `mla-convert eval --data ../shared/data/wikitext-2/wiki.test.raw` "
        f"| | {src['kv_bytes']} | {src['perplexity']:.2f} | | | {src['eval_s']:.0f} |",
    ]
    for share in ("50%", "25%"):
        m = r[share]
        lines.append(f"| MLA {share} | `{m['command']}` | {m['d_c']:g} + {m['d_r']} | {m['kv_bytes']} | "
                     f"{m['perplexity']:.2f} | {m['convert_s']:.0f} | {m['convert_rss_mb']} | {m['eval_s']:.0f} |")  # fmt: skip
    lines += [
        "",
        "## Conversion time on a quiet machine",
        "",
        "The conversion alone (from the embedded GGUF, calibration of 8 x 2048 tokens included), one fresh process per "
        "budget, run by this script after the benchmark jobs had ended (load average before and after shown):",
        "",
        "| budget | command | wall s | peak RSS MB | OMP threads | load before / after |",
        "|---|---|---|---|---|---|",
    ]
    for q in r.get("quiet", []):
        lines.append(f"| {q['share']} | `{q['command']}` | {q['wall_s']:.0f} | {q['peak_rss_mb']} | {q['threads']} | "
                     f"{q['load_before']:.2f} / {q['load_after']:.2f} |")
    lines += [
        "",
        "## Loading in a fresh process",
        "",
        "`import mla_convert` then `AutoModelForCausalLM.from_pretrained(folder)` (no trust_remote_code), greedy "
        "generation of 24 tokens after \"The history of the Roman Empire\" (one-shot conversion, no fine-tuning):",
        "",
        "| folder | class | cache bytes/token measured | plan | source | tokens/s | generated |",
        "|---|---|---|---|---|---|---|",
    ]
    for share in ("50%", "25%"):
        g = r[share]["load"]
        if g is None:
            lines.append(f"| {share} | (folder not kept by that benchmark run: not checked) | | | | | |")
            continue
        same = "equal" if g["measured_bytes_per_token"] == g["plan_bytes_per_token"] else "DIFFERENT"
        text = g["text"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {share} | {g['class']} | {g['measured_bytes_per_token']} ({same}) | "
                     f"{g['plan_bytes_per_token']} | {g['source_bytes_per_token']} | {g['new_tokens_per_s']:.1f} | {text} |")  # fmt: skip
    lines.append("")
    (BENCH / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report-only", action="store_true", help="rewrite README.md from convert.json")
    if ap.parse_args().report_only:
        write_markdown(json.loads((BENCH / "convert.json").read_text()))
    else:
        main()
