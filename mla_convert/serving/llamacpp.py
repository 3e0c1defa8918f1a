"""Run a GGUF file in llama.cpp (its own environment, .venv-llamacpp) on token ids, and score it like transformers.

scripts/install-llamacpp.sh makes `.venv-llamacpp` (or set `MLA_CONVERT_LLAMACPP_PYTHON`). The worker,
mla_convert/serving/llamacpp_score.py, is run by path with that Python; llama.cpp's log is kept, and the KV-cache line
it prints when it allocates the cache ("llama_kv_cache: size = ... MiB (N cells, L layers, ...)") gives the bytes
per token llama.cpp really holds.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("llamacpp_score.py")
KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*?K \((\w+)\): +([\d.]+) MiB, "
                     r"V \((\w+)\): +([\d.]+) MiB")


def llamacpp_python() -> Path | None:
    """The Python of an environment with llama-cpp-python, or None."""
    env = os.environ.get("MLA_CONVERT_LLAMACPP_PYTHON")
    if env:
        return Path(env) if Path(env).exists() else None
    venv = REPO / ".venv-llamacpp"
    installed = any(venv.glob("lib/python*/site-packages/llama_cpp/__init__.py"))  # not a venv whose build stopped
    return venv / "bin" / "python" if installed and (venv / "bin" / "python").exists() else None


def kv_cache_from_log(text: str) -> dict | None:
    """The last KV-cache allocation llama.cpp logged: MiB, cells, layers, K/V types and bytes per token (cell).

    The log prints MiB with two decimals: bytes per token are exact after rounding when cells * 2 exceeds the
    rounding step (5243 bytes), i.e. from about 2,700 cells up; below that they carry up to +-5243/cells bytes.
    """
    found = KV_LINE.findall(text)
    if not found:
        return None
    mib, cells, layers, k_type, k_mib, v_type, v_mib = found[-1]
    cells = int(cells)
    total = float(mib) * 1024 * 1024
    return {"mib": float(mib), "cells": cells, "layers": int(layers), "k_type": k_type, "k_mib": float(k_mib),
            "v_type": v_type, "v_mib": float(v_mib), "bytes_per_token": total / cells,
            "bytes_per_token_resolution": 0.005 * 1024 * 1024 / cells}  # fmt: skip


def run_llamacpp(model: str | os.PathLike, windows=(), prompts=(), new_tokens: int = 16, n_ctx: int = 2048,
                 threads: int = 0, decode: dict | None = None, cache_type: str = "f16", timeout: float = 3600) -> dict:
    """llamacpp_score's RESULT for the GGUF `model`, plus "log" and "kv_cache"; RuntimeError with llama.cpp's last
    lines on failure."""
    python = llamacpp_python()
    if python is None:
        raise RuntimeError("no llama.cpp environment: run scripts/install-llamacpp.sh (or set "
                           "MLA_CONVERT_LLAMACPP_PYTHON)")
    from mla_convert.serving.engine import run_worker

    request = {
        "model": str(Path(model).resolve()), "n_ctx": n_ctx, "threads": threads,
        "windows": [list(map(int, w)) for w in windows], "prompts": [list(map(int, p)) for p in prompts],
        "new_tokens": new_tokens, "decode": decode, "cache_type": cache_type,
    }  # fmt: skip
    out = run_worker([str(python), str(WORKER)], request, f"llama.cpp failed on {model}", timeout)
    out["kv_cache"] = kv_cache_from_log(out["log"])
    return out


def llamacpp_perplexity(model: str | os.PathLike, ids, seq_len: int, windows: int, threads: int = 0) -> dict:
    """`evaluate.perplexity`'s protocol (the first `windows` non-overlapping windows of `seq_len` tokens of `ids`,
    each scored on its own, from the same token ids) run in llama.cpp; adds llama.cpp's KV-cache bytes per token."""
    from mla_convert.errors import UserError
    from mla_convert.evaluate import eval_windows

    if llamacpp_python() is None:
        raise UserError("--engine llamacpp needs llama.cpp's environment: run scripts/install-llamacpp.sh (or set "
                        "MLA_CONVERT_LLAMACPP_PYTHON to the python of an environment with llama-cpp-python)")
    chunks = eval_windows(ids, seq_len, windows).tolist()
    try:
        res = run_llamacpp(model, windows=chunks, n_ctx=seq_len, threads=threads)
    except RuntimeError as e:
        last = [line for line in str(e).splitlines() if line.strip()][-1]
        raise UserError(f"llama.cpp could not run {model}: {last[:300]}") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"llama.cpp did not finish scoring {model} within the time limit: lower --windows") from None
    flat = [x for w in res["logprobs"] for x in w]
    nll = -sum(flat) / len(flat)
    kv = res["kv_cache"] or {}
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": len(flat), "windows": len(chunks), "seq_len": seq_len,
            "engine": f"llama.cpp (llama-cpp-python {res['llama_cpp_version']})",
            "kv_cache_bytes_per_token": kv.get("bytes_per_token"), "kv_cache_log": kv or None}  # fmt: skip


def gguf_tokenizer(model: str | os.PathLike):
    """The Hugging Face tokenizer of a GGUF: its source folder's (for a GGUF mla-convert wrote, while that folder
    exists), else the one transformers reads from the GGUF itself."""
    from transformers import AutoTokenizer

    from mla_convert.errors import UserError

    path = Path(model)
    try:
        import gguf

        field = gguf.GGUFReader(str(path)).fields.get("mla_convert.export")
        record = json.loads(bytes(field.parts[field.data[0]]).decode()) if field is not None else {}
    except Exception:  # not ours, or unreadable metadata: fall back to the GGUF's own tokenizer
        record = {}
    source = Path(record.get("source", ""))
    try:
        if record and (source / "tokenizer.json").is_file():
            return AutoTokenizer.from_pretrained(source, trust_remote_code=False)
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, trust_remote_code=False)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot load the tokenizer of {path} ({type(e).__name__}): keep the folder it was exported "
                        "from (its tokenizer gives the token ids both engines score)") from None
