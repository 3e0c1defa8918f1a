#!/usr/bin/env python
"""Long context for a list of models: `mla-convert eval --long-context` on each (perplexity by position bucket over
windows of the model's full context, pass-key retrieval at several lengths and depths), the buckets as ratios to the
first model's, in one table and one plot.

    python benchmarks/quality/longctx/run.py source=default source-q4_0=default@q4_0 mla-50=out/smollm2-mla \\
        mla-50-gguf=out/smollm2-mla.gguf [--data TEXT] [--windows 4] [--lengths 1024,2048,4096,8192] \\
        [--depths 0.1,0.5,0.9] [--trials 3] [--out benchmarks/quality/longctx]

A model is LABEL=PATH[@CACHE_TYPE]: PATH a model folder, a .gguf (scored in llama.cpp, `--engine llamacpp`) or
`default` (the embedded SmolLM2-135M-Instruct, in transformers); CACHE_TYPE the KV cache read as llama.cpp stores it
(`--cache-type`: the source's quantized caches, or llama.cpp's own for a .gguf). The first model is the reference:
every other model's buckets are given as perplexity ratios to it (`eval --reference`), so measure every model on the
same text and windows. The text defaults to WikiText-2 validation (`--data`; the retrieval filler is generated).
Writes OUT/LABEL.json (each eval's --json), OUT/results.json (one row per model, with the command, wall time, peak
memory and the machine), OUT/longctx.md (the tables) and OUT/longctx.png (bucket ratios by position).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from benchmarks.common import harness  # noqa: E402  (a timed mla-convert process, the machine record)

DATA = harness.ROOT.parent / "shared" / "data" / "wikitext-2" / "wiki.valid.tokens"


def parse_model(spec: str) -> dict:
    """LABEL=PATH[@CACHE_TYPE] -> {label, path (None: the embedded default), engine, cache_type}."""
    label, sep, rest = spec.partition("=")
    if not sep or not label or not rest:
        raise SystemExit(f"a model is LABEL=PATH[@CACHE_TYPE] (PATH: a folder, a .gguf or `default`), got {spec!r}")
    path, _, cache = rest.partition("@")
    return {"label": label, "path": None if path == "default" else path,
            "engine": "llamacpp" if path.endswith(".gguf") else "transformers", "cache_type": cache or None}


def kept_rows(path: Path) -> dict[str, dict]:
    """The rows of an earlier run's results.json, by label ({} when there is none)."""
    if not path.is_file():
        return {}
    return {row["label"]: row for row in json.loads(path.read_text())}


def measure(model: dict, args, out: Path, reference: Path | None, earlier: dict | None = None) -> dict:
    """One `eval --long-context` of `model`, timed; its result with the command, wall time and peak memory. With
    `earlier` (the model's row of an earlier run), that row when its command is this one's and its JSON is there."""
    json_out = out / f"{model['label']}.json"
    cmd = harness.mla("eval", *([model["path"]] if model["path"] else []), "--data", args.data, "--long-context",
                      "--windows", args.windows, "--trials", args.trials, "--engine", model["engine"],
                      *(["--lengths", args.lengths] if args.lengths else []), "--depths", args.depths,
                      *(["--cache-type", model["cache_type"]] if model["cache_type"] else []),
                      *(["--reference", reference] if reference else []), "--json", json_out, "--overwrite", "-q")
    if earlier and json_out.is_file() and earlier.get("command") == harness.shown(cmd):
        print(f"{model['label']}: kept from {out / 'results.json'}", flush=True)
        return earlier  # with the machine it was measured on
    run = harness.timed(cmd, log=out / f"{model['label']}.log", env={**os.environ, **harness.OFFLINE},
                        echo=True)
    result = json.loads(json_out.read_text())
    return {**model, "result": result, "command": run.command, "wall_s": run.wall_s, "peak_rss": run.peak_rss}


def retrieval_cells(result: dict) -> dict[str, str]:
    """{"LENGTH@DEPTH": "found/trials"} of one result."""
    ret = result["long_context"]["retrieval"]
    cells = {}
    for case in ret["cases"]:
        key = f"{case['length']}@{case['depth']:g}"
        found, total = map(int, cells.get(key, "0/0").split("/"))
        cells[key] = f"{found + case['found']}/{total + 1}"
    return cells


def table(rows: list[dict]) -> str:
    """The bucket ratios and retrieval counts of every model, as Markdown."""
    buckets = rows[0]["result"]["long_context"]["buckets"]
    heads = [f"{b['from']}-{b['to']}" for b in buckets]
    lines = [f"| model | engine | cache | perplexity | {' | '.join(heads)} |", "|---" * (4 + len(heads)) + "|"]
    for row in rows:
        res = row["result"]
        cells = [f"{b['perplexity']:.2f}" + (f" ({b['ratio']:.3f}x)" if "ratio" in b else "")
                 for b in res["long_context"]["buckets"]]  # fmt: skip
        lines.append(f"| {row['label']} | {row['engine']} | {res['cache_type'] or res['dtype']} | "
                     f"{res['perplexity']:.3f} | {' | '.join(cells)} |")
    keys = list(retrieval_cells(rows[0]["result"]))
    lines += ["", f"| model | found | {' | '.join(keys)} |", "|---" * (2 + len(keys)) + "|"]
    for row in rows:
        ret, cells = row["result"]["long_context"]["retrieval"], retrieval_cells(row["result"])
        lines.append(f"| {row['label']} | {ret['found']}/{ret['total']} | {' | '.join(cells.get(k, '-') for k in keys)} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Each model's perplexity ratio to the reference per position bucket (log-scaled positions)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in rows[1:]:
        buckets = row["result"]["long_context"]["buckets"]
        ax.plot([(max(b["from"], 1) * b["to"]) ** 0.5 for b in buckets], [b["ratio"] for b in buckets], marker="o",
                label=row["label"])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("position (tokens of context; bucket midpoints)")
    ax.set_ylabel(f"perplexity ratio to {rows[0]['label']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+", help="LABEL=PATH[@CACHE_TYPE]; the first is the reference")
    parser.add_argument("--data", default=str(DATA))
    parser.add_argument("--windows", type=int, default=4, help="windows of the model's full context")
    parser.add_argument("--lengths", default=None, help="retrieval lengths (default: eval's)")
    parser.add_argument("--depths", default="0.1,0.5,0.9")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--out", type=Path, default=harness.ROOT / "benchmarks" / "quality" / "longctx")
    parser.add_argument("--keep", action="store_true",
                        help="read a model's row from an earlier run's OUT/results.json where it was measured with "
                             "the same command, instead of measuring it again")
    args = parser.parse_args()
    models = [parse_model(spec) for spec in args.models]
    if len({m["label"] for m in models}) != len(models):
        raise SystemExit("every model needs a label of its own")
    args.out.mkdir(parents=True, exist_ok=True)
    earlier = kept_rows(args.out / "results.json") if args.keep else {}
    rows = []
    for model in models:
        row = measure(model, args, args.out, args.out / f"{models[0]['label']}.json" if rows else None,
                      earlier.get(model["label"]))
        rows.append(row)
    machine = harness.machine()
    (args.out / "results.json").write_text(json.dumps([{"machine": machine, **r} for r in rows], indent=2) + "\n")
    (args.out / "longctx.md").write_text(table(rows))
    if len(rows) > 1:
        plot(rows, args.out / "longctx.png")
    print(table(rows))


if __name__ == "__main__":
    main()
