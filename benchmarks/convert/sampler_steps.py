#!/usr/bin/env python
"""What a step of the self text's sampler costs on this CPU (the embedded default, in the precision it samples in):
one step at several slot counts over ~300 cached positions (chat answers), 8-slot steps at several positions of an
8,192-token buffer (documents), and a bfloat16 score product on a slice of the cache against a copy of it.

    python benchmarks/convert/sampler_steps.py [--threads 2] [--json FILE]

Numbers quoted in benchmarks/convert/README.md#the-self-texts-sampler come from this script's JSON beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import harness  # noqa: E402  (the machine record)


def ms(fn, n: int) -> float:
    for _ in range(2):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return round((time.perf_counter() - start) / n * 1e3, 2)


def steps(model, rows: int, length: int, position: int, n: int) -> float:
    """ms of one sampler step (forward and token choice) of `rows` slots at `position` of a `length` buffer."""
    from mla_convert import sampler

    windows = sampler.layer_windows(model.config)
    cache = sampler.SlotCache(model.config.num_hidden_layers, rows, length)
    cache.positions = torch.full((rows,), position)
    tokens = torch.randint(0, 1000, (rows,))

    def step():
        logits = sampler._forward(model, cache, tokens, windows, model.dtype, model.device, "past_key_values")
        sampler.choose(logits, 1.2, torch.rand(rows, dtype=torch.float64))

    with torch.inference_mode(), sampler._decoding(model):
        return ms(step, n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("sampler_steps.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from mla_convert.conversion import selftext
    from mla_convert.sources import open_source

    source = open_source(None)
    model = selftext.causal_lm(source, "cpu", selftext.sampling_dtype(source))
    record = {"dtype": str(model.dtype).removeprefix("torch."),
              "chat_ms_by_slots": {r: steps(model, r, 320, 290, 10) for r in (1, 16, 64, 128)},
              "document_8_slots_ms_by_position": {p: steps(model, 8, 8192, p, 5) for p in (300, 3000, 6000)}}
    q = torch.randn(8, 3, 3, 64).to(model.dtype)
    buffer = torch.randn(8, 3, 8192, 64).to(model.dtype)
    part = buffer[:, :, :4096]
    record["score_product_ms"] = {"slice_4096": ms(lambda: q @ part.transpose(-1, -2), 20),
                                  "copy_then_product_4096": ms(lambda: q @ part.contiguous().transpose(-1, -2), 20),
                                  "whole_buffer_8192": ms(lambda: q @ buffer.transpose(-1, -2), 20)}
    record["machine"] = harness.machine()
    print(json.dumps(record, indent=2))
    args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
