"""MLAForCausalLM as a transformers model: the behaviours transformers' own model tests check (output capture, tuples,
per-layer config values, the tensor-parallel plan, capability flags, the cache argument's old name), and what users
do with transformers models (PEFT LoRA, `device_map="auto"`, a static cache under torch.compile)."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.cache_utils import DynamicCache
from transformers.integrations.heterogeneity import AmbiguousGlobalPerLayerAttributeError

from mla_convert.modeling import MLAConfig, MLAForCausalLM, MLAModel
from mla_convert.modeling.compat import output_cache
from mla_convert.modeling.configuration_mla import layer_ranks

RANKS = [12, 20, 16]


def tiny_config(**overrides) -> MLAConfig:
    """Three layers of different latent ranks and kept RoPE pairs, GQA (4 query heads over 2 kv groups)."""
    params = dict(
        vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, kv_lora_rank=list(RANKS), qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        rope_pairs=[[0, 2], [1, 3], [3, 0]], tie_word_embeddings=False,
    )
    params.update(overrides)
    return MLAConfig(**params)


def tiny_model(seed: int = 0, **overrides) -> MLAForCausalLM:
    torch.manual_seed(seed)
    model = MLAForCausalLM(tiny_config(**overrides)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.2)
    return model


def ids(batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 99, (batch, length), generator=torch.Generator().manual_seed(seed))


# --- output capture ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", [MLAModel, MLAForCausalLM])
def test_hidden_states_are_returned(model_class):
    model = model_class(tiny_config()).eval()
    x = ids()
    with torch.no_grad():
        out = model(x, output_hidden_states=True)
        plain = model(x)
    hidden = out.hidden_states
    assert hidden is not None and len(hidden) == model.config.num_hidden_layers + 1
    assert all(h.shape == (2, 9, 32) for h in hidden)
    embed = model.get_input_embeddings()
    torch.testing.assert_close(hidden[0], embed(x))  # the embeddings, then each layer's output
    last = out.last_hidden_state if model_class is MLAModel else None
    if last is not None:
        torch.testing.assert_close(hidden[-1], last)  # transformers' convention: the last one after the final norm
    # the layers' outputs in between: layer 0 applied to the embeddings gives hidden[1]
    base = model if model_class is MLAModel else model.model
    position_ids = torch.arange(9).unsqueeze(0)
    with torch.no_grad():
        layer0 = base.layers[0](hidden[0], position_embeddings=base.rotary_emb(hidden[0], position_ids))
    torch.testing.assert_close(hidden[1], layer0)
    if model_class is MLAForCausalLM:
        torch.testing.assert_close(out.logits, plain.logits)  # capturing changes nothing
        assert plain.hidden_states is None


def test_hidden_states_from_config_and_by_index():
    model = tiny_model()
    model.config.output_hidden_states = True
    with torch.no_grad():
        out = model(ids())
    assert len(out.hidden_states) == 4
    model.config.output_hidden_states = False
    with torch.no_grad():
        assert model(ids()).hidden_states is None


@pytest.mark.parametrize("mode", ["expanded", "absorbed"])
def test_attention_weights_are_returned_and_exact(mode):
    """output_attentions (eager attention): per layer [B, H, T, S] softmax weights, causal, rows summing to one; the
    logits equal sdpa's, in the expanded and the absorbed (latent) form alike."""
    model = tiny_model(mla_attention_mode=mode)
    x = ids()
    mask = torch.ones_like(x)
    mask[1, :3] = 0  # left padding in the second row
    with torch.no_grad():
        want = model(x, attention_mask=mask).logits  # sdpa
    model.set_attn_implementation("eager")
    with torch.no_grad():
        out = model(x, attention_mask=mask, output_attentions=True)
    # padded query positions see no key: their outputs are meaningless in either implementation
    torch.testing.assert_close(out.logits[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.logits[1, 3:], want[1, 3:], atol=1e-5, rtol=1e-5)
    assert len(out.attentions) == 3
    for weights in out.attentions:
        assert weights.shape == (2, 4, 9, 9)
        torch.testing.assert_close(weights.sum(-1)[0], torch.ones(4, 9))
        torch.testing.assert_close(weights.sum(-1)[1, :, 3:], torch.ones(4, 6))
        assert torch.all(weights[0].triu(1) == 0) and torch.all(weights[1].triu(1)[:, 3:] == 0)  # causal
        assert torch.all(weights[1, :, 3:, :3] == 0)  # the padded keys get no weight


def test_attention_weights_of_a_decode_step():
    """A step over a cache (the absorbed form in "auto" mode) returns its weights over every cached token; they are
    the last rows of the full sequence's weights."""
    model = tiny_model()
    model.set_attn_implementation("eager")
    x = ids(length=8)
    with torch.no_grad():
        full = model(x, output_attentions=True)
        prefix = model(x[:, :-1], use_cache=True)
        step = model(x[:, -1:], cache=output_cache(prefix), output_attentions=True)
    torch.testing.assert_close(step.logits[:, -1], full.logits[:, -1], atol=1e-5, rtol=1e-5)
    for got, want in zip(step.attentions, full.attentions):
        assert got.shape == (2, 4, 1, 8)
        torch.testing.assert_close(got[:, :, 0], want[:, :, -1], atol=1e-5, rtol=1e-5)


def test_generate_returns_hidden_states_and_attentions():
    model = tiny_model()
    model.set_attn_implementation("eager")
    x = ids(length=5)
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(x, **kwargs)
        out = model.generate(x, output_hidden_states=True, output_attentions=True, return_dict_in_generate=True,
                             **kwargs)
    assert torch.equal(out.sequences, plain)
    assert len(out.hidden_states) == len(out.attentions) == 3  # one entry per generated token
    assert out.hidden_states[0][0].shape == (2, 5, 32) and out.hidden_states[1][0].shape == (2, 1, 32)
    assert out.attentions[0][0].shape == (2, 4, 5, 5) and out.attentions[2][0].shape == (2, 4, 1, 7)


def test_attention_weights_over_a_static_cache_span_its_rows():
    """With a static cache the weights span every row of the cache, as transformers' attention over the whole buffer
    returns them (GenerationTesterMixin.test_generate_compilation_all_outputs): the written rows' weights are the
    dynamic cache's, the unwritten rows' are 0."""
    model = tiny_model()
    model.set_attn_implementation("eager")
    x = ids(length=5)
    kwargs = dict(max_new_tokens=3, do_sample=False, pad_token_id=0, output_attentions=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        dynamic = model.generate(x, **kwargs)
        static = model.generate(x, cache_implementation="static", **kwargs)
    assert torch.equal(static.sequences, dynamic.sequences)
    rows = output_cache(static).get_max_length(0)
    assert rows >= 7  # the prompt and the new tokens but the last, which is never fed back
    for step, (got_layers, want_layers) in enumerate(zip(static.attentions, dynamic.attentions)):
        for got, want in zip(got_layers, want_layers):
            written = 5 + step
            assert got.shape == (2, 4, 5 if step == 0 else 1, rows) and want.shape[-1] == written
            torch.testing.assert_close(got[..., :written], want, atol=1e-5, rtol=1e-5)
            assert torch.all(got[..., written:] == 0)


def test_assisted_decoding_with_output_flags():
    """Assisted decoding reads the hidden states and attentions of its verification steps (it crashed on None)."""
    model = tiny_model()
    model.set_attn_implementation("eager")
    assistant = tiny_model(seed=1)
    assistant.set_attn_implementation("eager")
    x = ids(batch=1, length=5)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        greedy = model.generate(x, **kwargs)
        out = model.generate(x, assistant_model=assistant, output_hidden_states=True, output_attentions=True,
                             return_dict_in_generate=True, **kwargs)
    assert torch.equal(out.sequences, greedy)  # assisted greedy decoding gives greedy decoding's tokens
    assert out.hidden_states is not None and out.attentions is not None


# --- return_dict=False -------------------------------------------------------------------------------------------


def test_return_dict_false_gives_tuples():
    model = tiny_model()
    x = ids()
    with torch.no_grad():
        as_dict = model(x, labels=x, use_cache=True)
        as_tuple = model(x, labels=x, use_cache=True, return_dict=False)
        base = model.model(x, return_dict=False, use_cache=False)
    assert isinstance(as_tuple, tuple) and isinstance(base, tuple)
    torch.testing.assert_close(as_tuple[0], as_dict.loss)
    torch.testing.assert_close(as_tuple[1], as_dict.logits)
    assert isinstance(as_tuple[2], DynamicCache)
    torch.testing.assert_close(base[0], model.model(x).last_hidden_state)


# --- per-layer ranks in config.json ------------------------------------------------------------------------------


def test_kv_lora_rank_is_a_number_with_per_layer_overrides(tmp_path):
    model = tiny_model()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["kv_lora_rank"] == max(RANKS)  # a number, bounding every layer's rank
    assert saved["per_layer_config"] == {"0": {"kv_lora_rank": 12}, "2": {"kv_lora_rank": 16}}
    assert layer_ranks(saved) == RANKS
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.kv_lora_ranks == RANKS
    assert [layer.self_attn.kv_lora_rank for layer in loaded.model.layers] == RANKS
    assert [loaded.config.per_layer_config[i].kv_lora_rank for i in range(3)] == RANKS
    with pytest.raises(AmbiguousGlobalPerLayerAttributeError):
        loaded.config.kv_lora_rank  # noqa: B018  (per layer, transformers refuses the global read)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)
        cache = output_cache(loaded(x, use_cache=True))
    assert [layer.keys.shape[-1] for layer in cache.layers] == RANKS


def test_uniform_ranks_read_as_one_number():
    config = tiny_config(kv_lora_rank=[16, 16, 16])
    assert config.kv_lora_rank == 16 and config.kv_lora_ranks == [16, 16, 16]
    assert tiny_config(kv_lora_rank=16).kv_lora_ranks == [16, 16, 16]
    assert "per_layer_config" not in json.loads(tiny_config(kv_lora_rank=16).to_json_string()) or \
        json.loads(tiny_config(kv_lora_rank=16).to_json_string())["per_layer_config"] == {}


def test_old_list_config_loads_the_same_model(tmp_path):
    """Folders written before (kv_lora_rank a list per layer) load with the same ranks and the same logits."""
    model = tiny_model()
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["kv_lora_rank"] = list(RANKS)
    del config["per_layer_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert layer_ranks(config) == RANKS
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.kv_lora_ranks == RANKS
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, model(x).logits, atol=0, rtol=0)


def test_ranks_given_at_load_or_set_later(tmp_path):
    """A rank list (or one number for every layer) passed to from_pretrained or set on a built config replaces
    every layer's rank (the vLLM plugin's served layout loads this way)."""
    tiny_config().save_pretrained(tmp_path)
    assert MLAConfig.from_pretrained(tmp_path, kv_lora_rank=[64, 32, 64]).kv_lora_ranks == [64, 32, 64]
    uniform = MLAConfig.from_pretrained(tmp_path, kv_lora_rank=24)
    assert uniform.kv_lora_ranks == [24, 24, 24] and uniform.kv_lora_rank == 24
    config = tiny_config()
    config.kv_lora_rank = [4, 5, 6]
    assert config.kv_lora_ranks == [4, 5, 6]
    assert json.loads(config.to_json_string())["per_layer_config"] == {"0": {"kv_lora_rank": 4},
                                                                       "1": {"kv_lora_rank": 5}}


def test_rank_list_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="one entry per layer"):
        tiny_config(kv_lora_rank=[8, 8])


# --- tensor-parallel plan ----------------------------------------------------------------------------------------


def _matches(pattern: str, names: set[str]) -> bool:
    import re

    return any(re.fullmatch(pattern.replace(".", r"\.").replace("*", r"\d+"), n) for n in names)


@pytest.mark.parametrize("qk_norm", [None, "calibrated", "exact"])
def test_tp_plan_names_existing_modules(qk_norm):
    model = tiny_model(qk_norm=qk_norm, qk_nope_head_dim=8)
    names = {name for name, _ in model.named_modules()}
    plan = model.tp_plan
    assert plan and all(_matches(pattern, names) for pattern in plan), plan
    assert not any("k_proj" in p or "v_proj" in p for p in plan)
    assert ("lm_head" in plan) == ("model.embed_tokens" in plan)  # a tied head is the embedding: both or neither
    attention = {p for p in plan if "self_attn" in p}
    if qk_norm == "exact":
        assert not attention  # k_rope_up/k_rope_down span every group: attention stays whole on each rank
    else:
        # the latent (and so the cache) is whole on each rank; only its rope key's gradient is summed over the ranks
        assert plan["model.layers.*.self_attn.kv_a_proj"] == "mla_kv_a_proj"
        assert ("model.layers.*.self_attn.q_head_proj" in plan) == (qk_norm == "calibrated")


def _shard(attn, rank: int, ranks: int, plan: dict):
    """What tensor parallelism keeps of an attention module on `rank` under `plan`: colwise entries keep their slice
    of output rows, rowwise ones their slice of input columns (and the bias on one rank only: it is added once)."""
    shard = copy.deepcopy(attn)
    for name, style in plan.items():
        if not name.startswith("model.layers.*.self_attn.") or style not in ("colwise", "rowwise"):
            continue  # whole on every rank
        linear = getattr(shard, name.rsplit(".", 1)[1])
        with torch.no_grad():
            if style == "colwise":
                rows = linear.weight.shape[0] // ranks
                keep = slice(rank * rows, (rank + 1) * rows)
                linear.weight = torch.nn.Parameter(linear.weight[keep].clone())
                if linear.bias is not None:
                    linear.bias = torch.nn.Parameter(linear.bias[keep].clone())
            else:
                cols = linear.weight.shape[1] // ranks
                linear.weight = torch.nn.Parameter(linear.weight[:, rank * cols : (rank + 1) * cols].clone())
                if linear.bias is not None and rank:
                    linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias))
    return shard


