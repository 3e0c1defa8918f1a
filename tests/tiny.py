"""Tiny random source models and a tiny tokenizer, built offline for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB_WORDS = [f"w{i}" for i in range(120)]


VOCAB_SIZE = 320


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained on `tiny_text()` (byte-level so that every family's tokenizer class,
    e.g. Qwen2Tokenizer, can load it)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(
        [tiny_text()], vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def tiny_text(n_words: int = 4000, seed: int = 0) -> str:
    gen = torch.Generator().manual_seed(seed)
    # a skewed distribution so that statistics are not uniform
    probs = 1.0 / torch.arange(1, len(VOCAB_WORDS) + 1).float()
    idx = torch.multinomial(probs, n_words, replacement=True, generator=gen)
    return " ".join(VOCAB_WORDS[i] for i in idx.tolist())


KINDS = {
    "llama-gqa": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama-mha": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=4),
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
    # Mistral v0.1's sliding window, far shorter than the test sequences
    "mistral-window": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=6),
    # fused qkv_proj and gate_up_proj, GQA, and a sliding window (as Phi-3-mini's 2047 of 4096)
    "phi3": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=2, sliding_window=10, pad_token_id=None),
    # q/k RMS norms over the whole projection (random weights), post-norm blocks
    "olmo2": dict(model_type="olmo2", num_attention_heads=4, num_key_value_heads=2, pad_token_id=None),
    # scaled embeddings, (1+w) norms in sandwich blocks, GeGLU, caps small enough to bite on random weights, a window
    # on the first of each two layers, a softmax scale other than head_dim's, tied embeddings
    "gemma2": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                   attn_logit_softcapping=2.0, final_logit_softcapping=3.0, query_pre_attn_scalar=24,
                   tie_word_embeddings=True, pad_token_id=0),
    # Gemma 1: scaled embeddings, (1+w) norms, GeGLU, pre-norm blocks, tied embeddings
    "gemma": dict(model_type="gemma", num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                  pad_token_id=0),
    # Gemma 3 (text): per-head (1+w) q/k norms, sandwich blocks, a window on the first of each two layers, and a
    # RoPE base per layer type (10000 local, 1e6 global with linear scaling)
    "gemma3_text": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                        layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=24,
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0,
                                                            "factor": 8.0}},
                        tie_word_embeddings=True, pad_token_id=0),
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    # GQA, head_dim 24 != hidden/heads 16, per-head q/k norms (random weights, set in tiny_source)
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=24),
}


def tiny_source(kind: str, folder: Path, seed: int = 0, max_shard_size: str | None = None, **overrides) -> Path:
    """Save a random tiny model of `kind` (see KINDS) with a tokenizer to `folder`; returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(KINDS[kind])
    model_type = spec.pop("model_type")
    params = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    params.update(spec)
    params.update(overrides)
    config = AutoConfig.for_model(model_type, **params)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # large biases, as in Qwen2
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.15)
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    tiny_tokenizer().save_pretrained(folder)
    return folder


def shard_k_and_v_apart(folder: Path) -> None:
    """Rewrite a saved model as two shards with layer 0's k_proj and v_proj in different files."""
    from safetensors.torch import load_file, save_file

    files = sorted(folder.glob("*.safetensors"))
    state = {}
    for f in files:
        state.update(load_file(f))
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    names = sorted(state)
    first = [n for n in names if "layers.0.self_attn.v_proj" not in n and n < "model.layers.1"]
    second = [n for n in names if n not in first]
    assert any("layers.0.self_attn.k_proj" in n for n in first) and any("layers.0.self_attn.v_proj" in n for n in second)
    shards = {"model-00001-of-00002.safetensors": first, "model-00002-of-00002.safetensors": second}
    weight_map = {}
    for fname, keys in shards.items():
        save_file({k: state[k].contiguous() for k in keys}, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
