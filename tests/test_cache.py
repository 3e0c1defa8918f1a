"""The MLA cache holds the latent and the rope key only: d_c + d_r values per token per layer, nothing per head."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import mla_convert  # noqa: F401
from mla_convert.checkpoint import open_source
from mla_convert.convert import ConvertOptions, make_plan
from mla_convert.evaluate import kv_cache_bytes_per_token
from mla_convert.families import family_for


def test_cache_tensors_are_latent_and_rope_key(sources, convert_tiny):
    out = convert_tiny(sources["llama-gqa"], rank=10, rope_dims=6)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, 300, (3, 11))
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    assert len(cache.layers) == model.config.num_hidden_layers
    for layer in cache.layers:
        assert tuple(layer.keys.shape) == (3, 1, 11, 10)  # latent c: one "head"
        assert tuple(layer.values.shape) == (3, 1, 11, 6)  # rotated rope key
    per_token_per_layer = sum(l.keys[0, :, 0].numel() + l.values[0, :, 0].numel() for l in cache.layers) / len(cache.layers)
    assert per_token_per_layer == 16


def test_measured_cache_bytes_equal_the_plan(sources, convert_tiny):
    for dtype in ("float32", "bfloat16"):
        out = convert_tiny(sources["qwen2"], rank=12, rope_dims=4, dtype=dtype)
        source = open_source(str(sources["qwen2"]))
        plan = make_plan(source, family_for(source.config), ConvertOptions(rank=12, rope_dims=4, dtype=dtype))
        model = AutoModelForCausalLM.from_pretrained(out, dtype=getattr(torch, dtype)).eval()
        assert kv_cache_bytes_per_token(model) == plan.kv_bytes_after
        src_model = AutoModelForCausalLM.from_pretrained(sources["qwen2"], dtype=getattr(torch, dtype)).eval()
        assert kv_cache_bytes_per_token(src_model) == plan.kv_bytes_before


def test_output_folder_contents(sources, convert_tiny):
    import json

    out = convert_tiny(sources["two-shards"], rank=16, rope_dims=8)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "provenance.json", "tokenizer.json"} <= names
    assert not any(n.startswith(".") or n.endswith(".tmp") for n in names)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) <= names
    assert (out / "tokenizer.json").read_bytes() == (sources["two-shards"] / "tokenizer.json").read_bytes()
    record = json.loads((out / "provenance.json").read_text())
    assert record["kind"] == "convert" and record["options"]["rank"] == 16 and record["seed"] == 0
    assert record["kv_cache"]["elements_per_token_per_layer_after"] == 24
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "mla" and config["kv_lora_rank"] == [16, 16]


def test_sharded_writer_splits_and_indexes(tmp_path):
    from safetensors.torch import load_file

    from mla_convert.checkpoint import ShardedWriter

    writer = ShardedWriter(tmp_path, torch.float32, max_shard_bytes=1000)
    tensors = {f"t{i}": torch.randn(100) for i in range(5)}  # 400 bytes each -> 3 shards
    for name, t in tensors.items():
        writer.add(name, t)
    names = writer.finalize()
    assert names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    loaded = {}
    for n in names:
        loaded.update(load_file(tmp_path / n))
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())
