#!/usr/bin/env python
"""Quick one-shot quality probe used to choose the defaults (benchmarks/quality.md, "Exploration").

    python scripts/explore_quality.py SOURCE_DIR NAME key=value ...   (ConvertOptions fields, JSON values)
    e.g. W=2 python scripts/explore_quality.py out/smollm2-src A kv_budget=0.5 rope_dims=64 calib_samples=16

SOURCE_DIR is a safetensors copy of the embedded SmolLM2-135M (the GGUF de-quantized once; `--dump-source DIR` makes
it), so each probe skips the GGUF load. Converts in process, scores the first W (env, default 4) 2048-token windows of
WikiText-2 raw test, prints one JSON line. Calibration: WikiText-2 validation. Fewer windows than the benchmark: a
probe, not a result; the numbers that count are bench_quality.py's.
"""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"


def dump_source(folder: str) -> None:
    from safetensors.torch import save_file

    from mla_convert.evaluate import load_model

    model, tok, _ = load_model(None)
    os.makedirs(folder, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied embeddings
    save_file(state, f"{folder}/model.safetensors", metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    Path(folder, "config.json").write_text(json.dumps(config, indent=1))
    tok.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)


def main() -> None:
    if sys.argv[1] == "--dump-source":
        return dump_source(sys.argv[2])
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import mla_convert  # noqa: F401
    from mla_convert import evaluate
    from mla_convert.checkpoint import open_source
    from mla_convert.convert import ConvertOptions, convert

    src, name, windows = sys.argv[1], sys.argv[2], int(os.environ.get("W", "4"))
    opts = dict(calib_data=str(DATA / "wiki.valid.tokens"), dtype="float32")
    for kv in sys.argv[3:]:
        key, value = kv.split("=", 1)
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
        opts[key] = value
    out = ROOT / "out" / f"probe-{name}"
    start = time.time()
    convert(open_source(src), out, ConvertOptions(**opts), overwrite=True, progress=False)
    seconds = time.time() - start
    ids = evaluate.tokenize(AutoTokenizer.from_pretrained(src), (DATA / "wiki.test.raw").read_text())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    result = evaluate.perplexity(model, ids, 2048, windows, progress=False)
    shown = {k: v for k, v in opts.items() if k not in ("calib_data", "dtype")}
    print(json.dumps({"name": name, "ppl": round(result["perplexity"], 3), "W": windows, "convert_s": round(seconds, 1), **shown}))
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
