#!/usr/bin/env python
"""Perplexity of several models on several texts in one process, as `mla-convert eval` scores each pair (the same
token ids, the same first W non-overlapping windows of T tokens), so that a benchmark run on a GPU machine loads each
text once and each model once.

    python benchmarks/common/score_domains.py --models source,out/a,out/b --texts wiki=FILE,devref=FILE \
        [--windows 16] [--seq-len 2048] [--dtype float32] [--device cuda] --json OUT.json

`source` (or a name given as LABEL=PATH) is scored like any other folder; `source` alone is the embedded default.
A DeepSeek-V3 export is scored in stock transformers' DeepseekV3ForCausalLM, in a process that never imports
mla_convert (benchmarks/common/stock_score.py). `--engine vllm` scores every text in one vLLM run per model (vLLM's own
environment, scripts/install-vllm.sh); a DeepSeek-V3 export runs there in vLLM's own DeepseekV3ForCausalLM (the
class is recorded), with the plugin loaded unless `--vllm-plugins none`: on vLLM's CPU build the plugin's fix of
vLLM's rotary kernel is what makes any MLA model right there (docs/serving.md).
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

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_pairs(spec: str, what: str) -> list[tuple[str, str]]:
    """"a,b=c" -> [(a, a), (b, c)]: LABEL=VALUE pairs, a bare value labelled by its own name."""
    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        label, _, value = item.partition("=")
        out.append((label, value) if value else (Path(label).name if what == "model" else Path(label).stem, label))
    return out


def is_stock_export(path: str) -> bool:
    """A DeepSeek-V3 export (config model_type deepseek_v3): scored as a user without mla-convert loads it."""
    config = Path(path) / "config.json"
    return config.is_file() and json.loads(config.read_text()).get("model_type") == "deepseek_v3"


def stock_scores(path: str, ids: dict, args) -> dict:
    """Perplexities of a DeepSeek-V3 export in stock transformers, in a process that never imports mla_convert."""
    import tempfile

    from safetensors.torch import save_file

    from benchmarks.common import stock_score

    with tempfile.TemporaryDirectory(prefix="mla-stock-") as tmp:
        ids_path = Path(tmp) / "ids.safetensors"
        save_file({name: t.contiguous() for name, t in ids.items()}, str(ids_path))
        res = stock_score.run("stock", Path(path).resolve(), ids_path, args.seq_len, args.windows, args.threads)
    return res["perplexity"]


def vllm_scores(path: str, ids: dict, args) -> tuple[dict, dict]:
    """Perplexities in vLLM (one engine start for every text) and vLLM's KV-cache report. `--vllm-plugins none` starts
    vLLM with no plugin loaded (VLLM_PLUGINS empty)."""
    from mla_convert import evaluate
    from mla_convert.serving import engine

    windows = {name: evaluate.eval_windows(t, args.seq_len, args.windows).tolist() for name, t in ids.items()}
    flat = [w for ws in windows.values() for w in ws]
    res = engine.score_in_vllm(path, flat, dtype=args.dtype, max_model_len=args.seq_len + 64, timeout=7200,
                               env={"VLLM_PLUGINS": ""} if args.vllm_plugins == "none" else None)
    scores, at = {}, 0
    for name, ws in windows.items():
        scores[name] = engine.perplexity(res["logprobs"][at : at + len(ws)])
        at += len(ws)
    return scores, {key: res.get(key) for key in ("kv_cache", "attention_backend", "model_class", "plugins",
                                                  "vllm_version")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", required=True, help="comma-separated model folders (LABEL=PATH; source = default)")
    parser.add_argument("--texts", required=True, help="comma-separated text files (NAME=PATH)")
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    parser.add_argument("--vllm-plugins", choices=["all", "none"], default="all",
                        help="none: vLLM without mla-convert's plugin (whose CPU rotary fix every MLA model needs)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads of a stock scoring process")
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from mla_convert import evaluate
    from mla_convert.data import load_text

    texts = {name: load_text(path) for name, path in parse_pairs(args.texts, "text")}
    record = {"protocol": {"windows": args.windows, "seq_len": args.seq_len, "dtype": args.dtype,
                           "device": args.device, "engine": args.engine,
                           "texts": dict(parse_pairs(args.texts, "text"))},
              "results": {}, "seconds": {}, "how": {}}
    if args.device.startswith("cuda"):
        record["protocol"]["gpu"] = torch.cuda.get_device_name(0)
    for label, path in parse_pairs(args.models, "model"):
        start = time.perf_counter()
        if args.engine == "vllm" and path == "source":
            raise SystemExit("--engine vllm scores model folders: give the source's folder, not `source`")
        if args.engine == "vllm" or is_stock_export(path):
            tokenizer = AutoTokenizer.from_pretrained(path)
            ids = {name: evaluate.tokenize(tokenizer, text) for name, text in texts.items()}
            if args.engine == "vllm":
                scores, record["how"][label] = vllm_scores(path, ids, args)
            else:
                if args.dtype != "float32" or args.device != "cpu":
                    raise SystemExit("a DeepSeek-V3 export is scored in stock transformers in float32 on the CPU")
                scores, record["how"][label] = stock_scores(path, ids, args), "stock DeepseekV3ForCausalLM"
        else:
            with torch.inference_mode():
                net, tokenizer, _ = evaluate.load_model(None if path == "source" else path, args.dtype, args.device)
                scores = {}
                for name, text in texts.items():
                    ids = evaluate.tokenize(tokenizer, text)
                    scores[name] = evaluate.perplexity(net, ids, args.seq_len, args.windows, progress=False)["perplexity"]
            record["how"][label] = f"mla_convert.evaluate, {type(net).__name__}"
            del net
        record["results"][label] = scores
        record["seconds"][label] = round(time.perf_counter() - start, 1)
        print(f"{label}: " + ", ".join(f"{n} {p:.3f}" for n, p in scores.items()), flush=True)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from mla_convert.errors import UserError

    try:
        sys.exit(main())
    except UserError as err:  # a missing text or model: one line, as the CLI prints it
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
