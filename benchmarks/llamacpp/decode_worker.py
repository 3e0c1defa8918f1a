"""Decode speed of several GGUF files in one llama.cpp process, timings interleaved: python decode_worker.py
REQUEST RESULT (run by benchmarks/llamacpp/run.py with .venv-llamacpp's Python; imports nothing from mla_convert).

REQUEST is JSON: models ({label: gguf path}, loaded in that order, each with its own context of n_ctx cells),
threads, contexts (increasing), tokens (single-token steps per timing), rounds (timings per model per context),
ids (token ids the sequences are filled with, repeated), optionally max_context ({label: n}: that model stops
after context n, where growing every model to the longest context would not fit the time at hand), flash_attn
(llama.cpp's flash attention, as llama-cli's and llama-server's default `-fa auto` picks on CPU), optionally settings
({label: {"cache_type": "bf16", "flash_attn": true}}: that model's KV cache type and flash attention), optionally
fill_threads (llama.cpp's batch threads, which grow the sequences; the timed single-token steps use `threads`). Every model's sequence is grown to each context length in
turn (the fill is timed too), then the models are timed in rounds, the order reversed every other round, so a load
that comes and goes on a shared machine falls on all of them alike; the 1-minute load average is read before and
after every timing. The RESULT (rewritten after every context, so a run cut short keeps what it measured) is
{"steps": [{"context", "model", "round", "tokens", "seconds", "tokens_per_s", "cpu_seconds" (this thread's CPU time:
with threads 1 llama.cpp computes on it, and other processes do not enter it), "load_before", "load_after"}],
"fills": [{"context", "model", "tokens", "seconds"}], "order": [labels]}. llama.cpp's log goes to stderr: one KV-cache
line per model, in load order.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "mla_convert" / "serving"))

from llamacpp_score import model_settings, no_extra_buffers  # noqa: E402  (numpy and llama_cpp only)


def main(request_path: str, result_path: str) -> None:
    import llama_cpp

    req = json.loads(Path(request_path).read_text())
    threads, steps, ids = int(req["threads"]), int(req["tokens"]), list(req["ids"])
    fill_threads = int(req.get("fill_threads") or threads)
    no_extra_buffers(llama_cpp)
    models = {}
    for label, path in req["models"].items():
        models[label] = llama_cpp.Llama(model_path=path, n_ctx=int(req["n_ctx"]), n_batch=512, n_ubatch=512, seed=0,
                                        n_threads=threads, n_threads_batch=fill_threads, verbose=True,
                                        **model_settings(llama_cpp, req, label))  # fmt: skip
        print(f"loaded {label}", file=sys.stderr, flush=True)
    out = {"order": list(models), "steps": [], "fills": []}
    limit = req.get("max_context") or {}
    for n in sorted(req["contexts"]):
        timed = {label: llm for label, llm in models.items() if n <= limit.get(label, n)}
        for label, llm in timed.items():
            fill = (ids * (n // len(ids) + 1))[llm.n_tokens : n]
            start = time.perf_counter()
            llm.eval(fill)
            out["fills"].append({"context": n, "model": label, "tokens": len(fill),
                                 "seconds": time.perf_counter() - start})  # fmt: skip
            print(f"filled {label} to {llm.n_tokens} ({out['fills'][-1]['seconds']:.0f} s)", file=sys.stderr, flush=True)
        for r in range(int(req["rounds"])):
            order = list(timed) if r % 2 == 0 else list(timed)[::-1]
            for label in order:
                llm = timed[label]
                load_before = os.getloadavg()[0]
                start, cpu = time.perf_counter(), time.thread_time()
                for _ in range(steps):
                    llm.eval([ids[llm.n_tokens % len(ids)]])
                seconds, cpu = time.perf_counter() - start, time.thread_time() - cpu
                out["steps"].append({"context": n, "model": label, "round": r, "tokens": steps, "seconds": seconds,
                                     "tokens_per_s": steps / seconds, "cpu_seconds": cpu, "load_before": load_before,
                                     "load_after": os.getloadavg()[0]})  # fmt: skip
                print(f"{n} {label} round {r}: {steps / seconds:.2f} tok/s (load {load_before:.2f} -> "
                      f"{out['steps'][-1]['load_after']:.2f})", file=sys.stderr, flush=True)
        Path(result_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
