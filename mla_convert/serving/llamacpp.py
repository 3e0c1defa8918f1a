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
                 threads: int = 0, decode: dict | None = None, cache_type: str = "f16", timeout: float = 3600,
                 flash_attn: bool | None = None, env: dict | None = None) -> dict:
    """llamacpp_score's RESULT for the GGUF `model`, plus "log" and "kv_cache"; RuntimeError with llama.cpp's last
    lines on failure. `env`: extra environment for llama.cpp (LLAMA_ATTN_ROT_DISABLE=1: no cache rotation)."""
    python = llamacpp_python()
    if python is None:
        raise RuntimeError("no llama.cpp environment: run scripts/install-llamacpp.sh (or set "
                           "MLA_CONVERT_LLAMACPP_PYTHON)")
    from mla_convert.serving.engine import run_worker

    request = {
        "model": str(Path(model).resolve()), "n_ctx": n_ctx, "threads": threads,
        "windows": [list(map(int, w)) for w in windows], "prompts": [list(map(int, p)) for p in prompts],
        "new_tokens": new_tokens, "decode": decode, "cache_type": cache_type, "flash_attn": flash_attn,
    }  # fmt: skip
    out = run_worker([str(python), str(WORKER)], request, f"llama.cpp failed on {model}", timeout, env=env)
    out["kv_cache"] = kv_cache_from_log(out["log"])
    return out


LLAMACPP_BLOCK = 32  # values per block of llama.cpp's quantized cache types (q8_0 ... q4_0, iq4_nl)
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0", "iq4_nl")  # llama.cpp's --cache-type-k
FLOAT_CACHE_TYPES = CACHE_TYPES[:3]  # the rest are blocks of LLAMACPP_BLOCK, read through flash attention


def quantized_cache_ok(kv_lora_rank: int, rope_dims: int) -> bool:
    """Whether llama.cpp's quantized cache types (blocks of 32) take an MLA GGUF: the latent (its V view) and the row
    [latent, rope key] must be whole blocks. llama.cpp caches the MLA row unrotated (LLAMA_ATTN_ROT_DISABLE changes
    nothing on it: tests/test_gguf.py)."""
    return kv_lora_rank % LLAMACPP_BLOCK == 0 and rope_dims % LLAMACPP_BLOCK == 0


def llamacpp_cache_types(kv_lora_rank: int, rope_dims: int) -> str:
    """The line that says which llama.cpp cache types an MLA GGUF takes, and the fix where quantized ones are out."""
    if quantized_cache_ok(kv_lora_rank, rope_dims):
        return ("cache types: f16 (default), f32, bf16, and with flash attention (-fa on) q8_0, q5_1, q5_0, q4_1, "
                "q4_0, iq4_nl (--cache-type-k and --cache-type-v alike)")
    fix = ("re-export with --pad-latent llamacpp" if rope_dims % LLAMACPP_BLOCK == 0 else
           f"convert with --rope-dims {LLAMACPP_BLOCK} or {2 * LLAMACPP_BLOCK}")
    return (f"cache types: f16 (default), f32, bf16 only; llama.cpp's quantized cache types need kv_lora_rank and "
            f"rope dims in whole blocks of {LLAMACPP_BLOCK} (here {kv_lora_rank} + {rope_dims}): {fix}")


def llamacpp_serve_line(model, kv_lora_rank: int, rope_dims: int, planned: str | None = None,
                        values_per_token: int | None = None) -> str:
    """How to serve an MLA GGUF in llama.cpp with the flags that decoded it fastest on a CPU (flash attention on: its
    MLA path without it copies the latent transposed every step; a q8_0 cache where the row is whole blocks, at about
    +0.1% perplexity), from benchmarks/llamacpp/README.md; a conversion planned for a cache type (`--kv-bytes`,
    `--cache-type`: its config's `latent_cache_type`, `planned`) is served in that type, its bytes per token said."""
    line = f"serve it: llama-server -m {model} -fa on"
    if not quantized_cache_ok(kv_lora_rank, rope_dims):
        return line + " (exact, the f16 cache)"
    if planned is not None and planned in CACHE_TYPES:
        from mla_convert.kvquant import row_bytes

        size = f": {row_bytes(values_per_token, planned):,.0f} bytes per token" if values_per_token else ""
        return line + (f" --cache-type-k {planned} --cache-type-v {planned} (the cache type this conversion was "
                       f"planned for{size})")
    return line + (" (exact, the f16 cache); add --cache-type-k q8_0 --cache-type-v q8_0 to decode faster still at "
                   "about +0.1% perplexity")


