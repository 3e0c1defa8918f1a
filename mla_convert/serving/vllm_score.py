"""Score a model folder in vLLM: per-token log-probabilities of given windows, greedy continuations, decode speed.

Runs in vLLM's environment (scripts/install-vllm.sh makes one), as a separate process:

    python -m mla_convert.serving.vllm_score REQUEST.json RESULT.json

REQUEST: {"model": folder, "dtype": "float32"|"bfloat16"|"auto", "max_model_len": int,
          "attention_backend": a vLLM backend name, or "vllm" for vLLM's own choice (optional; default: vLLM's
          choice, except CPU_MLA on AMX CPUs for what its AMX backend cannot run),
          "windows": [[token ids]], "prompts": [[token ids]], "new_tokens": int,
          "decode": {"batch": int, "prompt_tokens": int, "new_tokens": int} (optional)}
RESULT:  {"logprobs": [[log p(token t | tokens < t) for t >= 1]], "greedy": [[token ids]],
          "decode_tokens_per_s": float, "kv_cache": {...}, "vllm_version": str, "attention_backend": str,
          "model_class": module.name of the model vLLM built, "plugins": VLLM_PLUGINS (None: all installed)}

The KV-cache figures are vLLM's own: bytes per token from its allocated cache tensors and the number of tokens its
cache holds, read from the engine after start-up (the same numbers its log prints).
"""

from __future__ import annotations

import json
import os
import sys
import time

from mla_convert.evaluate import tensor_bytes


def _kv_cache_report(llm) -> dict:
    """Bytes per token and token capacity of the cache vLLM allocated (single process: the engine core in-process)."""
    report = {}
    try:
        config = llm.llm_engine.vllm_config
        report["num_gpu_blocks"] = config.cache_config.num_gpu_blocks
        report["block_size"] = config.cache_config.block_size
    except AttributeError:
        pass
    try:
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        caches = [t for t in runner.kv_caches if hasattr(t, "numel")]
        total = tensor_bytes(caches)
        report["allocated_bytes"] = total
        report["layers"] = len(caches)
        if report.get("num_gpu_blocks"):
            tokens = report["num_gpu_blocks"] * report["block_size"]
            report["tokens"] = tokens
            report["bytes_per_token"] = total / tokens
            report["row_shape"] = list(caches[0].shape[2:]) if caches and caches[0].dim() >= 3 else None
    except AttributeError as exc:  # engine internals differ between vLLM versions: report what could be read
        report["error"] = f"cache tensors not readable: {exc}"
    return report


def _attention_backend(folder: str, dtype: str) -> str | None:
    """The attention backend to ask vLLM for: on CPUs with AMX tiles, its reference CPU MLA backend where its
    AMX one (its own choice there) cannot run the checkpoint; else None (vLLM's choice)."""
    from transformers import AutoConfig

    from mla_convert.serving.vllm_plugin import cpu_attention_backend

    config = AutoConfig.from_pretrained(folder)
    if dtype == "auto":
        dtype = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "float32")
    return cpu_attention_backend(config, dtype.replace("torch.", ""))


def main(request_path: str, result_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    req = json.loads(open(request_path).read())
    backend = req.get("attention_backend") or _attention_backend(req["model"], req.get("dtype", "auto"))
    backend = None if backend == "vllm" else backend  # "vllm": vLLM's own choice, whatever it is
    llm = LLM(
        model=req["model"],
        **({"attention_backend": backend} if backend else {}),
        dtype=req.get("dtype", "auto"),
        max_model_len=req.get("max_model_len", 2048),
        enforce_eager=True,
        seed=0,
        trust_remote_code=False,
        max_num_seqs=req.get("max_num_seqs", 8),
        kv_cache_dtype=req.get("kv_cache_dtype") or "auto",  # vLLM's own: auto, fp8, fp8_e4m3, fp8_e5m2
    )
    out: dict = {"vllm_version": __import__("vllm").__version__}
    layer = model_class = None
    try:
        runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
        layer = runner.attn_groups[0][0].backend.get_name()
        model = type(runner.get_model())
        model_class = f"{model.__module__}.{model.__name__}"
    except (AttributeError, IndexError, TypeError):
        pass
    out["attention_backend"], out["model_class"] = layer, model_class
    out["plugins"] = os.environ.get("VLLM_PLUGINS")  # None: every installed plugin loaded
    out["kv_cache"] = _kv_cache_report(llm)
    windows = req.get("windows", [])
    if windows:
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
        results = llm.generate([TokensPrompt(prompt_token_ids=w) for w in windows], params, use_tqdm=False)
        out["logprobs"] = [
            [entry[tok].logprob for entry, tok in zip(r.prompt_logprobs[1:], w[1:])] for r, w in zip(results, windows)
        ]
    prompts = req.get("prompts", [])
    if prompts:
        n = req.get("new_tokens", 16)
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        results = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        out["greedy"] = [list(r.outputs[0].token_ids) for r in results]
    decode = req.get("decode")
    if decode:
        n, batch = decode["new_tokens"], decode["batch"]
        prompt = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 1000 + 10 for j in range(decode["prompt_tokens"])])
                  for i in range(batch)]
        prefill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        llm.generate(prompt, prefill, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        llm.generate(prompt, prefill, use_tqdm=False)
        t1 = time.perf_counter()
        llm.generate(prompt, params, use_tqdm=False)
        t2 = time.perf_counter()
        # decode time = full run minus a prefill-only run of the same prompts
        out["decode_tokens_per_s"] = batch * (n - 1) / max((t2 - t1) - (t1 - t0), 1e-9)
        out["decode"] = dict(decode, prefill_s=t1 - t0, total_s=t2 - t1)
    with open(result_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: its cache can be inspected
    main(*sys.argv[1:3])
