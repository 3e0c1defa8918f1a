"""Run a model folder in a real engine (vLLM, in its own environment) and in transformers, on the same tokens.

The engine runs in a subprocess of its own Python (scripts/install-vllm.sh makes `.venv-vllm`; or set
`MLA_CONVERT_VLLM_PYTHON`), through mla_convert.serving.vllm_score. Both sides return per-token log-probabilities
of the given windows and greedy continuations of the given prompts, so callers compare perplexities and tokens.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def vllm_python() -> Path | None:
    """The Python of an environment with vLLM and this plugin, or None."""
    env = os.environ.get("MLA_CONVERT_VLLM_PYTHON")
    candidate = Path(env) if env else REPO / ".venv-vllm" / "bin" / "python"
    return candidate if candidate.exists() else None


def score_in_vllm(folder: str | os.PathLike, windows: list[list[int]] = (), prompts: list[list[int]] = (),
                  new_tokens: int = 16, dtype: str = "auto", max_model_len: int = 2048, decode: dict | None = None,
                  timeout: float = 3600, env: dict | None = None, attention_backend: str | None = None,
                  kv_cache_dtype: str = "auto") -> dict:
    """vllm_score's RESULT for `folder` (see that module); raises RuntimeError with vLLM's last lines on failure."""
    python = vllm_python()
    if python is None:
        raise RuntimeError("no vLLM environment: run scripts/install-vllm.sh (or set MLA_CONVERT_VLLM_PYTHON)")
    request = {
        "model": str(Path(folder).resolve()), "dtype": dtype, "max_model_len": max_model_len,
        "windows": [list(map(int, w)) for w in windows], "prompts": [list(map(int, p)) for p in prompts],
        "new_tokens": new_tokens, "decode": decode, "attention_backend": attention_backend,
        "kv_cache_dtype": kv_cache_dtype,
    }  # fmt: skip
    out = run_worker([str(python), "-m", "mla_convert.serving.vllm_score"], request, f"vLLM failed on {folder}",
                     timeout, env)
    # vLLM's own line, e.g. "CPU KV cache size: 31,056 tokens": the tokens its allocated blocks hold
    sizes = re.findall(r"KV cache size: ([\d,]+) tokens", out["log"])
    if sizes:
        out["kv_cache"]["log_tokens"] = int(sizes[-1].replace(",", ""))
    return out


def run_worker(argv: list[str], request: dict, failure: str, timeout: float, env: dict | None = None) -> dict:
    """Run an engine's worker in its own environment: `argv` + [request.json, result.json] in a temporary folder,
    without this process's PYTHONPATH / VIRTUAL_ENV (plus `env`). -> the result with the worker's output as "log";
    RuntimeError(`failure` and the output's last lines) when it fails or writes no result."""
    with tempfile.TemporaryDirectory(prefix="mla-engine-") as tmp:
        req, res, log = Path(tmp) / "request.json", Path(tmp) / "result.json", Path(tmp) / "worker.log"
        req.write_text(json.dumps(request))
        run_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        run_env.update(env or {})
        with open(log, "w") as log_file:
            proc = subprocess.run([*argv, str(req), str(res)], cwd=tmp, env=run_env, stdout=log_file,
                                  stderr=subprocess.STDOUT, timeout=timeout)
        text = log.read_text(errors="replace")
        if proc.returncode != 0 or not res.exists():
            raise RuntimeError(f"{failure} (exit {proc.returncode}):\n" + "\n".join(text.splitlines()[-25:]))
        out = json.loads(res.read_text())
    out["log"] = text
    return out


def score_in_transformers(folder: str | os.PathLike, windows: list[list[int]] = (), prompts: list[list[int]] = (),
                          new_tokens: int = 16, dtype: torch.dtype = torch.float32) -> dict:
    """The same RESULT fields from transformers (native MLA checkpoints and stock DeepSeek-V3 exports alike)."""
    from transformers import AutoModelForCausalLM

    import mla_convert.modeling  # noqa: F401  (model_type mla)

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, trust_remote_code=False,
                                                 use_safetensors=True).eval()
    out: dict = {"logprobs": [], "greedy": []}
    with torch.no_grad():
        for w in windows:
            ids = torch.tensor([w])
            logp = torch.log_softmax(model(ids).logits.double(), dim=-1)[0, :-1]
            out["logprobs"].append(logp.gather(-1, ids[0, 1:, None])[:, 0].tolist())
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 pad_token_id=0)
            out["greedy"].append(gen[0, len(p):].tolist())
    return out


def perplexity(logprobs: list[list[float]]) -> float:
    """exp of the mean negative log-probability over every scored token of every window."""
    flat = [x for w in logprobs for x in w]
    return math.exp(-sum(flat) / len(flat))


def max_logprob_difference(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |a - b| over every token of every window; windows and tokens must match one to one."""
    return max(abs(x - y) for wa, wb in zip(a, b, strict=True) for x, y in zip(wa, wb, strict=True))


def vllm_perplexity(folder: str | os.PathLike, ids: torch.Tensor, seq_len: int, windows: int, dtype: str,
                    kv_cache_dtype: str = "auto") -> dict:
    """`evaluate.perplexity`'s protocol (the first `windows` non-overlapping windows of `seq_len` tokens of `ids`,
    each scored on its own) run in vLLM with its KV cache in `kv_cache_dtype` (auto, or vLLM's fp8 types);
    adds vLLM's own KV-cache bytes per token (all layers, as allocated)."""
    from mla_convert.errors import UserError
    from mla_convert.evaluate import eval_windows

    from mla_convert.serving.layout import check_servable

    config = json.loads((Path(folder) / "config.json").read_text())
    check_servable(config, "vLLM's MLA kernels", query_norm=True)
    if kv_cache_dtype != "auto" and "kv_lora_rank" in config:
        # vLLM 0.32's CPU MLA backend allocates the fp8 latent cache, but scoring a window never reads it (prefill
        # attends to the fresh latent) and its decode kernel refuses it ("expected scalar type Float")
        raise UserError(f"vLLM's CPU build does not serve an MLA model with a {kv_cache_dtype} cache (its decode "
                        "kernel takes none): score the latent's quantized cache with --engine transformers or llamacpp "
                        "--cache-type q8_0 (or drop --cache-type)")
    chunks = eval_windows(ids, seq_len, windows).tolist()
    windows = len(chunks)
    if vllm_python() is None:
        raise UserError("--engine vllm needs vLLM's environment: run scripts/install-vllm.sh (or set "
                        "MLA_CONVERT_VLLM_PYTHON to the python of an environment with vLLM and mla-convert)")
    try:
        res = score_in_vllm(folder, chunks, dtype=dtype, max_model_len=seq_len + 16, kv_cache_dtype=kv_cache_dtype)
    except RuntimeError as e:
        last = [line for line in str(e).splitlines() if line.strip()][-1]
        raise UserError(f"vLLM could not run {folder}: {last[:300]}") from None
    except subprocess.TimeoutExpired:
        raise UserError(f"vLLM did not finish scoring {folder} within the time limit: lower --windows") from None
    ppl = perplexity(res["logprobs"])
    return {"perplexity": ppl, "nll": math.log(ppl), "tokens": sum(len(w) for w in res["logprobs"]),
            "windows": windows, "seq_len": seq_len, "engine": f"vllm {res['vllm_version']}",
            "attention_backend": res["attention_backend"],
            "cache_type": None if kv_cache_dtype == "auto" else kv_cache_dtype,
            "kv_cache_bytes_per_token": res["kv_cache"].get("bytes_per_token")}