def gguf_ints(model: str | os.PathLike, *keys: str) -> list[int | None]:
    """The integer metadata `keys` of a GGUF file (None where absent); "{arch}" in a key is its architecture."""
    import gguf

    fields = gguf.GGUFReader(str(model)).fields
    arch = fields.get("general.architecture")
    arch = bytes(arch.parts[arch.data[0]]).decode() if arch is not None else ""

    def value(key):
        f = fields.get(key.format(arch=arch))
        return int(f.parts[f.data[0]][0]) if f is not None else None

    return [value(key) for key in keys]


def gguf_mla_layout(model: str | os.PathLike) -> tuple[int, int] | None:
    """(kv_lora_rank, rope dims) of an MLA GGUF (llama.cpp's deepseek2), None for another architecture."""
    rank, rope = gguf_ints(model, "deepseek2.attention.kv_lora_rank", "deepseek2.rope.dimension_count")
    return (rank, rope) if rank and rope is not None else None


# llama.cpp's worker is taken as hung past an hour plus this many seconds per token at a 2,048-token context (longer
# contexts cost more per token): a flat hour stopped long-context measures that were still running
SECONDS_PER_TOKEN = 0.02


def time_limit(windows=(), prompts=(), new_tokens: int = 16, n_ctx: int = 2048) -> float:
    """Seconds before a scoring worker is taken as hung: an hour, plus SECONDS_PER_TOKEN per token scored or
    generated, scaled by the context over 2,048."""
    tokens = sum(len(w) for w in windows) + sum(len(p) + new_tokens for p in prompts)
    return 3600 + SECONDS_PER_TOKEN * tokens * max(1.0, n_ctx / 2048)


def score_gguf(model: str | os.PathLike, windows=(), prompts=(), new_tokens: int = 16, n_ctx: int = 2048,
               cache_type: str = "f16", threads: int = 0, env: dict | None = None) -> dict:
    """run_llamacpp for `eval --engine llamacpp`: its environment and `cache_type` checked first, and llama.cpp's
    failure (or time limit) as one UserError line."""
    from mla_convert.errors import UserError

    if llamacpp_python() is None:
        raise UserError("--engine llamacpp needs llama.cpp's environment: run scripts/install-llamacpp.sh (or set "
                        "MLA_CONVERT_LLAMACPP_PYTHON to the python of an environment with llama-cpp-python)")
    if cache_type not in CACHE_TYPES:
        raise UserError(f"--cache-type for llama.cpp is one of {', '.join(CACHE_TYPES)}, got {cache_type}")
    layout = gguf_mla_layout(model) if cache_type not in FLOAT_CACHE_TYPES else None
    if layout and not quantized_cache_ok(*layout):
        takes = llamacpp_cache_types(*layout).replace("cache types: ", "", 1)
        raise UserError(f"--cache-type {cache_type}: {model} takes {takes}")
    try:
        return run_llamacpp(model, windows=windows, prompts=prompts, new_tokens=new_tokens, n_ctx=n_ctx,
                            threads=threads, cache_type=cache_type, env=env,
                            timeout=time_limit(windows, prompts, new_tokens, n_ctx))
    except RuntimeError as e:
        last = [line for line in str(e).splitlines() if line.strip()][-1]
        raise UserError(f"llama.cpp could not run {model} with a {cache_type} cache: {last[:300]}") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"llama.cpp did not finish scoring {model} within the time limit: lower --windows") from None


def llamacpp_perplexity(model: str | os.PathLike, ids, seq_len: int, windows: int, threads: int = 0,
                        cache_type: str = "f16", env: dict | None = None) -> dict:
    """`evaluate.perplexity`'s protocol (the first `windows` non-overlapping windows of `seq_len` tokens of `ids`,
    each scored on its own, from the same token ids) run in llama.cpp with its cache in `cache_type` (flash attention
    on for quantized types); adds llama.cpp's KV-cache bytes per token."""
    from mla_convert.evaluate import eval_windows

    chunks = eval_windows(ids, seq_len, windows).tolist()
    res = score_gguf(model, windows=chunks, n_ctx=seq_len, threads=threads, cache_type=cache_type, env=env)
    flat = [x for w in res["logprobs"] for x in w]
    nll = -sum(flat) / len(flat)
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": len(flat), "windows": len(chunks), "seq_len": seq_len,
            **engine_fields(res, cache_type)}


def engine_fields(res: dict, cache_type: str) -> dict:
    """The fields of an eval result that say how llama.cpp ran: its version, cache type and KV-cache bytes."""
    kv = res["kv_cache"] or {}
    return {"engine": f"llama.cpp (llama-cpp-python {res['llama_cpp_version']})", "cache_type": cache_type,
            "kv_cache_bytes_per_token": kv.get("bytes_per_token"), "kv_cache_log": kv or None}


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
