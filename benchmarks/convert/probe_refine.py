#!/usr/bin/env python
"""Layer refinement variants on a real conversion's targets: each probe layer is converted as the conversion would, then
refined from that same start once per variant, each timed and scored on the held-out calibration window
(`refine.refine_module`'s "before" / "after" relative errors). The conversion stops after the last probe layer.

    python benchmarks/convert/probe_refine.py --layers 2 14 27 --variants 200:2048 100:2048 200:512 \
        --json out/probe.jsonl -- --kv-budget 0.25

A variant is STEPS:SEQ_LEN[:QUERIES[:LR]] (a step takes 2048 / SEQ_LEN windows of SEQ_LEN tokens, as
`--refine-seq-len` does; QUERIES positions of each, as `--refine-queries` does, 0: all; LR as `--refine-lr`). What
follows `--` are `mla-convert llama` options (no output folder: a temporary one is used). A cheap proxy for the
refinement's step settings (docs/decisions.md#refinement-on-a-cpu-positions-and-steps): each variant costs one
layer's refinement, not a whole conversion.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


class Done(Exception):
    """Raised after the last probe layer: the conversion goes no further."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", required=True)
    parser.add_argument("--variants", nargs="+", required=True, help="STEPS:SEQ_LEN[:QUERIES[:LR]] each")
    parser.add_argument("--json", type=Path, default=None, help="append one record per layer and variant")
    parser.add_argument("convert", nargs=argparse.REMAINDER, help="-- then mla-convert llama options")
    args = parser.parse_args()
    variants = [tuple(float(v) if "e" in v or "." in v else int(v) for v in spec.split(":")) for spec in args.variants]
    extra = [a for a in args.convert if a != "--"]

    from mla_convert.cli import app
    from mla_convert.conversion import pipeline

    original = pipeline.refined_layer
    last = max(args.layers)

    def probed(config, plan, family, rope_pairs, i, layer_tensors, mla_tensors, targets, pe, options, device):
        if i not in args.layers:  # the stream follows the source's layers: the others need no refinement here
            return original(config, plan, family, rope_pairs, i, layer_tensors, mla_tensors, targets, pe,
                            dataclasses.replace(options, refine_steps=0), device)
        for steps, seq_len, *more in variants:
            # the fields a variant leaves out: every position, the option's learning rate
            queries, lr = (list(more) + [0, options.refine_lr][len(more) :])[:2]
            varied = dataclasses.replace(options, refine_steps=steps, refine_seq_len=seq_len,
                                         refine_queries=queries, refine_lr=lr)
            start = time.perf_counter()
            _, _, row = original(config, plan, family, rope_pairs, i, dict(layer_tensors),
                                 {k: v.clone() for k, v in mla_tensors.items()}, targets, pe, varied, device)
            record = {"layer": i, "steps": steps, "seq_len": seq_len, "queries": varied.refine_queries, "lr": lr,
                      "precision": varied.refine_precision, "seconds": round(time.perf_counter() - start, 1),
                      "before": row["before"], "after": row["after"], "ratio": round(row["after"] / row["before"], 4)}
            print(json.dumps(record), flush=True)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps(record) + "\n")
        if i == last:
            raise Done
        return original(config, plan, family, rope_pairs, i, layer_tensors, mla_tensors, targets, pe,
                        dataclasses.replace(options, refine_steps=0), device)

    pipeline.refined_layer = probed
    with tempfile.TemporaryDirectory() as tmp:
        try:
            app(["llama", *extra, "-o", str(Path(tmp) / "out")], standalone_mode=False)
        except Done:
            pass


if __name__ == "__main__":
    main()
