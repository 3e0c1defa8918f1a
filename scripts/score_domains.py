#!/usr/bin/env python
"""Perplexity of several models on several texts in one process, as `mla-convert eval` scores each pair (the same
token ids, the same first W non-overlapping windows of T tokens), so that a benchmark run on a GPU machine loads each
text once and each model once.

    python scripts/score_domains.py --models source,out/a,out/b --texts wiki=FILE,devref=FILE \
        [--windows 16] [--seq-len 2048] [--dtype float32] [--device cuda] --json OUT.json

`source` (or a name given as LABEL=PATH) is scored like any other folder; `source` alone is the embedded default.
Each model's tokenizer tokenizes the texts (a conversion keeps its source's tokenizer, so the ids are the same).
The JSON file holds {"results": {model label: {text name: perplexity}}, "protocol": {...}} and is rewritten after
each model, so a run stopped part-way keeps the models it finished.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_pairs(spec: str, what: str) -> list[tuple[str, str]]:
    """"a,b=c" -> [(a, a), (b, c)]: LABEL=VALUE pairs, a bare value labelled by its own name."""
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        label, _, value = item.partition("=")
        out.append((label, value) if value else (Path(label).name if what == "model" else Path(label).stem, label))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="comma-separated model folders (LABEL=PATH; source = default)")
    parser.add_argument("--texts", required=True, help="comma-separated text files (NAME=PATH)")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch

    from mla_convert import evaluate
    from mla_convert.data import load_text

    texts = {name: load_text(path) for name, path in parse_pairs(args.texts, "text")}
    record = {"protocol": {"windows": args.windows, "seq_len": args.seq_len, "dtype": args.dtype,
                           "device": args.device, "texts": dict(parse_pairs(args.texts, "text"))},
              "results": {}, "seconds": {}}
    if args.device.startswith("cuda"):
        record["protocol"]["gpu"] = torch.cuda.get_device_name(0)
    for label, path in parse_pairs(args.models, "model"):
        start = time.perf_counter()
        with torch.inference_mode():
            net, tokenizer, _ = evaluate.load_model(None if path == "source" else path, args.dtype, args.device)
            scores = {}
            for name, text in texts.items():
                ids = evaluate.tokenize(tokenizer, text)
                scores[name] = evaluate.perplexity(net, ids, args.seq_len, args.windows, progress=False)["perplexity"]
        del net
        record["results"][label] = scores
        record["seconds"][label] = round(time.perf_counter() - start, 1)
        print(f"{label}: " + ", ".join(f"{n} {p:.3f}" for n, p in scores.items()), flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
