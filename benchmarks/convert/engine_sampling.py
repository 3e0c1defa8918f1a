#!/usr/bin/env python
"""Would an engine sample the self text faster on this CPU? llama.cpp (llama-cpp-python, `scripts/install-llamacpp.sh`)
decoding a batch of sequences a token a step, against `mla_convert.sampler` at the same width and positions, on the
embedded default: its own Q4_1 GGUF, the same weights re-typed to bf16 and to q8_0 by llama.cpp's quantizer.

    python benchmarks/convert/engine_sampling.py [--width 64] [--steps 48] [--threads 2] [--json FILE]

Each route decodes `steps` tokens for `width` sequences from one prompt token each (one sequence id a row, a token a
step, the logits of every row read back, the next token taken greedily), timed after its first step; the slots sampler
runs the same requests (one-token prompts, EOS suppressed, temperature 1) in `selftext.sampling_dtype`, timed from its
first step (so its rate is if anything low). A first row times a step's matrix products alone (every linear layer on
`width` rows, in that precision): the rate no sampler in that arithmetic can pass. One process each, back to
back; compare the rows of one run only.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import harness  # noqa: E402  (the machine record)

WORKER = r'''
import json, sys, time
import numpy as np
import llama_cpp as L

req = json.load(open(sys.argv[1]))
width, steps, threads = req["width"], req["steps"], req["threads"]
L.llama_backend_init()
model = L.llama_model_load_from_file(req["gguf"].encode(), L.llama_model_default_params())
params = L.llama_context_default_params()
params.n_ctx = width * (steps + 8)
params.n_batch = params.n_ubatch = max(width, 512)
params.n_seq_max = width
params.n_threads = params.n_threads_batch = threads
ctx = L.llama_init_from_model(model, params)
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
batch = L.llama_batch_init(width, 0, 1)
tokens = np.arange(100, 100 + width)
for step in range(steps):
    if step == 1:
        start = time.perf_counter()
    batch.n_tokens = width
    for i in range(width):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = int(tokens[i]), step, 1, 1
        batch.seq_id[i][0] = i
    if L.llama_decode(ctx, batch) != 0:
        sys.exit("llama_decode failed")
    tokens = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(width, vocab)).argmax(-1)
seconds = time.perf_counter() - start
json.dump({"tokens": width * (steps - 1), "seconds": seconds}, open(sys.argv[2], "w"))
'''


def llamacpp_rate(llamacpp_python: Path, gguf: Path, args) -> dict:
    """llama.cpp's batched decode of `width` sequences (WORKER) in its own environment."""
    from mla_convert.serving import engine

    with tempfile.TemporaryDirectory() as tmp:
        worker = Path(tmp) / "worker.py"
        worker.write_text(WORKER)
        out = engine.run_worker([str(llamacpp_python), str(worker)], {"gguf": str(gguf), "width": args.width,
                                "steps": args.steps, "threads": args.threads}, "llama.cpp decode failed", 1800)
    return {"tokens": out["tokens"], "seconds": round(out["seconds"], 2)}


def slots_rate(model, args) -> dict:
    from mla_convert import sampler

    requests = [sampler.Request([100 + i], args.steps, i, suppress_eos=True) for i in range(args.width)]
    samples = sampler.sample(model, requests, args.width, 1.0, None, args.steps + 8)
    start = time.perf_counter()
    tokens = sum(len(s) - 1 for s in samples)
    return {"tokens": tokens, "seconds": round(time.perf_counter() - start, 2), "dtype": str(model.dtype)[6:]}


def products_bound(model, args) -> dict:
    """A step's matrix products alone: every linear layer of `model` (its head included) on `width` rows in its
    precision, back to back, best of 6 passes; the rate no sampler in that arithmetic passes."""
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(args.width, w.shape[1], dtype=model.dtype) for w in weights}
    best = float("inf")
    with torch.inference_mode():
        for _ in range(6):
            start = time.perf_counter()
            for w in weights:
                inputs[w.shape[1]] @ w.t()
            best = min(best, time.perf_counter() - start)
    return {"tokens": args.width, "seconds": round(best, 4), "dtype": str(model.dtype)[6:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="append one record to this file")
    args = parser.parse_args()
    from benchmarks.llamacpp.run import retype
    from mla_convert.checkpoint import default_model_path, open_source
    from mla_convert.conversion import selftext
    from mla_convert.serving.llamacpp import llamacpp_python

    torch.set_num_threads(args.threads)
    python = llamacpp_python()
    if python is None:
        sys.exit("llama-cpp-python is not installed: bash scripts/install-llamacpp.sh")
    work = Path("out/engine-sampling").resolve()  # the workers run in their own folder
    work.mkdir(parents=True, exist_ok=True)
    embedded = Path(default_model_path())
    routes = {"llama.cpp, the embedded Q4_1 GGUF": embedded,
              "llama.cpp, bf16": retype(embedded, work / "source-bf16.gguf", "MOSTLY_BF16"),
              "llama.cpp, q8_0": retype(embedded, work / "source-q8_0.gguf", "MOSTLY_Q8_0")}
    source = open_source(None)
    model = selftext.causal_lm(source, "cpu", selftext.sampling_dtype(source))
    rows = {"a step's matrix products alone": products_bound(model, args),
            "mla_convert.sampler (slots)": slots_rate(model, args)}
    del model
    for label, gguf in routes.items():
        rows[label] = llamacpp_rate(python, gguf, args)
    for label, row in rows.items():
        row["tokens_per_s"] = round(row["tokens"] / row["seconds"], 1)
        print(f"{label}: {row['tokens_per_s']} tokens/s", flush=True)
    record = {"width": args.width, "steps": args.steps, "threads": args.threads, "routes": rows,
              "machine": harness.machine()}
    if args.json:
        harness.append_jsonl(args.json, record)


if __name__ == "__main__":
    main()