@pytest.mark.parametrize("mode", ["expanded", "absorbed"])
@pytest.mark.parametrize("qk_norm", [None, "calibrated"])
def test_tp_plan_shards_attention_exactly(mode, qk_norm):
    """The attention of two ranks sharded by the plan sums (o_proj's all-reduce) to the whole attention: prefill and
    a decode step over the cache, in the expanded and the absorbed form."""
    model = tiny_model(mla_attention_mode=mode, qk_norm=qk_norm, attention_bias=True)
    plan = model.tp_plan
    attn = model.model.layers[1].self_attn
    shards = [_shard(attn, r, 2, plan) for r in range(2)]
    hidden = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(0))
    rotary = model.model.rotary_emb
    whole_cache, shard_caches = DynamicCache(config=model.config), [DynamicCache(config=model.config) for _ in range(2)]
    with torch.no_grad():
        for start, stop in ((0, 5), (5, 6)):  # a prefill, then one token over the cache
            part = hidden[:, start:stop]
            pos = rotary(part, torch.arange(start, stop).unsqueeze(0))
            want, _ = attn(part, pos, cache=whole_cache)
            got = sum(s(part, pos, cache=c)[0] for s, c in zip(shards, shard_caches))
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# --- capability flags ---------------------------------------------------------------------------------------------


