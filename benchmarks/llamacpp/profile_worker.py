"""Where llama.cpp's decode step spends its time, per graph node: python profile_worker.py REQUEST RESULT (run by
benchmarks/llamacpp/run.py --stages profile with .venv-llamacpp's Python; imports nothing from mla_convert).

REQUEST is JSON: models ({label: gguf path}), n_ctx, threads (1: the times below are this thread's CPU time),
contexts (each sequence is grown to each in turn), tokens (decode steps measured), ids, flash_attn, optionally
settings ({label: {"cache_type", "flash_attn"}}: that model's own). Times are the
calling thread's CPU time (CLOCK_THREAD_CPUTIME_ID; with one thread llama.cpp computes on it), so other processes on
a shared machine do not enter them. The fill runs the graph whole. Then `tokens` plain decode steps (CPU seconds per
step), then `tokens` profiled ones: llama.cpp's scheduler callback (cb_eval, as llama.cpp's eval-callback example
uses it) asks for every node, so the scheduler computes the nodes one at a time, and the CPU time from each node's
"ask" to its "done" call is that node's; per node the least over the profiled steps is kept. RESULT: {label:
{context: {"cpu_step_seconds", "wall_step_seconds", "nodes": [{"op", "name", "ms_per_step", "count_per_step"}]}}},
nodes grouped by operation and by name without its layer suffix, most time first.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "mla_convert" / "serving"))

from llamacpp_score import model_settings, no_extra_buffers, set_default_params  # noqa: E402  (numpy and llama_cpp only)


def main(request_path: str, result_path: str) -> None:
    import llama_cpp
    import llama_cpp.llama_cpp as api

    req = json.loads(Path(request_path).read_text())
    lib = next(Path(llama_cpp.__file__).parent.glob("lib/libggml-base.so*"))
    ggml = ctypes.CDLL(str(lib))
    for fn in (ggml.ggml_op_desc, ggml.ggml_get_name):
        fn.restype, fn.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
    state = {"on": False, "start": 0}
    step: list = []  # (op, name, CPU ns) of the nodes of the current profiled step, in graph order

    def callback(tensor, ask, _user):
        if not state["on"]:
            return False  # the graph runs whole: no per-node calls
        if ask:
            state["start"] = time.thread_time_ns()
            return True
        spent = time.thread_time_ns() - state["start"]
        name = ggml.ggml_get_name(tensor).decode(errors="replace").split(" (")[0]
        name = "" if name.startswith("node_") else name.rsplit("-", 1)[0] if name[-1:].isdigit() else name
        step.append((ggml.ggml_op_desc(tensor).decode(), name, spent))
        return True

    c_callback = api.ggml_backend_sched_eval_callback(callback)
    set_default_params("context", cb_eval=c_callback)
    no_extra_buffers(llama_cpp)
    ids, steps, out = list(req["ids"]), int(req["tokens"]), {}
    for label, path in req["models"].items():
        llm = llama_cpp.Llama(model_path=path, n_ctx=int(req["n_ctx"]), n_batch=512, n_ubatch=512, seed=0,
                              n_threads=int(req["threads"]), n_threads_batch=int(req["threads"]), verbose=True,
                              **model_settings(llama_cpp, req, label))  # fmt: skip
        out[label] = {}
        for n in sorted(req["contexts"]):
            llm.eval((ids * (n // len(ids) + 1))[llm.n_tokens : n])
            cpu, wall = time.thread_time(), time.perf_counter()
            for _ in range(steps):  # plain steps
                llm.eval([ids[llm.n_tokens % len(ids)]])
            cpu, wall = (time.thread_time() - cpu) / steps, (time.perf_counter() - wall) / steps
            state["on"], best = True, None
            for _ in range(steps):
                step.clear()
                llm.eval([ids[llm.n_tokens % len(ids)]])
                best = list(step) if best is None else [(o, m, min(t, u[2])) for (o, m, t), u in zip(best, step)]
            state["on"] = False
            groups: dict = defaultdict(lambda: [0, 0])
            for op, name, ns in best:
                groups[(op, name)][0] += ns
                groups[(op, name)][1] += 1
            nodes = sorted(({"op": op, "name": name, "ms_per_step": t / 1e6, "count_per_step": c}
                            for (op, name), (t, c) in groups.items()), key=lambda x: -x["ms_per_step"])  # fmt: skip
            out[label][str(n)] = {"cpu_step_seconds": cpu, "wall_step_seconds": wall, "nodes": nodes,
                                  "profiled_cpu_ms": sum(x["ms_per_step"] for x in nodes)}  # fmt: skip
            print(f"{label} at {n}: {cpu * 1e3:.1f} CPU ms/step ({wall * 1e3:.0f} ms wall); nodes (least of "
                  f"{steps}) {out[label][str(n)]['profiled_cpu_ms']:.1f} ms", file=sys.stderr, flush=True)
            Path(result_path).write_text(json.dumps(out))
        del llm
    Path(result_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
