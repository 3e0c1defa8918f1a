#!/usr/bin/env python
"""A fine-tuning run's curve as a table: training tokens and time -> the report texts' perplexity and the share of
the gap to the source it closes, from the run's metrics.jsonl (the evaluations with `report_data`) and the source's
scores on the same windows (benchmarks/common/score_domains.py's JSON, e.g. `--windows 4` for `report_windows=4`).

    python benchmarks/finetune/curve.py RUN/metrics.jsonl --source-json SOURCE.json [--label source] > TABLE.md

Gap closed = (converted - now) / (converted - source) in perplexity, where converted is the run's step-0 score.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", type=Path)
    parser.add_argument("--source-json", type=Path, required=True, help="benchmarks/common/score_domains.py's output for the source")
    parser.add_argument("--label", default="source", help="the source's label in that file")
    parser.add_argument("--names", default="", help="report text -> source text names, e.g. wiki.test=wiki,...")
    args = parser.parse_args(argv)
    records = [json.loads(line) for line in args.metrics.read_text().splitlines() if line.strip()]
    evals = [r for r in records if r.get("event") == "eval" and r.get("report")]
    train = {r["step"]: r for r in records if r.get("event") == "train"}
    source = json.loads(args.source_json.read_text())["results"][args.label]
    rename = dict(pair.split("=", 1) for pair in args.names.split(",") if pair)
    texts = list(evals[0]["report"])
    start = evals[0]["report"]
    print("| step | tokens | training time (min) | held-out (sampled) | "
          + " | ".join(f"{t} (gap closed)" for t in texts) + " |")
    print("|" + "---:|" * (4 + len(texts)))
    print("| source | | | | " + " | ".join(f"{source[rename.get(t, t)]:.3f}" for t in texts) + " |")
    for r in evals:
        cells = []
        for t in texts:
            base, now = start[t], r["report"][t]
            closed = (base - now) / (base - source[rename.get(t, t)])
            cells.append(f"{now:.3f} ({100 * closed:.1f}%)")
        seconds = train.get(r["step"], {}).get("elapsed_s", 0.0)
        print(f"| {r['step']} | {r['tokens']:,} | {seconds / 60:.1f} | {r['perplexity']:.3f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
