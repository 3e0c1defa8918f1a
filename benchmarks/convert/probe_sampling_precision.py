#!/usr/bin/env python
"""How far the source's next-token distributions in bfloat16 are from its float32 ones: the mean KL(float32 ||
bfloat16) a token, at temperature 1 and at the calibration text's 1.2, on the first windows of the development
split's first half (out/dev/wiki.valid.first-half.tokens, made by benchmarks/common/domain_texts.py). What decided that the
self text samples in bfloat16 on CPUs with bfloat16 arithmetic
(docs/decisions.md#self-text-temperature-length-and-batch).

    python benchmarks/convert/probe_sampling_precision.py [MODEL] [--windows 4] [--seq-len 512]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def mean_kl(a: torch.Tensor, b: torch.Tensor, temperature: float) -> float:
    """Sum over positions of KL(softmax(a / t) || softmax(b / t)), logits a and b [T, V]."""
    p, q = torch.log_softmax(a / temperature, -1), torch.log_softmax(b / temperature, -1)
    return torch.nn.functional.kl_div(q, p, log_target=True, reduction="sum").item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="source (default: the embedded SmolLM2-135M)")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    from mla_convert.conversion import selftext
    from mla_convert.sources import open_source

    source = open_source(args.model)
    text = (ROOT / "out" / "dev" / "wiki.valid.first-half.tokens").read_text(encoding="utf-8")
    ids = source.tokenizer()(text)["input_ids"][: args.windows * args.seq_len]
    ids = torch.tensor(ids).view(args.windows, args.seq_len)
    models = [selftext.causal_lm(source, "cpu", dtype) for dtype in (torch.float32, torch.bfloat16)]
    totals = {1.0: 0.0, 1.2: 0.0}
    with torch.no_grad():
        for row in ids:
            full, half = (m(row[None]).logits[0].float() for m in models)
            for t in totals:
                totals[t] += mean_kl(full, half, t)
    print(", ".join(f"mean KL a token at temperature {t:g}: {v / ids.numel():.5f}" for t, v in totals.items()))


if __name__ == "__main__":
    main()
