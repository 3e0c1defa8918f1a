#!/usr/bin/env python
"""Seconds, system time and page faults of the statistics pass's work per layer, on the self text a conversion
sampled (cached), as the pass runs it: the input second moment, the attention statistics, the advance past the layer,
the hidden states kept for the conversion pass.

    python benchmarks/convert/statistics_pass.py [--windows 32] [--layers 8] [--batch 1] [--reuse-freed] [--json FILE]

The text is the 50% default's (`self`, temperature 1.0, seed 0; `--windows` windows of 2048 tokens), read from
$MLA_CONVERT_CACHE (sampled first where the cache lacks it). `--reuse-freed` sets glibc's malloc to keep freed blocks of
up to 1 GiB for reuse (`mallopt`: mmap threshold 1 GiB, heap trimmed past 2 GiB free) before the first layer: what the
faults cost (docs/decisions.md#the-statistics-pass-on-a-cpu). `--batch`:
the windows the advance runs through the layer at once (the runner's `batch`; default: a CPU conversion's). Each row
ends with a digest of the hidden states after the layer (the first 16 hex digits of their bytes' SHA-256), so that
two settings can be checked to compute the same stream bit for bit.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import harness  # noqa: E402  (the machine record)

from mla_convert.conversion.calibration import calibration_tokens  # noqa: E402
from mla_convert.conversion.statistics import LayerRunner, advance_batch, second_moment  # noqa: E402
from mla_convert.conversion.modules import float32_on, raw_layer, source_decoder_layer  # noqa: E402
from mla_convert.conversion.pipeline import ATTENDED_EVERY  # noqa: E402
from mla_convert.families import family_for  # noqa: E402
from mla_convert.sources import open_source  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=32)
    parser.add_argument("--layers", type=int, default=8, help="the first N layers of the embedded SmolLM2-135M")
    parser.add_argument("--batch", type=int, default=advance_batch("cpu"),
                        help="windows a chunk of the advance (the runner's batch; default: a CPU conversion's)")
    parser.add_argument("--reuse-freed", action="store_true", help="glibc keeps freed blocks up to 1 GiB (mallopt)")
    parser.add_argument("--json", type=Path, default=None, help="append one record per layer to this file")
    args = parser.parse_args()
    if args.reuse_freed:
        libc = ctypes.CDLL("libc.so.6")
        assert libc.mallopt(-3, 1 << 30) and libc.mallopt(-1, 1 << 31)  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    source = open_source(None)
    family = family_for(source.config)
    tokens = calibration_tokens(source, "self", args.windows, 2048, 0, temperature=1.0)
    runner = LayerRunner(source.config, source.get_raw("model.embed_tokens.weight"), tokens, batch=args.batch)
    kept, cpu = {}, torch.device("cpu")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.windows} windows of 2048, "
          f"advance batch {args.batch}, reuse freed blocks: {args.reuse_freed}")
    for i in range(args.layers):
        layer = source_decoder_layer(source.config, family, i, float32_on(raw_layer(source, i, family), cpu))
        before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        second_moment(runner.attention_input(layer))
        moments = time.perf_counter()
        runner.attention_statistics(layer, attended_every=ATTENDED_EVERY)
        attention = time.perf_counter()
        runner.advance(layer)
        kept[i] = runner.hidden.clone()
        end, after = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        row = {"layer": i, "windows": args.windows, "batch": args.batch, "reuse_freed": args.reuse_freed,
               "second_moment_s": round(moments - start, 2), "attention_statistics_s": round(attention - moments, 2),
               "advance_and_keep_s": round(end - attention, 2), "total_s": round(end - start, 2),
               "system_s": round(after.ru_stime - before.ru_stime, 2), "minor_faults": after.ru_minflt - before.ru_minflt,
               "hidden_sha256": hashlib.sha256(runner.hidden.numpy().tobytes()).hexdigest()[:16]}
        print(json.dumps(row), flush=True)
        if args.json:
            harness.append_jsonl(args.json, {**row, "machine": harness.machine()})


if __name__ == "__main__":
    main()
