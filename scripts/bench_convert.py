#!/usr/bin/env python
"""The README's main job, run as a new user would, plus a 50% conversion and a fresh-process load check.

    nice python scripts/bench_convert.py          # -> benchmarks/convert.md, benchmarks/convert.json

1. `bash scripts/main.sh OUT25` (convert the embedded SmolLM2-135M to 25% of its KV cache, calibrated on WikiText-2
   validation; eval source and converted on WikiText-2 raw test, 16 x 2048 windows): wall time and peak RSS of the
   whole job, and of the conversion alone.
2. The same conversion at 50% (`--kv-budget 0.5`) and its eval.
3. A fresh Python process that imports mla_convert, loads each converted folder with AutoModelForCausalLM, generates
   greedily from a prompt, and measures the KV-cache bytes per token in the cache tensors; compared with the plan
   (provenance.json).
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
MLA = str(Path(sys.executable).with_name("mla-convert"))
PPL = re.compile(r"perplexity ([0-9.]+) over .*KV cache (\d+) bytes/token")

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


def timed(cmd: list[str], env=None) -> tuple[str, float, int]:
    """(combined output, wall seconds, peak RSS bytes over the process and its waited-for children)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise SystemExit(f"{' '.join(cmd)} failed:\n{output[-3000:]}")
    return output, time.perf_counter() - start, usage.ru_maxrss * 1024


def main() -> None:
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"), HF_HUB_OFFLINE="1")
    out25, out50 = ROOT / "out" / "smollm2-135m-mla-25", ROOT / "out" / "smollm2-135m-mla-50"
    result: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cores", "commit": subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()}  # fmt: skip

    text, wall, rss = timed(["bash", "scripts/main.sh", str(out25)], env)
    evals = PPL.findall(text)
    convert_line = next(l for l in text.splitlines() if l.startswith("KV cache per token (all layers"))
    result["main"] = {"command": "bash scripts/main.sh", "wall_s": round(wall, 1), "peak_rss_mb": round(rss / 2**20),
                      "source_ppl": float(evals[0][0]), "source_kv_bytes": int(evals[0][1]),
                      "converted_ppl": float(evals[1][0]), "converted_kv_bytes": int(evals[1][1]), "plan": convert_line}  # fmt: skip

    cmd = [MLA, "llama", "--kv-budget", "0.5", "--calib-data", str(DATA / "wiki.valid.tokens"), "-o", str(out50),
           "--overwrite", "-q"]  # fmt: skip
    text, wall, rss = timed(cmd, env)
    result["convert50"] = {"command": "mla-convert llama --kv-budget 0.5 --calib-data "
                           "../shared/data/wikitext-2/wiki.valid.tokens -o out/smollm2-135m-mla-50",
                           "wall_s": round(wall, 1), "peak_rss_mb": round(rss / 2**20)}  # fmt: skip
    text, _, _ = timed([MLA, "eval", str(out50), "--data", str(DATA / "wiki.test.raw"), "--seq-len", "2048",
                        "--windows", "16", "-q"], env)  # fmt: skip
    ppl, kv = PPL.findall(text)[0]
    result["convert50"].update(converted_ppl=float(ppl), converted_kv_bytes=int(kv))

    for name, folder in (("load25", out25), ("load50", out50)):
        text, _, _ = timed([sys.executable, "-c", CHECK, str(folder)], env)
        result[name] = json.loads(text.strip().splitlines()[-1])
    (ROOT / "benchmarks" / "convert.json").write_text(json.dumps(result, indent=2) + "\n")
    write_markdown(result)


def write_markdown(r: dict) -> None:
    m, h = r["main"], r["convert50"]
    lines = [
        "# Converting the embedded default (SmolLM2-135M-Instruct) end to end",
        "",
        f"Written by `python scripts/bench_convert.py` at commit {r['commit']} on {r['machine']} (CPU, float32; the "
        "machine was shared with other jobs, so times are upper bounds).",
        "",
        "## The README's first command",
        "",
        f"`{m['command']}` (convert to 25% of the KV cache calibrated on WikiText-2 validation, then `mla-convert eval` "
        "of source and converted on WikiText-2 raw test, 16 x 2048-token windows):",
        "",
        f"- wall time {m['wall_s']:.0f} s for the whole job, peak RSS {m['peak_rss_mb']} MB",
        f"- plan: {m['plan']}",
        "",
        "| model | KV cache per token (measured in the cache tensors) | perplexity | conversion wall s | conversion peak RSS MB |",
        "|---|---|---|---|---|",
        f"| source (GQA, 384 elements/token/layer) | {m['source_kv_bytes']} B | {m['source_ppl']:.2f} | | |",
        f"| MLA, 50% (`{h['command']}`) | {h['converted_kv_bytes']} B | {h['converted_ppl']:.2f} | {h['wall_s']:.0f} | {h['peak_rss_mb']} |",
        f"| MLA, 25% (`scripts/main.sh`) | {m['converted_kv_bytes']} B | {m['converted_ppl']:.2f} | (in the job above) | |",
        "",
        "## Loading in a fresh process",
        "",
        "`import mla_convert` then `AutoModelForCausalLM.from_pretrained(folder)` (no trust_remote_code), greedy "
        "generation of 24 tokens after \"The history of the Roman Empire\":",
        "",
        "| folder | class | cache bytes/token measured | plan | source | generated |",
        "|---|---|---|---|---|---|",
    ]
    for name, label in (("load50", "50%"), ("load25", "25%")):
        g = r[name]
        same = "equal" if g["measured_bytes_per_token"] == g["plan_bytes_per_token"] else "DIFFERENT"
        text = g["text"].replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {label} | {g['class']} | {g['measured_bytes_per_token']} ({same}) | "
                     f"{g['plan_bytes_per_token']} | {g['source_bytes_per_token']} | {text} |")  # fmt: skip
    lines.append("")
    (ROOT / "benchmarks" / "convert.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
