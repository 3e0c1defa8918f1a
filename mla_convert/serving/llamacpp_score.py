"""Run a GGUF file in llama.cpp (llama-cpp-python) on given token ids: python llamacpp_score.py REQUEST RESULT.

Runs in llama.cpp's own environment (scripts/install-llamacpp.sh makes .venv-llamacpp), so it imports nothing from
mla_convert (that environment has no torch). REQUEST is JSON:

    model       the .gguf path
    n_ctx       context length to allocate (the KV cache llama.cpp logs is for this many cells)
    threads     CPU threads (0: llama.cpp's default)
    cache_type  the cache's ggml type, K and V alike (llama.cpp's --cache-type-k/-v): "f16" (its default), "f32"
                (exactness checks), "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl"
    flash_attn  true / false / absent (llama.cpp's auto); a quantized V cache needs flash attention, so a quantized
                cache_type turns it on unless this says false
    windows     token-id lists: each is evaluated from an empty cache, every position's logits kept
    prompts     token-id lists: greedy continuations of `new_tokens` tokens each (argmax of llama.cpp's logits)
    decode      optional {"contexts": [n, ...], "tokens": m, "ids": [...]}: one sequence, grown through the context
                lengths in increasing order: filled up to n tokens (`ids`, repeated), then m single-token decode
                steps timed (those m tokens stay in the context); tokens/s of those steps

RESULT is JSON: logprobs (per window, the log-probability of tokens 1..n-1, float64 log-softmax of llama.cpp's
float32 logits), greedy (per prompt), decode ([{"context", "tokens", "seconds", "tokens_per_s"}]) and
llama_cpp_version. llama.cpp's own log (KV-cache size lines included) goes to stderr, which the caller keeps.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


ROWS = 512  # positions whose log-softmax is taken at once


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def set_default_params(which: str, **fields) -> None:
    """Wrap llama-cpp-python's `llama_<which>_default_params` (model or context) so that every parameter struct it
    makes has `fields` set: the options its Llama class does not pass through."""
    import llama_cpp.llama_cpp as api

    name = f"llama_{which}_default_params"
    default = getattr(api, name)

    def params():
        p = default()
        for key, value in fields.items():
            setattr(p, key, value)
        return p

    setattr(api, name, params)


GGML_TYPE_BF16 = 30  # ggml.h's enum value: llama-cpp-python names no BF16 constant


def ggml_type(llama_cpp, kind: str) -> int:
    """ggml's type id for a cache type name (llama.cpp's --cache-type-k spelling)."""
    return GGML_TYPE_BF16 if kind == "bf16" else getattr(llama_cpp, f"GGML_TYPE_{kind.upper()}")


def model_settings(llama_cpp, req: dict, label: str) -> dict:
    """The Llama(...) keywords for one model of a benchmark request: its own cache type and flash attention
    (req["settings"][label]), else the request's flash_attn and llama.cpp's f16 cache."""
    own = (req.get("settings") or {}).get(label, {})
    out = {"flash_attn": bool(own.get("flash_attn", req.get("flash_attn")))}
    if own.get("cache_type"):
        out["type_k"] = out["type_v"] = ggml_type(llama_cpp, own["cache_type"])
    return out


def no_extra_buffers(llama_cpp) -> None:
    """Load weights without llama.cpp's extra CPU buffer types (weight repacking; llama-cli --no-repack): its AMX
    path, compiled in where the CPU reports AMX, can crash on Q8_0 weights (docs/serving.md#route-3-llamacpp-gguf).
    llama-cpp-python has no option for it, so its default model parameters are wrapped."""
    set_default_params("model", use_extra_bufts=False)


def last_logits(llm, llama_cpp) -> np.ndarray:
    """The logits llama.cpp computed for the last evaluated position (with or without logits_all)."""
    return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()


def main(request_path: str, result_path: str) -> None:
    import llama_cpp

    req = json.loads(open(request_path).read())
    windows, prompts = req.get("windows") or [], req.get("prompts") or []
    decode = req.get("decode")
    kwargs = dict(model_path=req["model"], n_ctx=int(req["n_ctx"]), n_batch=512, n_ubatch=512, seed=0,
                  logits_all=bool(windows), verbose=True)  # fmt: skip
    kind = req.get("cache_type") or "f16"
    kwargs["type_k"] = kwargs["type_v"] = ggml_type(llama_cpp, kind)
    flash = req.get("flash_attn")
    if flash is None and kind not in ("f32", "f16", "bf16"):
        flash = True
    if flash is not None:
        kwargs.update(flash_attn=bool(flash))
    if req.get("threads"):
        kwargs.update(n_threads=int(req["threads"]), n_threads_batch=int(req["threads"]))
    no_extra_buffers(llama_cpp)
    llm = llama_cpp.Llama(**kwargs)
    out = {"logprobs": [], "greedy": [], "decode": [], "llama_cpp_version": llama_cpp.__version__}
    for w in windows:
        llm.reset()
        llm.eval(w)
        scored = []
        for start in range(0, len(w) - 1, ROWS):  # in rows of ROWS: a long window's float64 copy stays small
            logp = log_softmax(np.asarray(llm.scores[start : min(start + ROWS, len(w) - 1)]))
            scored += logp[np.arange(len(logp)), np.asarray(w[start + 1 : start + 1 + len(logp)])].tolist()
        out["logprobs"].append(scored)
    for p in prompts:
        llm.reset()
        llm.eval(p)
        gen = []
        for _ in range(int(req.get("new_tokens", 16))):
            nxt = int(np.argmax(last_logits(llm, llama_cpp)))
            gen.append(nxt)
            llm.eval([nxt])
        out["greedy"].append(gen)
    if decode:
        ids = decode.get("ids") or [1]
        steps = int(decode.get("tokens", 32))
        llm.reset()
        for n in sorted(decode["contexts"]):  # one sequence grown from one context length to the next
            fill = (ids * (n // len(ids) + 1))[llm.n_tokens : n]
            llm.eval(fill)
            start = time.perf_counter()
            for i in range(steps):
                llm.eval([ids[i % len(ids)]])
            seconds = time.perf_counter() - start
            out["decode"].append({"context": n, "tokens": steps, "seconds": seconds, "tokens_per_s": steps / seconds})
    with open(result_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
