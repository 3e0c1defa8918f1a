#!/usr/bin/env python
"""Tokens a second of the self text's sampling (`--calib-data self`) on this machine, by batch size: what
`selftext.BATCH` trades (docs/decisions.md#self-text-temperature-length-and-batch).

    python scripts/bench_selftext.py [--batches 16 64] [--temperature 1.2] [--dtype auto] [--json FILE]
    python scripts/bench_selftext.py --batches 64 --profile 48


Each batch size samples its first batch of chat answers from the embedded SmolLM2-135M (or MODEL) exactly as a
conversion would (seed 0, `selftext.SAMPLE_TOKENS` new tokens at most), uncached, and reports the tokens the batch
kept (prompt and answer, as the calibration stream reads them) per second of wall time, in the precision a conversion
samples in here (`selftext.sampling_dtype`) or the one `--dtype` names. `--profile N` samples N new
tokens a batch instead, under `torch.profiler`, and prints the operators by their own CPU time (where a step goes).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  (the machine record)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="source (default: the embedded SmolLM2-135M)")
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--temperature", type=float, default=1.2)
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="what the source samples in (auto: what a conversion samples in on this machine)")
    parser.add_argument("--json", type=Path, default=None, help="append one record per batch size to this file")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="profile N new tokens a batch (torch.profiler) instead of timing whole answers")
    args = parser.parse_args()

    from mla_convert import selftext
    from mla_convert.sources import open_source

    source = open_source(args.model)
    tokenizer = source.tokenizer()
    dtype = selftext.sampling_dtype(source) if args.dtype == "auto" else getattr(torch, args.dtype)
    model = selftext.causal_lm(source, "cpu", dtype)
    for batch in args.batches:
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                selftext.sample_batch(model, tokenizer, 0, 0, args.temperature, args.profile, batch)
            print(f"batch {batch}, {args.profile} new tokens, {dtype}, {json.dumps(harness.machine())}")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
            continue
        start = time.perf_counter()
        samples = selftext.sample_batch(model, tokenizer, 0, 0, args.temperature, selftext.SAMPLE_TOKENS, batch)
        seconds = time.perf_counter() - start
        tokens = sum(len(s) for s in samples)
        record = {"batch": batch, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                  "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1), "machine": harness.machine()}
        print(json.dumps(record))
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
