"""The MLA cache holds the latent and the rope key only: d_c + d_r values per token per layer, nothing per head."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import mla_convert  # noqa: F401
from mla_convert.checkpoint import open_source
from mla_convert.convert import ConvertOptions, make_plan
from mla_convert.evaluate import kv_cache_bytes_per_token
from mla_convert.families import family_for
from mla_convert.modeling.compat import cache_kwargs, output_cache
from mla_convert.modeling.configuration_mla import layer_ranks


def test_cache_tensors_are_latent_and_rope_key(sources, convert_tiny):
    out = convert_tiny(sources["llama-gqa"], rank=10, rope_dims=6)
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, 300, (3, 11))
    with torch.no_grad():
        cache = output_cache(model(ids, use_cache=True))
    ranks = model.config.kv_lora_ranks  # the default energy allocation shares 10 dims a layer among the layers
    assert len(cache.layers) == model.config.num_hidden_layers == len(ranks) and sum(ranks) == 10 * len(ranks)
    for layer, rank in zip(cache.layers, ranks):
        assert tuple(layer.keys.shape) == (3, 1, 11, rank)  # latent c: one "head"
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
    ranks = layer_ranks(config)
    assert config["model_type"] == "mla" and len(ranks) == 2 and sum(ranks) == 32
    assert record["options"]["rank_allocation"] == "energy" and record["plan"]["ranks"] == ranks


def test_sharded_writer_splits_and_indexes(tmp_path):
    from safetensors.torch import load_file

    from mla_convert.outputs import ShardedWriter

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


# ---------------------------------------------------------------------------------------------- static cache


def _tiny_mla():
    from mla_convert.modeling import MLAConfig, MLAForCausalLM

    torch.manual_seed(0)
    config = MLAConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, kv_lora_rank=[12, 10],
                       qk_rope_head_dim=8, max_position_embeddings=256, attention_bias=True)
    return MLAForCausalLM(config).eval()


def _decode(model, cache, ids, mask, steps=4):
    """Prefill `ids` (left-padded per `mask`), then greedy steps over `cache`: stacked logits of every step."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(ids, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(steps):
        nxt = out.logits[:, -1:].argmax(-1)
        mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)
        positions = positions[:, -1:] + 1
        out = model(nxt, attention_mask=mask, position_ids=positions, **cache_kwargs(cache), use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.stack(logits), output_cache(out)


def test_static_cache_holds_latent_and_rope_key_and_decodes_as_the_dynamic_one():
    """A preallocated StaticCache (capacity 32 rows) holds d_c + d_r per token per layer, nothing per head, and a
    left-padded batch decodes to the DynamicCache's logits (the decode step reads only the written rows on CPU)."""
    from transformers import DynamicCache, StaticCache

    model = _tiny_mla()
    ids = torch.randint(3, 300, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        want, _ = _decode(model, DynamicCache(config=model.config), ids, mask)
        got, cache = _decode(model, StaticCache(config=model.config, max_cache_len=32), ids, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for layer, d_c in zip(cache.layers, model.config.kv_lora_ranks):
        assert tuple(layer.keys.shape) == (3, 1, 32, d_c)  # latent c
        assert tuple(layer.values.shape) == (3, 1, 32, model.config.qk_rope_head_dim)  # rotated rope key
        assert int(layer.cumulative_length) == 9 + 4


def test_generate_with_static_cache_equals_dynamic():
    model = _tiny_mla()
    ids = torch.randint(3, 300, (2, 7), generator=torch.Generator().manual_seed(2))
    options = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
    static = model.generate(ids, cache_implementation="static", **options)
    dynamic = model.generate(ids, **options)
    assert torch.equal(static, dynamic)


def test_static_cache_decode_step_compiles_without_graph_breaks():
    """The decode step over a static cache is one graph (fullgraph=True): no host reads of the cache length, so it
    can be captured (CUDA graphs need the same; the `eager` backend checks the tracing without a compiler)."""
    from transformers import StaticCache

    model = _tiny_mla()
    ids = torch.randint(3, 300, (2, 6), generator=torch.Generator().manual_seed(3))
    caches = [StaticCache(config=model.config, max_cache_len=16) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            out = model(ids, **cache_kwargs(cache), use_cache=True)

        def step(token, position, cache):
            return model(token, position_ids=position, **cache_kwargs(cache), use_cache=True).logits

        compiled = torch.compile(step, fullgraph=True, backend="eager")
        token = out.logits[:, -1:].argmax(-1)
        for t in range(6, 9):
            position = torch.full((2, 1), t)
            got, want = compiled(token, position, caches[0]), step(token, position, caches[1])
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            token = got[:, -1:].argmax(-1)


def test_the_cache_passes_under_either_name(sources, convert_tiny):
    """transformers 5.24 renamed `past_key_values` to `cache` (generate passes `cache=`): both names reach the cache,
    the output carries it under the installed release's name, and two different caches at once are refused."""
    from transformers import DynamicCache

    from mla_convert.modeling.compat import CACHE_KWARG

    model = AutoModelForCausalLM.from_pretrained(convert_tiny(sources["llama-gqa"], rank=10, rope_dims=6)).eval()
    ids = torch.randint(3, 300, (1, 9))
    with torch.no_grad():
        full = model(ids).logits[:, -1]
        for name in ("cache", "past_key_values"):
            cache = DynamicCache(config=model.config)
            model(ids[:, :-1], **{name: cache}, use_cache=True)
            assert cache.get_seq_length() == 8  # the prefill went into the cache given under `name`
            step = model(ids[:, -1:], **{name: cache}, use_cache=True)
            assert getattr(step, CACHE_KWARG) is cache
            torch.testing.assert_close(step.logits[:, -1], full, rtol=1e-5, atol=1e-5)
        try:
            model(ids, cache=DynamicCache(config=model.config), past_key_values=DynamicCache(config=model.config))
        except ValueError as e:
            assert "not both" in str(e)
        else:
            raise AssertionError("two caches were accepted")