def test_custom_attention_function_is_used():
    """_supports_attention_backend (`is_backend_compatible()`, which callers such as engines' transformers backends
    read): an attention function registered with transformers runs in the expanded form."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return sdpa_attention_forward(*args, **kwargs)

    assert MLAForCausalLM.is_backend_compatible()
    AttentionInterface.register("mla_counted_sdpa", counted)
    model = tiny_model(mla_attention_mode="expanded")
    x = ids()
    with torch.no_grad():
        want = model(x).logits
    model.set_attn_implementation("mla_counted_sdpa")
    with torch.no_grad():
        got = model(x).logits
    assert len(calls) == 3
    torch.testing.assert_close(got, want)


def test_static_cache_generate_under_torch_compile_matches_eager():
    """_can_compile_fullgraph: the forward compiles as one graph (fullgraph=True) and generates, over a static
    cache, the tokens and scores of eager decoding."""
    model = tiny_model()
    assert MLAForCausalLM._can_compile_fullgraph
    x = ids(length=5)
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0, cache_implementation="static",
                  return_dict_in_generate=True, output_scores=True)
    with torch.no_grad():
        want = model.generate(x, **kwargs)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, fullgraph=True, backend="aot_eager", dynamic=False)
        got = model.generate(x, **kwargs)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# --- the cache argument's old name -------------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", [MLAModel, MLAForCausalLM])
def test_old_cache_argument_name_warns_and_works(model_class):
    model = model_class(tiny_config()).eval()
    x = ids()
    with torch.no_grad():
        new = model(x, cache=DynamicCache(config=model.config), use_cache=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = model(x, past_key_values=DynamicCache(config=model.config), use_cache=True)
    assert any("`past_key_values` is deprecated" in str(w.message) for w in caught)
    torch.testing.assert_close(old[0], new[0], atol=0, rtol=0)
    assert output_cache(old).get_seq_length() == 9


# --- what users do with it ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def converted(sources, convert_tiny):
    return convert_tiny(sources["llama-gqa"], rank=10, rope_dims=6)


def test_peft_lora_trains_saves_and_reloads(converted, tmp_path):
    peft = pytest.importorskip("peft")
    model = AutoModelForCausalLM.from_pretrained(converted)
    lora = peft.get_peft_model(model, peft.LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "kv_a_proj", "kv_b_proj", "o_proj"],
        task_type="CAUSAL_LM",
    ))
    trainable = {n for n, p in lora.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    x = ids(batch=2, length=16)
    optimizer = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    lora.train()
    losses = []
    for _ in range(6):
        loss = lora(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    lora.eval()
    with torch.no_grad():
        want = lora(input_ids=x).logits
    lora.save_pretrained(tmp_path / "adapter")
    base = AutoModelForCausalLM.from_pretrained(converted)
    reloaded = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        got = reloaded(input_ids=x).logits
        plain = AutoModelForCausalLM.from_pretrained(converted).eval()(input_ids=x).logits
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert not torch.allclose(got, plain)  # the adapter changed the model


def test_device_map_auto_loads(converted, tmp_path):
    """device_map="auto" places whole decoder layers (`_no_split_modules`); with too little memory for all, the rest
    is offloaded to disk and streamed in by accelerate's hooks. The logits are the model's either way."""
    pytest.importorskip("accelerate")
    x = ids()
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(converted).eval()(x).logits
        placed = AutoModelForCausalLM.from_pretrained(converted, device_map="auto").eval()
        torch.testing.assert_close(placed(x.to(placed.device)).logits.cpu(), want, atol=0, rtol=0)
        offloaded = AutoModelForCausalLM.from_pretrained(
            converted, device_map="auto", max_memory={"cpu": "60KB"}, offload_folder=str(tmp_path / "offload"),
        ).eval()
        assert "disk" in set(offloaded.hf_device_map.values())
        torch.testing.assert_close(offloaded(x).logits, want, atol=1e-6, rtol=1e-6)
