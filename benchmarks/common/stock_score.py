#!/usr/bin/env python
"""Perplexity of one model on several token sequences, in a process that imports nothing from mla_convert unless
asked to: how an export is scored as a user without mla-convert would load it.

    python benchmarks/common/stock_score.py KIND MODEL IDS.safetensors OUT.json [--seq-len 2048] [--windows 16] [--threads 2]

KIND: `stock` (transformers' DeepseekV3ForCausalLM from the folder MODEL), `gguf` (MODEL is a .gguf file, read by
transformers' GGUF loader), `native` (mla_convert's model: the one kind that imports it).
IDS: a safetensors file of 1-D integer tensors, one per text (name -> token ids, tokenized by the caller).
The loop is the protocol of mla_convert.evaluate.perplexity, restated: the first W non-overlapping windows of T
tokens, each scored on its own, float32 compute, nll averaged over W * (T - 1) predicted tokens.
OUT: {"perplexity": {name: ppl}, "tokens", "seconds", "class", "transformers", "mla_convert_imported"}.

From another script: `stock_score.run(kind, model, ids_path, ...)` runs this file in a fresh interpreter (without
PYTHONPATH for `stock`) and returns OUT, refusing a `stock` result whose process imported mla_convert.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run(kind: str, model, ids_path, seq_len: int = 2048, windows: int = 16, threads: int = 2, cwd=None) -> dict:
    """OUT of this script run on `model` in its own interpreter (see the module docstring)."""
    env = {k: v for k, v in os.environ.items() if not (kind == "stock" and k == "PYTHONPATH")}
    with tempfile.TemporaryDirectory(prefix="mla-stock-") as tmp:
        out = Path(tmp) / "out.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), kind, str(Path(model).resolve()),
               str(Path(ids_path).resolve()), str(out),
               "--seq-len", str(seq_len), "--windows", str(windows), "--threads", str(threads)]  # fmt: skip
        subprocess.run(cmd, check=True, cwd=cwd or tmp, env=env)
        res = json.loads(out.read_text())
    if kind == "stock" and (res["mla_convert_imported"] or res["class"] != "DeepseekV3ForCausalLM"):
        raise RuntimeError(f"{model}: the stock scoring process loaded {res['class']} (mla_convert imported: "
                           f"{res['mla_convert_imported']})")
    return res


def load(kind: str, model: str):
    import torch

    if kind == "stock":
        from transformers import DeepseekV3ForCausalLM

        return DeepseekV3ForCausalLM.from_pretrained(model, dtype=torch.float32)
    from transformers import AutoModelForCausalLM

    if kind == "gguf":
        path = Path(model)
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    import mla_convert.modeling  # noqa: F401  (registers model_type mla)

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["stock", "gguf", "native"])
    ap.add_argument("model")
    ap.add_argument("ids", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import torch
    from safetensors.torch import load_file

    torch.set_num_threads(args.threads)
    start = time.time()
    model = load(args.kind, args.model).eval()
    texts = load_file(str(args.ids))
    result = {"perplexity": {}, "tokens": {}}
    with torch.no_grad():
        for name, ids in texts.items():
            windows = min(args.windows, ids.numel() // args.seq_len)
            total = 0.0
            for w in range(windows):
                chunk = ids[w * args.seq_len : (w + 1) * args.seq_len].long().unsqueeze(0)
                logits = model(input_ids=chunk, use_cache=False).logits[0, :-1].float()
                total += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
            count = windows * (args.seq_len - 1)
            result["perplexity"][name] = math.exp(total / count)
            result["tokens"][name] = count
    result.update(seconds=time.time() - start, **{"class": type(model).__name__},
                  transformers=__import__("transformers").__version__,
                  mla_convert_imported=any(m.split(".")[0] == "mla_convert" for m in sys.modules))
    args.out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
