"""Serving native checkpoints in engines: the served layout is exact (transformers), and vLLM runs it (when its CPU
build is installed; scripts/install-vllm.sh)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import SHARED  # noqa: F401
from tiny import tiny_source

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _served_model(folder: Path, layout):
    """The native model rebuilt in the served layout (what the engine runs), float32."""
    from safetensors.torch import load_file

    from mla_convert.modeling import MLAConfig, MLAForCausalLM
    from mla_convert.serving.layout import served_config, served_layer

    config = MLAConfig.from_pretrained(folder)
    state = {}
    for f in folder.glob("*.safetensors"):
        state.update(load_file(f))
    served = MLAConfig.from_pretrained(folder, **served_config(config, layout))
    model = MLAForCausalLM(served).eval()
    out = {k: v for k, v in state.items() if ".self_attn." not in k}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}.self_attn."
        layer = {k[len(p):]: v for k, v in state.items() if k.startswith(p)}
        for name, t in served_layer(layer, config, i, layout).items():
            out[p + name] = t
        if served.attention_bias:
            out[p + "kv_b_proj.bias"] = torch.zeros_like(model.model.layers[i].self_attn.kv_b_proj.bias)
    missing, unexpected = model.load_state_dict(out, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


@pytest.mark.parametrize("kind,rope", [("llama-gqa", None), ("qwen2", None), ("llama-gqa", LLAMA3_ROPE)])
@pytest.mark.parametrize("latent,rope_dims", [(256, 64), (512, 64)])
def test_served_layout_is_exact(tmp_path, convert_tiny, kind, rope, latent, rope_dims):
    """Padding, group repetition and the bias fold change nothing: logits and cached greedy decode equal."""
    from transformers import AutoModelForCausalLM

    from mla_convert.serving.layout import ServedLayout

    overrides = {"rope_parameters": rope} if rope else {}
    src = tiny_source(kind, tmp_path / "src", seed=3, **overrides)
    out = convert_tiny(src, rank=24, rope_dims=8)  # lossy, with repeated rope pairs from the merge: any native model
    native = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    served = _served_model(out, ServedLayout(latent, rope_dims))
    ids = torch.randint(0, native.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = native(ids).logits, served(ids).logits
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
        ga = native.generate(ids[:1, :8], do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
        gb = served.generate(ids[:1, :8], do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=0)
    assert torch.equal(ga, gb)


def test_served_layout_choice():
    from mla_convert.errors import UserError
    from mla_convert.serving.layout import VLLM_LAYOUTS, ServedLayout, served_layout

    assert served_layout([128] * 3, 64, VLLM_LAYOUTS["cuda"]) == ServedLayout(256, 64)
    assert served_layout([128, 300], 32, VLLM_LAYOUTS["cuda"]) == ServedLayout(512, 64)
    assert served_layout([128], 64, VLLM_LAYOUTS["cpu"]) == ServedLayout(512, 64)
    with pytest.raises(UserError, match="--rank 512"):
        served_layout([600], 64, VLLM_LAYOUTS["cpu"])
    with pytest.raises(UserError, match="--rope-dims 64"):
        served_layout([128], 96, VLLM_LAYOUTS["cuda"])
