"""Verification of an export: stock transformers' DeepseekV3ForCausalLM, in a subprocess that never imports
mla_convert, against the native model (logits on random tokens and greedy generation with the cache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mla_convert.export.plan import ExportOptions

# Runs in a fresh interpreter that never imports mla_convert: the export must load in stock transformers alone.
_STOCK_CHECK = r"""
import json
import sys
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV3ForCausalLM

folder, inputs_path, out_path = sys.argv[1:4]
with safe_open(inputs_path, framework="pt") as f:
    inp = {k: f.get_tensor(k) for k in f.keys()}
    inp.update(json.loads(f.metadata()["settings"]))
model, info = DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32, output_loading_info=True,
                                                    use_safetensors=True)
model.eval()
meta = {"loading_info": {k: sorted(str(x) for x in v) for k, v in info.items()}}
res = {}
with torch.no_grad():
    res["logits"] = model(inp["input_ids"]).logits
    n = inp["new_tokens"]
    res["generated"] = model.generate(
        inp["prompt"], do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0
    )
    if inp["zero_biases"]:
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
        res["logits_without_biases"] = model(inp["input_ids"]).logits
meta["mla_convert_imported"] = any(m.split(".")[0] == "mla_convert" for m in sys.modules)
meta["transformers_version"] = __import__("transformers").__version__
save_file({k: v.contiguous() for k, v in res.items()}, out_path, metadata={"result": json.dumps(meta)})
"""


def relative_error(reference: torch.Tensor, other: torch.Tensor) -> float:
    """max |other - reference| / max |reference| (over every position and vocabulary entry)."""
    reference, other = reference.double(), other.double()
    return float((other - reference).abs().max() / reference.abs().max().clamp_min(1e-30))


def verify_export(native_folder: Path, export_folder: Path, options: ExportOptions, has_biases: bool) -> dict:
    """Logits and greedy tokens of stock DeepseekV3ForCausalLM (subprocess, no mla_convert) vs the native model."""
    from transformers import AutoModelForCausalLM

    import mla_convert.modeling  # noqa: F401  (registers model_type mla)

    native = AutoModelForCausalLM.from_pretrained(native_folder, dtype=torch.float32, trust_remote_code=False,
                                                  use_safetensors=True).eval()
    gen = torch.Generator().manual_seed(options.seed)
    ids = torch.randint(0, native.config.vocab_size, (options.verify_batch, options.verify_tokens), generator=gen)
    prompt = ids[:1, : max(1, options.verify_tokens // 4)]
    n = options.verify_new_tokens
    with torch.no_grad():
        native_logits = native(ids).logits
        native_gen = native.generate(prompt, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
    del native
    with tempfile.TemporaryDirectory(prefix="mla-export-verify-") as tmp:
        inputs, result = Path(tmp) / "inputs.safetensors", Path(tmp) / "result.safetensors"
        save_file({"input_ids": ids.clone(), "prompt": prompt.clone()}, str(inputs),
                  metadata={"settings": json.dumps({"new_tokens": n, "zero_biases": bool(has_biases)})})
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing of ours on the path
        proc = subprocess.run(
            [sys.executable, "-c", _STOCK_CHECK, str(export_folder), str(inputs), str(result)],
            cwd=tmp, env=env, capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode != 0:
            tail = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
            raise RuntimeError(f"stock DeepseekV3ForCausalLM failed on the export: {tail}\n{proc.stderr[-4000:]}")
        with safe_open(str(result), framework="pt") as f:  # no pickle either way
            res = {k: f.get_tensor(k) for k in f.keys()}
            res.update(json.loads(f.metadata()["result"]))
    info = res["loading_info"]
    if res["mla_convert_imported"]:
        raise RuntimeError("the stock check imported mla_convert: it would not prove a stock load")
    if info.get("missing_keys") or info.get("unexpected_keys") or info.get("mismatched_keys"):
        raise RuntimeError(f"stock DeepseekV3ForCausalLM did not load every tensor of the export: {info}")
    out = {
        "export_max_rel_logit_error": relative_error(native_logits, res["logits"]),
        "export_max_abs_logit_error": float((native_logits.double() - res["logits"].double()).abs().max()),
        "export_argmax_agreement": float((native_logits.argmax(-1) == res["logits"].argmax(-1)).double().mean()),
        "export_greedy_tokens_match": bool(torch.equal(native_gen, res["generated"])),
        "export_verify_protocol": (
            f"{options.verify_batch} x {options.verify_tokens} random tokens (seed {options.seed}) and "
            f"{n} greedy tokens, float32, stock transformers {res['transformers_version']} DeepseekV3ForCausalLM in a "
            "subprocess without mla_convert; error = max|stock - native| / max|native| over all logits"
        ),
    }
    if has_biases:
        out["export_max_rel_logit_error_without_biases"] = relative_error(native_logits, res["logits_without_biases"])
    return out
