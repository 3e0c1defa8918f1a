#!/usr/bin/env python
"""Decode speed and KV-cache bytes: the source GQA model against the converted MLA model in each decode form.

Two measurements, every ratio taken within the same run:

1. One attention layer, one decode step (projections, RoPE, cache write, attention, o_proj) over a cache pre-filled
   to the context length, for each form (docs/method.md section 5):
     source    the GQA source layer (LlamaAttention, sdpa), caching K and V per kv head
     CD        converted weights, caching the expanded per-group K/V (what the public converters do)
     CC        cache the latent, expand it to K/V every step (the model's "expanded" mode): the naive path
     A_CC      absorbed; scores against concat([c, k_r]) (copies the cache every step)
     A_CC_ME   absorbed; nope and rope scores taken apart and added (the model's torch decode path)
     triton    A_CC_ME with the Triton kernel (CUDA only)
   The cache is a fixed buffer of context+1 rows; each step overwrites the last row, so every timed step sees the same
   context (as a serving engine's preallocated cache would).
2. The whole model, tokens per second, with transformers' DynamicCache pre-filled to the context length with random
   values (no prefill is timed: decode cost does not depend on the values); then the same over a preallocated
   StaticCache ("static", what `generate(..., cache_implementation="static")` uses) and, on CUDA, that static step
   captured in a CUDA graph ("graph"), each against the source model run the same way (`--skip-static`: neither).

On CUDA it also times the attention core alone at the same shapes (the Triton kernel, the model's torch absorbed path,
the float32 reference, the source's GQA sdpa), as GPU time per call from CUDA-graph replays over rotating input sets,
and reports the achieved bandwidth (cache bytes read per second) against the measured device copy bandwidth.

Weights: `--from-config` (default) builds SmolLM2-135M-shaped models with random weights (timing does not depend on
weight values); `--model DIR` loads a converted folder (the source is `--source` if given, else built from the
converted config with random weights).

The numbers in benchmarks/decode/README.md (a 2-core CPU shared with other jobs, hence one thread and the CPU clock):
    OMP_NUM_THREADS=1 nice python scripts/bench_decode.py --threads 1 --clock cpu --json benchmarks/decode/decode.json
On CUDA (adds the Triton kernel, the attention-core table and its before/after), the numbers in
benchmarks/decode_gpu/README.md (H100):
    python scripts/bench_decode.py --device cuda --contexts 1k,2k,4k,8k,16k,32k,64k --batches 1,8,32 \
        --model-contexts 1k,8k,32k --model-batches 1,8,32 --model-budget 1.5 \
        --kernel-baseline benchmarks/decode_gpu/decode_gpu.before.json \
        --out benchmarks/decode_gpu/README.md --json benchmarks/decode_gpu/decode_gpu.json \
        --plot benchmarks/decode_gpu/decode_gpu.png
The whole-model table alone, with the static-cache forms (benchmarks/decode/decode_static.md, CPU):
    OMP_NUM_THREADS=1 nice python scripts/bench_decode.py --threads 1 --clock cpu --skip-layer \
        --model-contexts 1k,8k --model-batches 1,8 --out benchmarks/decode/decode_static.md \
        --json benchmarks/decode/decode_static.json
The Triton kernel's launch-knob sweep (benchmarks/decode_gpu/decode_gpu.sweep.json, which chose the kernel's defaults):
    python scripts/bench_decode.py --skip-layer --skip-model --skip-kernel \
        --kernel-sweep benchmarks/decode_gpu/decode_gpu.sweep.json \
        --out $TMPDIR/decode_gpu.sweep.md
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import math
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import harness  # noqa: E402  (the CPU's model name)

import mla_convert.modeling  # noqa: E402,F401  (registers model_type "mla")
from mla_convert.evaluate import cache_bytes as measured_cache_bytes  # noqa: E402
from mla_convert.modeling import MLAConfig, MLAForCausalLM  # noqa: E402
from mla_convert.modeling.compat import cache_kwargs  # noqa: E402
from mla_convert.modeling.modeling_mla import MLAAttention, rotate  # noqa: E402

# SmolLM2-135M (HuggingFaceTB/SmolLM2-135M config.json); max_position_embeddings raised so 32K contexts are legal.
SMOLLM2_135M = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, head_dim=64, hidden_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-5,
    tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    bos_token_id=0, eos_token_id=0,
)
MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "rope_pairs", "softmax_scale",
              "o_proj_bias", "mla_attention_mode", "mla_decode_kernel")


# ---------------------------------------------------------------------------------------------- models


def source_config_from(mla_config):
    from transformers import LlamaConfig

    fields = mla_config.to_dict()
    for key in MLA_FIELDS + ("model_type", "architectures", "auto_map", "transformers_version"):
        fields.pop(key, None)
    return LlamaConfig(**fields)


def build_models(args, dtype, device):
    """-> (source LlamaForCausalLM, MLAForCausalLM, description of where the weights came from)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if args.model:
        mla = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)
        if args.source:
            source = AutoModelForCausalLM.from_pretrained(args.source, dtype=dtype,
                                                          **({"gguf_file": args.gguf_file} if args.gguf_file else {}))
            origin = f"converted folder `{args.model}`, source `{args.source}`"
        else:
            source = LlamaForCausalLM(source_config_from(mla.config)).to(dtype)
            origin = f"converted folder `{args.model}`; source built from its config with random weights"
    else:
        src_cfg = LlamaConfig(**SMOLLM2_135M)
        source = LlamaForCausalLM(src_cfg).to(dtype)
        from mla_convert.conversion.plan import ConvertOptions, default_nope_dims

        d_n = args.d_n or default_nope_dims(ConvertOptions(), SMOLLM2_135M["head_dim"], args.d_r, None)
        mla_cfg = MLAConfig(**SMOLLM2_135M, kv_lora_rank=args.d_c, qk_rope_head_dim=args.d_r, qk_nope_head_dim=d_n)
        mla = MLAForCausalLM(mla_cfg).to(dtype)
        origin = (f"`--from-config`: SmolLM2-135M shapes, random weights; MLA d_c={args.d_c}, d_r={args.d_r}, "
                  f"d_n={d_n} (d_c + d_r = {args.d_c + args.d_r} per layer)")
        head_dim, source_elems = src_cfg.head_dim, 2 * src_cfg.num_key_value_heads * src_cfg.head_dim
        if args.d_r == head_dim // 2:  # the converter's default d_r; d_c is the rest of the budget
            origin += (f", the shape `mla-convert llama --kv-budget {(args.d_c + args.d_r) / source_elems:g}` gives "
                       f"SmolLM2-135M (default d_r = head_dim/2 = {args.d_r}, d_c = budget - d_r)")
    for m in (source, mla):
        m.config._attn_implementation = "sdpa"
        m.eval().to(device)
    return source, mla, origin


# ---------------------------------------------------------------------------------------------- one layer


class SlotCache:
    """A fixed cache of `context + 1` rows for one layer: `update` writes the new row at `context` and returns the
    whole buffers, so the step attends over exactly context + 1 positions. Duck-types the two Cache methods the
    attention layers call."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        self.keys, self.values = keys, values  # [B, n, S+1, d_k], [B, n, S+1, d_v]
        self.context = keys.shape[2] - 1

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.keys[:, :, self.context:].copy_(key_states)
        self.values[:, :, self.context:].copy_(value_states)
        return self.keys, self.values

    def get_seq_length(self, layer_idx=0):
        return self.context


def _attention_interface(config):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, eager_attention_forward)


def _mla_projections(attn: MLAAttention, hidden, position_embeddings):
    """q_nope [B, H, 1, d_n], rotated q_rope [B, H, 1, d_r], latent [B, 1, 1, d_c], rotated k_rope [B, 1, 1, d_r]."""
    bsz = hidden.shape[0]
    d_n, d_r, d_c = attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.kv_lora_rank
    q = attn.q_proj(hidden).view(bsz, 1, attn.num_heads, d_n + d_r).transpose(1, 2)
    q_nope, q_rope = q.split([d_n, d_r], dim=-1)
    latent, k_rope = attn.kv_a_proj(hidden).split([d_c, d_r], dim=-1)
    latent, k_rope = latent.unsqueeze(1), k_rope.unsqueeze(1)
    cos, sin = attn._rope_cos_sin(position_embeddings)
    return q_nope, rotate(q_rope, cos, sin), latent, rotate(k_rope, cos, sin)


def cd_step(attn: MLAAttention, cache: SlotCache, hidden, position_embeddings):
    """CD: converted weights, the expanded per-group K [B, G, S, d_n+d_r] and V [B, G, S, d_v] cached."""
    bsz = hidden.shape[0]
    groups, d_n, d_v = attn.groups, attn.qk_nope_head_dim, attn.v_head_dim
    q_nope, q_rope, latent, k_rope = _mla_projections(attn, hidden, position_embeddings)
    kv = attn.kv_b_proj(latent[:, 0]).view(bsz, 1, groups, d_n + d_v).transpose(1, 2)  # [B, G, 1, d_n+d_v]
    k_nope, value = kv.split([d_n, d_v], dim=-1)
    key = torch.cat((k_nope, k_rope.expand(-1, groups, -1, -1)), dim=-1)  # [B, G, 1, d_n+d_r]
    key, value = cache.update(key, value, attn.layer_idx)
    out, _ = _attention_interface(attn.config)(attn, torch.cat((q_nope, q_rope), dim=-1), key, value, None,
                                               dropout=0.0, scaling=attn.scaling)  # [B, 1, H, d_v]
    return attn.o_proj(out.reshape(bsz, 1, -1))


def a_cc_step(attn: MLAAttention, cache: SlotCache, hidden, position_embeddings):
    """A_CC: absorbed, with the query and the cached key concatenated ([q_latent, q_rope] . [c, k_r]): one score
    matmul, but the cache is copied into a concatenated key every step."""
    bsz, heads, d_c = hidden.shape[0], attn.num_heads, attn.kv_lora_rank
    groups, per_group = attn.groups, attn.per_group
    q_nope, q_rope, latent, k_rope = _mla_projections(attn, hidden, position_embeddings)
    latent, k_rope = cache.update(latent, k_rope, attn.layer_idx)  # [B, 1, S, d_c], [B, 1, S, d_r]
    w_uk, w_uv = attn.absorbed_weights()
    q_latent = torch.einsum("bgrn,gnc->bgrc", q_nope.view(bsz, groups, per_group, -1), w_uk).reshape(bsz, heads, d_c)
    query = torch.cat((q_latent, q_rope[:, :, 0]), dim=-1)  # [B, H, d_c+d_r]
    key = torch.cat((latent[:, 0], k_rope[:, 0]), dim=-1)  # [B, S, d_c+d_r]: the per-step copy
    probs = torch.softmax(torch.bmm(query, key.transpose(1, 2)).float() * attn.scaling, dim=-1).to(latent.dtype)
    out_latent = torch.bmm(probs, latent[:, 0])  # [B, H, d_c]
    out = torch.einsum("bgrc,gvc->bgrv", out_latent.view(bsz, groups, per_group, d_c), w_uv)
    return attn.o_proj(out.reshape(bsz, 1, -1))


def module_step(attn, cache, hidden, position_embeddings):
    return attn(hidden, position_embeddings=position_embeddings, attention_mask=None, **cache_kwargs(cache))[0]


def layer_variants(source, mla, device):
    """name -> (attention module, cache layout, step function). Cache layouts: (heads, key dim, value dim)."""
    import copy

    src_attn = source.model.layers[0].self_attn
    cfg = source.config
    src_layout = (cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
    attn = mla.model.layers[0].self_attn
    groups, d_n, d_r, d_v, d_c = (attn.groups, attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim,
                                  attn.kv_lora_rank)

    def with_config(**changes):
        clone = copy.copy(attn)  # shares the weights; its own config
        clone.config = copy.copy(attn.config)
        for key, value in changes.items():
            setattr(clone.config, key, value)
        return clone

    variants = {
        "source": (src_attn, src_layout, module_step),
        "CD": (attn, (groups, d_n + d_r, d_v), cd_step),
        "CC": (with_config(mla_attention_mode="expanded"), (1, d_c, d_r), module_step),
        "A_CC": (attn, (1, d_c, d_r), a_cc_step),
        "A_CC_ME": (with_config(mla_attention_mode="auto", mla_decode_kernel="torch"), (1, d_c, d_r), module_step),
    }
    if device.type == "cuda":
        from mla_convert.kernels import triton_available

        if triton_available():
            variants["triton"] = (with_config(mla_attention_mode="auto", mla_decode_kernel="auto"), (1, d_c, d_r),
                                  module_step)
    return variants


def cache_bytes(layout, context, batch, element_size):
    heads, d_k, d_v = layout
    return batch * context * heads * (d_k + d_v) * element_size


# ---------------------------------------------------------------------------------------------- timing


# The step clock: wall time by default; with `--clock cpu`, the CPU time of this (only) thread, which leaves out the
# time the scheduler gives to other jobs on a shared machine (memory stalls still count: they happen on the CPU).
_CLOCK = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter


def now() -> float:
    return _clock()


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_samples(fn, device, reps: int) -> list[float]:
    """Seconds of each of `reps` calls (no warm-up)."""
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = now()
            fn()
            times.append(now() - t0)
    return times


def time_fn(fn, device, reps: int, warmup: int = 2) -> float:
    """Median seconds of `reps` calls after `warmup` calls."""
    for _ in range(warmup):
        fn()
    sync(device)
    return statistics.median(time_samples(fn, device, reps))


def reps_for(seconds_guess: float, budget: float, lo: int = 3, hi: int = 50) -> int:
    return int(max(lo, min(hi, budget / max(seconds_guess, 1e-6))))


def copy_bandwidth(device, dtype) -> float:
    """Device copy bandwidth in bytes/s (read + write), from copying a 512 MiB (CPU: 256 MiB) buffer."""
    n = (512 if device.type == "cuda" else 256) * 2**20 // torch.tensor([], dtype=dtype).element_size()
    src = torch.empty(n, dtype=dtype, device=device).normal_()
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device, reps=10)
    bw = 2 * src.numel() * src.element_size() / seconds
    del src, dst
    return bw


@torch.no_grad()
def bench_layers(source, mla, args, device, dtype, log):
    variants = layer_variants(source, mla, device)
    rotary = mla.model.rotary_emb
    hidden_size = mla.config.hidden_size
    esize = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for batch in args.batches:
        for context in args.contexts:
            gen = torch.Generator(device="cpu").manual_seed(context + batch)
            hidden = torch.randn(batch, 1, hidden_size, generator=gen).to(device=device, dtype=dtype)
            position_ids = torch.full((batch, 1), context, device=device)
            pos = rotary(hidden, position_ids=position_ids)
            row = {"batch": batch, "context": context, "ms": {}, "kv_bytes": {}}
            # Every form's cache is built first, then the forms are timed in interleaved rounds, so that a burst of
            # load from other jobs on a shared machine hits all forms alike; each form's time is its median step.
            steps, reps, samples = {}, {}, {}
            for name, (attn, layout, step) in variants.items():
                heads, d_k, d_v = layout
                keys = torch.randn(batch, heads, context + 1, d_k, device=device, dtype=dtype)
                values = torch.randn(batch, heads, context + 1, d_v, device=device, dtype=dtype)
                cache = SlotCache(keys, values)
                steps[name] = functools.partial(step, attn, cache, hidden, pos)
                row["kv_bytes"][name] = cache_bytes(layout, context, batch, esize)
                for _ in range(2):  # warm-up; the second call's time guides the number of repeats
                    t0 = now()
                    steps[name]()
                    sync(device)
                guess = now() - t0
                reps[name] = max(1, reps_for(guess, args.layer_budget) // args.rounds)
                samples[name] = []
            for _ in range(args.rounds):
                for name, fn in steps.items():
                    samples[name] += time_samples(fn, device, reps[name])
            for name in steps:
                row["ms"][name] = statistics.median(samples[name]) * 1e3
            del steps
            gc.collect()
            log(f"layer  B={batch:<3d} ctx={context:<6d} " + "  ".join(f"{k} {v:8.3f} ms" for k, v in row["ms"].items()))
            if device.type == "cuda" and not args.no_graph:
                row["graph_ms"] = graph_layer_times(variants, row, hidden, pos, batch, context, device, dtype, log)
                log(f"graph  B={batch:<3d} ctx={context:<6d} " + "  ".join(
                    f"{k} {v:8.3f} ms" for k, v in row["graph_ms"].items() if v is not None))
            rows.append(row)
    return rows


def graph_layer_times(variants, row, hidden, pos, batch, context, device, dtype, log) -> dict:
    """CUDA: GPU ms per layer step of each form, from CUDA-graph replays (launch gaps and Python left out, as a
    serving engine that captures its decode step sees it). Each form steps over several caches in turn (together at
    least 256 MiB, at most 64), so a cache is cold in L2 when its turn comes."""
    out = {}
    for name, (attn, layout, step) in variants.items():
        heads, d_k, d_v = layout
        n_sets = input_sets(row["kv_bytes"][name], most=64)
        try:
            calls = [functools.partial(step, attn, SlotCache(
                torch.randn(batch, heads, context + 1, d_k, device=device, dtype=dtype),
                torch.randn(batch, heads, context + 1, d_v, device=device, dtype=dtype)), hidden, pos)
                for _ in range(n_sets)]
            out[name] = graph_seconds(calls, device) * 1e3
        except RuntimeError as err:  # a form that cannot be captured is reported as such, not timed another way
            log(f"graph  {name} B={batch} ctx={context}: not captured: {str(err).splitlines()[0][:160]}")
            out[name] = None
        calls = None
        gc.collect()
        torch.cuda.empty_cache()
    return out


@torch.no_grad()
def prefilled_cache(model, batch, context, device, dtype):
    """A DynamicCache holding `context` random rows per layer, in the model's own cache layout."""
    from transformers.cache_utils import DynamicCache

    cfg = model.config
    cache = DynamicCache(config=cfg)
    for i in range(cfg.num_hidden_layers):
        if cfg.model_type == "mla":
            shapes = ((batch, 1, context, cfg.kv_lora_ranks[i]), (batch, 1, context, cfg.qk_rope_head_dim))
        else:
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            shapes = ((batch, cfg.num_key_value_heads, context, head_dim),) * 2
        cache.update(torch.randn(*shapes[0], device=device, dtype=dtype),
                     torch.randn(*shapes[1], device=device, dtype=dtype), i)
    return cache


@torch.no_grad()
def prefilled_static_cache(model, batch, context, device, dtype):
    """A preallocated StaticCache of `context + 1` rows per layer, the first `context` random and counted as
    written: a step writes row `context`, and `rewind` sets the counters back so every step sees the same context."""
    from transformers import StaticCache

    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=context + 1)
    for i, layer in enumerate(cache.layers):
        if cfg.model_type == "mla":
            shapes = ((batch, 1, 1, cfg.kv_lora_ranks[i]), (batch, 1, 1, cfg.qk_rope_head_dim))
        else:
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            shapes = ((batch, cfg.num_key_value_heads, 1, head_dim),) * 2
        layer.lazy_initialization(torch.empty(*shapes[0], device=device, dtype=dtype),
                                  torch.empty(*shapes[1], device=device, dtype=dtype))
        layer.keys.normal_()
        layer.values.normal_()
        layer.cumulative_length.fill_(context)
    return cache


def rewind(cache, context: int):
    for layer in cache.layers:
        layer.cumulative_length.fill_(context)  # in place: a captured step keeps its addresses


def cache_tensor_bytes(cache, context: int | None = None) -> int:
    """Bytes of the cache tensors; for a static cache, of its first `context` rows (what the sequence holds)."""
    total = measured_cache_bytes(cache)
    if context is not None:
        total = total * context // cache.layers[0].keys.shape[2]
    return total


def count_kernel_calls(fn) -> int:
    """How many times one call of `fn` runs the Triton decode kernel."""
    import mla_convert.kernels.triton_mla as triton_mla

    original, calls = triton_mla.mla_decode_triton, []

    def counting(*a, **k):
        calls.append(1)
        return original(*a, **k)

    triton_mla.mla_decode_triton = counting
    try:
        fn()
    finally:
        triton_mla.mla_decode_triton = original
    return len(calls)


@torch.no_grad()
def bench_models(source, mla, args, device, dtype, log):
    # (name, model, decode options set on the MLA config for the run; the layers share that config object)
    forms = [("source", source, {}),
             ("MLA CC", mla, {"mla_attention_mode": "expanded"}),
             ("MLA A_CC_ME", mla, {"mla_attention_mode": "auto", "mla_decode_kernel": "torch"})]
    if device.type == "cuda":
        forms.append(("MLA triton", mla, {"mla_attention_mode": "auto", "mla_decode_kernel": "auto"}))
    # Preallocated caches (transformers' StaticCache: the MLA model's holds latent + rope key), and on CUDA the same
    # step captured in a CUDA graph (no host work per step): names ending in "static" / "graph".
    if not args.skip_static:
        forms.append(("source static", source, {}))
        forms.append(("MLA static", mla, {"mla_attention_mode": "auto", "mla_decode_kernel": "auto"}))
        if device.type == "cuda":
            forms.append(("source graph", source, {}))
            forms.append(("MLA graph", mla, {"mla_attention_mode": "auto", "mla_decode_kernel": "auto"}))
    rows = []
    for batch in args.model_batches:
        for context in args.model_contexts:
            row = {"batch": batch, "context": context, "tok_s": {}, "kv_bytes": {}}
            for name, model, options in forms:
                saved = {k: getattr(model.config, k) for k in options}
                for key, value in options.items():
                    setattr(model.config, key, value)
                tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
                static = name.endswith(("static", "graph"))
                if static:
                    cache = prefilled_static_cache(model, batch, context, device, dtype)
                    row["kv_bytes"][name] = cache_tensor_bytes(cache, context)
                    positions = torch.full((batch, 1), context, dtype=torch.long, device=device)

                    def step():
                        model(tokens, position_ids=positions, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
                        rewind(cache, context)

                    if name.endswith("graph"):
                        try:
                            step = captured(step, device)
                        except Exception as e:  # noqa: BLE001  (reported, the other forms still run)
                            log(f"model  B={batch} ctx={context} {name}: capture failed: {type(e).__name__}: {e}")
                            row.setdefault("capture_errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
                            row["tok_s"][name] = float("nan")
                            for key, value in saved.items():
                                setattr(model.config, key, value)
                            continue
                else:
                    cache = prefilled_cache(model, batch, context, device, dtype)
                    row["kv_bytes"][name] = cache_tensor_bytes(cache)

                    def step():
                        model(tokens, **cache_kwargs(cache), use_cache=True, logits_to_keep=1)
                        cache.crop(-1)  # drop the appended row: every timed step sees the same context

                calls = count_kernel_calls(step) if name in ("MLA triton", "MLA static") and device.type == "cuda" \
                    else None
                if calls is not None:
                    row["triton_calls_per_step"] = calls  # the kernel ran in every layer (checked, not assumed)
                t0 = now()
                step()
                sync(device)
                guess = now() - t0
                seconds = time_fn(step, device, reps=reps_for(guess, args.model_budget, lo=3, hi=20), warmup=1)
                row["tok_s"][name] = batch / seconds
                for key, value in saved.items():
                    setattr(model.config, key, value)
                del cache
                gc.collect()
            rows.append(row)
            log(f"model  B={batch:<3d} ctx={context:<6d} " + rates(row))
    return rows


def rates(row) -> str:
    return "  ".join(f"{k} {v:9.1f} tok/s" for k, v in row["tok_s"].items())


@torch.no_grad()
def bench_generate(source, mla, args, device, log):
    """`model.generate` as a transformers user runs it, source and MLA, greedy, exactly `new` tokens after a random
    prompt: the default cache (DynamicCache, eager) and `cache_implementation="static"` (on CUDA transformers then
    compiles the decode step, mode reduce-overhead: CUDA graphs). Each run gets one preallocated StaticCache of
    prompt + the most new tokens (reset between runs), so runs of different lengths share the compiled graphs; the
    decode rate is batch x (long - short) / (time long - time short), which leaves out the prefill."""
    from transformers import StaticCache

    short, long = max(1, args.generate_new // 8), args.generate_new
    mla.config.mla_attention_mode, mla.config.mla_decode_kernel = "auto", "auto"  # the decode path users get
    rows = []
    for batch in args.generate_batches:
        ids = torch.randint(0, source.config.vocab_size, (batch, args.generate_prompt), device=device,
                            generator=torch.Generator(device).manual_seed(batch))
        row = {"batch": batch, "prompt": args.generate_prompt, "new": [short, long], "tok_s": {}, "seconds": {},
               "first_call_s": {}}
        for name, model, static in (("source", source, False), ("MLA", mla, False),
                                    ("source static", source, True), ("MLA static", mla, True)):
            cache = StaticCache(config=model.config, max_cache_len=args.generate_prompt + long) if static else None

            def run(new):
                options = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)
                if cache is not None:
                    cache.reset()
                    options.update(cache_kwargs(cache))
                sync(device)
                t0 = now()
                out = model.generate(ids, **options)
                sync(device)
                assert out.shape == (batch, args.generate_prompt + new), out.shape
                return now() - t0

            try:
                row["first_call_s"][name] = run(long)  # compiles the static step on CUDA
                run(short)
                times = {n: statistics.median(run(n) for _ in range(3)) for n in (short, long)}
            except Exception as e:  # noqa: BLE001  (reported, the other forms still run)
                log(f"generate B={batch} {name}: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                row.setdefault("errors", {})[name] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            row["seconds"][name] = times
            row["tok_s"][name] = batch * (long - short) / max(times[long] - times[short], 1e-9)
        rows.append(row)
        log(f"generate B={batch:<3d} prompt={args.generate_prompt} " + rates(row))
    return rows


def captured(step, device):
    """`step` captured in a CUDA graph (warm-up on a side stream first): returns the graph's replay."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream(device).wait_stream(stream)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def graph_seconds(calls, device, reps: int = 20) -> float:
    """Median GPU seconds per call: one CUDA graph runs every call of `calls` once (each on its own input set, so a
    set is cold in L2 when its turn comes), and the graph's replays are timed with events."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):  # warm-up outside the capture: compilation, autotuning, workspace allocation
        for call in calls:
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    sync(device)
    seconds = statistics.median(time_samples(graph.replay, device, reps)) / len(calls)
    del graph
    return seconds


def input_sets(set_bytes: int, target: int = 256 * 2**20, most: int = 256) -> int:
    """How many input sets to rotate through so that together they are several times the L2 cache (50 MB on H100)."""
    return max(2, min(most, math.ceil(target / max(set_bytes, 1))))


def kernel_inputs(batch, context, heads, d_c, d_r, n_kv, d_h, dtype, device, seed):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device=device, dtype=dtype, generator=gen)

    return {"q_latent": rand(batch, heads, d_c), "q_rope": rand(batch, heads, d_r), "latent": rand(batch, context, d_c),
            "k_rope": rand(batch, context, d_r), "q": rand(batch, heads, 1, d_h), "k": rand(batch, n_kv, context, d_h),
            "v": rand(batch, n_kv, context, d_h)}


def kernel_shapes(mla):
    attn = mla.model.layers[0].self_attn
    src = source_config_from(mla.config)
    return attn.num_heads, attn.kv_lora_rank, attn.qk_rope_head_dim, src.num_key_value_heads, src.head_dim, attn.scaling


@torch.no_grad()
def bench_kernel(mla, args, device, dtype, copy_bw, log):
    """CUDA only: the attention core alone, at the same shapes, each timed as GPU time per call (CUDA graph replays
    over rotating input sets, cold L2): the Triton kernel; the model's torch absorbed path (`latent_attention`, the
    A_CC_ME core: rope scores as an sdpa bias); the float32 torch reference; the source's GQA sdpa (default dispatch,
    and the flash backend forced). Also the Triton kernel called eagerly (one call, Python launch cost included)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from mla_convert.kernels import mla_decode, mla_decode_reference
    from mla_convert.modeling.modeling_mla import latent_attention

    heads, d_c, d_r, n_kv, d_h, scale = kernel_shapes(mla)
    esize = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for batch in args.kernel_batches:
        for context in args.kernel_contexts:
            mla_bytes = batch * context * (d_c + d_r) * esize
            src_bytes = batch * context * 2 * n_kv * d_h * esize
            n_sets = input_sets(src_bytes)
            sets = [kernel_inputs(batch, context, heads, d_c, d_r, n_kv, d_h, dtype, device, seed)
                    for seed in range(n_sets)]
            lengths = torch.full((batch,), context, dtype=torch.int32, device=device)

            def forms(x):
                def flash():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return sdpa(x["q"], x["k"], x["v"], enable_gqa=True)

                return {
                    "triton": lambda: mla_decode(x["q_latent"], x["q_rope"], x["latent"], x["k_rope"], lengths, scale,
                                                 backend="triton"),
                    "torch_absorbed": lambda: latent_attention(x["q_latent"][:, :, None], x["q_rope"][:, :, None],
                                                               x["latent"][:, None], x["k_rope"][:, None], None, scale),
                    "reference": lambda: mla_decode_reference(x["q_latent"], x["q_rope"], x["latent"], x["k_rope"],
                                                              lengths, scale),
                    "sdpa": lambda: sdpa(x["q"], x["k"], x["v"], enable_gqa=True),
                    "sdpa_flash": flash,
                }

            per_set = [forms(x) for x in sets]
            us = {}
            for name in per_set[0]:
                try:
                    us[name] = graph_seconds([f[name] for f in per_set], device) * 1e6
                except RuntimeError as err:  # e.g. no flash kernel for these inputs
                    log(f"kernel {name} B={batch} ctx={context}: {str(err).splitlines()[0]}")
                    us[name] = None
            x = sets[0]
            us["triton_eager"] = time_fn(per_set[0]["triton"], device, reps=50, warmup=5) * 1e6
            # The kernel's output against the float32 reference, on this run's inputs.
            got = per_set[0]["triton"]().float()
            want = mla_decode_reference(x["q_latent"].float(), x["q_rope"].float(), x["latent"].float(),
                                        x["k_rope"].float(), lengths, scale)
            rel_err = float((got - want).norm() / want.norm())
            row = {"batch": batch, "context": context, "us": us, "mla_bytes": mla_bytes, "src_bytes": src_bytes,
                   "input_sets": n_sets, "triton_rel_err": rel_err, "copy_bw": copy_bw,
                   "triton_bw": mla_bytes / (us["triton"] / 1e6),
                   "torch_absorbed_bw": mla_bytes / (us["torch_absorbed"] / 1e6),
                   "sdpa_bw": src_bytes / (us["sdpa"] / 1e6)}
            rows.append(row)
            log(f"kernel B={batch:<3d} ctx={context:<6d} " +
                "  ".join(f"{k} {v:8.1f} us" for k, v in us.items() if v is not None) +
                f"  triton {row['triton_bw'] / 1e9:.0f} GB/s ({row['triton_bw'] / copy_bw:.0%} of copy), "
                f"rel err {rel_err:.1e}")
            del sets, per_set
            gc.collect()
            torch.cuda.empty_cache()
    return rows


SWEEP_SHAPES = [(1, 8192), (1, 32768), (8, 8192), (8, 32768), (32, 32768), (32, 65536)]


def sweep_variants(d_c: int = 64):
    """The launch variants the sweep times, the kernel's defaults first ({}). A latent wider than 64 gets its own
    set (benchmarks/decode_gpu/decode_gpu.sweep144.json, d_c 144): row blocks 32-128, 4 or 8 warps, 2 or 3 stages, two
    split
    rules (that run also timed the latent read as two tiles, 128 + 16, an experiment since removed: 11% slower)."""
    if d_c > 64:
        block_ns, stages, rules = (32, 64, 128), (2, 3), ((2, 256, 2048, 64), (4, 128, None, 128))
    else:
        block_ns, stages = (64, 128, 256), (2, 3, 4)
        rules = ((2, 256, None, 64), (2, 256, 2048, 64), (4, 128, None, 128), (8, 64, None, 256))
    return [{}] + [dict(block_n=block_n, num_warps=num_warps, num_stages=num_stages, programs_per_sm=ppsm,
                        min_split_rows=min_rows, max_split_rows=max_rows, max_splits=most)
                   for block_n in block_ns for num_warps in (4, 8) for num_stages in stages
                   for ppsm, min_rows, max_rows, most in rules]


@torch.no_grad()
def kernel_sweep(mla, device, dtype, copy_bw, log):
    """CUDA only: the Triton kernel's launch knobs (row block, warps, pipeline stages, split heuristic) over a few
    shapes, GPU time per call as in `bench_kernel`; each variant's output is checked against the reference."""
    from mla_convert.kernels import mla_decode_reference
    from mla_convert.kernels.triton_mla import launch_config, mla_decode_triton

    heads, d_c, d_r, n_kv, d_h, scale = kernel_shapes(mla)
    esize = torch.tensor([], dtype=dtype).element_size()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows = []
    variants = sweep_variants(d_c)
    for batch, context in SWEEP_SHAPES:
        mla_bytes = batch * context * (d_c + d_r) * esize
        n_sets = input_sets(mla_bytes)
        sets = [kernel_inputs(batch, context, heads, d_c, d_r, 1, 16, dtype, device, seed) for seed in range(n_sets)]
        lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
        x = sets[0]
        want = mla_decode_reference(x["q_latent"].float(), x["q_rope"].float(), x["latent"].float(),
                                    x["k_rope"].float(), lengths, scale)
        for tune in variants:
            cfg = launch_config(batch, heads, context, d_c, d_r, sms, **tune)
            row = {"batch": batch, "context": context, "tune": tune, "num_splits": cfg["num_splits"]}
            try:
                got = mla_decode_triton(x["q_latent"], x["q_rope"], x["latent"], x["k_rope"], lengths, scale,
                                        tune=tune).float()
                row["rel_err"] = float((got - want).norm() / want.norm())
                seconds = graph_seconds([functools.partial(mla_decode_triton, y["q_latent"], y["q_rope"], y["latent"],
                                                           y["k_rope"], lengths, scale, tune=tune) for y in sets],
                                        device)
                row["us"] = seconds * 1e6
                row["bw"] = mla_bytes / seconds
            except Exception as err:  # noqa: BLE001 - e.g. out of shared memory for a large block and many stages
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
            rows.append(row)
        ok = [r for r in rows if r["batch"] == batch and r["context"] == context and "us" in r]
        best = min(ok, key=lambda r: r["us"])
        default = ok[0]  # the {} variant: launch_config's defaults
        log(f"sweep  B={batch:<3d} ctx={context:<6d} default {default['us']:7.1f} us "
            f"({default['bw'] / 1e9:5.0f} GB/s)  best {best['us']:7.1f} us ({best['bw'] / 1e9:5.0f} GB/s, "
            f"{best['bw'] / copy_bw:.0%} of copy) {best['tune']} splits {best['num_splits']}; "
            f"max rel err {max(r['rel_err'] for r in ok):.1e}; {len(ok)}/{len(variants)} ran")
        del sets
        gc.collect()
        torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------- report


def cpu_name() -> str:
    """The CPU model (from /proc/cpuinfo on Linux) and the number of cores this process may use."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{harness.cpu_name()}, {cores} cores"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def ctx_label(context: int) -> str:
    return f"{context // 1024}K" if context % 1024 == 0 else str(context)


def write_report(path: Path, args, meta, layer_rows, model_rows, kernel_rows, plot_path, generate_rows=()):
    names = list(layer_rows[0]["ms"]) if layer_rows else []
    lines = [
        "# Decode speed and KV-cache size: source GQA vs converted MLA",
        "",
        f"Written by `scripts/bench_decode.py` on {meta['date']}. Command (from the repository root):",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"- Device: {meta['device']}; dtype {meta['dtype']}; torch {meta['torch']}, threads {meta['threads']}.",
        f"- Weights: {meta['origin']}. Decode timing does not depend on weight values.",
        f"- Shapes: hidden {meta['hidden']}, {meta['heads']} query heads, {meta['kv_heads']} kv heads, head_dim "
        f"{meta['head_dim']}, {meta['layers']} layers. Cache per token per layer: source {meta['src_elems']} values "
        f"(2 x {meta['kv_heads']} x {meta['head_dim']}), MLA {meta['mla_elems']} (d_c {meta['d_c']} + d_r "
        f"{meta['d_r']}), {meta['mla_elems'] / meta['src_elems']:.0%} of the source; CD caches "
        f"{meta['cd_elems']}.",
        f"- Timings are medians over repeated steps, "
        + ("in CPU time of the benchmark's one thread (`--clock cpu`: time the scheduler gave to other jobs is left "
           "out; memory stalls count)" if meta["clock"] == "cpu" else "in wall-clock time")
        + "; ratios are taken within this run. "
        f"Measured copy bandwidth: {meta['copy_bw'] / 1e9:.1f} GB/s (read + write).",
        *load_note(meta),
        "",
        "Decode forms (docs/method.md section 5): **CD** caches the expanded per-group K/V; **CC** caches the latent and "
        "expands it every step (the model's `expanded` mode, the naive path); **A_CC** absorbed, scores against a "
        "per-step concatenation `[c, k_r]`; **A_CC_ME** absorbed, nope and rope scores apart (the model's decode "
        "path: `mla_decode_kernel=torch`); **triton** A_CC_ME with the Triton kernel (CUDA only).",
        "",
    ]
    if layer_rows:
        lines += [
            "## One attention layer, one decode step",
            "",
            "Projections + RoPE + cache write + attention + o_proj over a pre-filled cache of `context` rows "
            "(fixed buffer, so every step sees the same context). Time per step in ms; in brackets the speedup over "
            "the source layer (source time / form time).",
            "",
            "| batch | context | " + " | ".join(names) + " | KV bytes source | KV bytes MLA |",
            "|---:|---:|" + "---:|" * len(names) + "---:|---:|",
        ]
        for row in layer_rows:
            src = row["ms"]["source"]
            cells = [f"{row['ms'][n]:.2f}" + ("" if n == "source" else f" ({src / row['ms'][n]:.2f}x)") for n in names]
            lines.append(f"| {row['batch']} | {ctx_label(row['context'])} | " + " | ".join(cells) +
                         f" | {fmt_bytes(row['kv_bytes']['source'])} | {fmt_bytes(row['kv_bytes']['A_CC_ME'])} |")
        lines += [""]
        lines += ["Cache bytes read per second by each form (its cache bytes / step time):", "",
                  "| batch | context | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
        for row in layer_rows:
            lines.append(f"| {row['batch']} | {ctx_label(row['context'])} | " +
                         " | ".join(f"{row['kv_bytes'][n] / (row['ms'][n] / 1e3) / 1e9:.1f} GB/s" for n in names) + " |")
        lines.append("")
        if any(r.get("graph_ms") for r in layer_rows):
            lines += [
                "### The same step as GPU time (CUDA graph replay)",
                "",
                "The step above is timed eagerly: on a GPU, with this small model, its time is mostly the host "
                "issuing ~10-20 kernels from Python, so the forms differ little until the cache is large. Here each "
                "form's step is captured in a CUDA graph over several caches in turn (together at least 256 MiB, so a "
                "cache is cold in L2 when its turn comes) and the replays are timed with CUDA events: GPU time per "
                "step, as an engine that captures its decode step sees it. ms per step; in brackets the speedup over "
                "the source.",
                "",
                "| batch | context | " + " | ".join(names) + " |",
                "|---:|---:|" + "---:|" * len(names),
            ]
            for row in layer_rows:
                g = row.get("graph_ms") or {}
                src = g.get("source")
                cells = [("n/a" if g.get(n) is None else f"{g[n]:.3f}" +
                          ("" if n == "source" or not src else f" ({src / g[n]:.2f}x)")) for n in names]
                lines.append(f"| {row['batch']} | {ctx_label(row['context'])} | " + " | ".join(cells) + " |")
            lines += ["", f"![layer decode step GPU time]({plot_path.name})", ""]
        else:
            lines += [f"![layer decode step time]({plot_path.name})", ""]
    if model_rows:
        mnames = list(model_rows[0]["tok_s"])
        lines += [
            "## Whole model, tokens per second",
            "",
            "One decode step of the whole model (all layers, lm_head) with transformers' `DynamicCache` pre-filled "
            "to `context` tokens (each step appends one row, which DynamicCache does by concatenation, then the "
            "cache is cropped back). *static*: the same step over a preallocated `StaticCache` of context + 1 rows "
            "(the MLA model's holds latent + rope key; the step writes one row in place, and on CPU reads only the "
            "written rows; the counters are set back after each step). *graph* (CUDA): the static step captured in "
            "a CUDA graph and replayed, no host work per step. Tokens/s = batch / step time; in brackets the ratio "
            "to the source model run the same way (DynamicCache, static or graph).",
            "",
            "| batch | context | " + " | ".join(mnames) + " | cache source | cache MLA |",
            "|---:|---:|" + "---:|" * len(mnames) + "---:|---:|",
        ]
        def baseline(name):  # each MLA form against the source run the same way
            for kind in ("static", "graph"):
                if name.endswith(kind):
                    return f"source {kind}"
            return "source"

        for row in model_rows:
            cells = [f"{row['tok_s'][n]:.1f}" + ("" if n.startswith("source") else
                                                 f" ({row['tok_s'][n] / row['tok_s'][baseline(n)]:.2f}x)")
                     for n in mnames]
            lines.append(f"| {row['batch']} | {ctx_label(row['context'])} | " + " | ".join(cells) +
                         f" | {fmt_bytes(row['kv_bytes']['source'])} | {fmt_bytes(row['kv_bytes']['MLA A_CC_ME'])} |")
        lines.append("")
        errors = {k: v for row in model_rows for k, v in row.get("capture_errors", {}).items()}
        for name, error in errors.items():
            lines += [f"{name}: CUDA-graph capture failed ({error}); its column reads nan.", ""]
    if generate_rows:
        lines += generate_section(generate_rows)
    if kernel_rows:
        lines += kernel_section(kernel_rows, meta)
    if model_rows and "triton_calls_per_step" in model_rows[0]:
        lines += [f"Whole model, MLA triton: the Triton kernel ran {model_rows[0]['triton_calls_per_step']} times per "
                  f"decode step ({meta['layers']} layers), counted by wrapping it for one step.", ""]
    lines += decode_path_targets(model_rows, kernel_rows)
    lines += targets_section(layer_rows, model_rows)
    path.write_text("\n".join(lines) + "\n")


def generate_section(rows) -> list[str]:
    r0 = rows[0]
    short, long = r0["new"]
    names = [n for n in ("source", "MLA", "source static", "MLA static") if any(n in r["tok_s"] for r in rows)]
    lines = ["## Through `generate`, as a transformers user runs it", "",
             f"`model.generate(ids, max_new_tokens=N)`, greedy, a random prompt of {r0['prompt']} tokens, exactly N new "
             "tokens. Default cache (DynamicCache, eager), and `cache_implementation=\"static\"` (one preallocated "
             "StaticCache passed in, reset between runs): on CUDA transformers then compiles the decode step "
             "(`torch.compile`, mode reduce-overhead, i.e. CUDA graphs). Decode tokens/s = batch x "
             f"({long} - {short}) / (time of {long} new tokens - time of {short}), medians of 3 runs after a first "
             "call (which compiles); the prefill cancels out. In brackets the ratio to the source run the same way.",
             "", "| batch | " + " | ".join(names) + " | first call (s): " + ", ".join(names) + " |",
             "|---:|" + "---:|" * len(names) + "---|"]
    for r in rows:
        cells = []
        for n in names:
            v = r["tok_s"].get(n)
            base = r["tok_s"].get("source static" if n.endswith("static") else "source")
            cells.append("failed" if v is None else f"{v:.1f}" + ("" if n.startswith("source") or not base
                                                                   else f" ({v / base:.2f}x)"))
        first = ", ".join(f"{r['first_call_s'][n]:.1f}" if n in r["first_call_s"] else "-" for n in names)
        lines.append(f"| {r['batch']} | " + " | ".join(cells) + f" | {first} |")
    lines.append("")
    for r in rows:
        for name, error in r.get("errors", {}).items():
            lines += [f"B={r['batch']} {name}: failed ({error}).", ""]
    return lines


def decode_path_targets(model_rows, kernel_rows) -> list[str]:
    """Issue 13's GPU lines, checked on this run: the decode path as an engine runs it (the static-cache step
    captured in a CUDA graph) against the source run the same way; at the largest batch and context, the speedup
    against the cache byte ratio and the kernel's share of copy bandwidth."""
    rows = [r for r in model_rows if r["tok_s"].get("MLA graph") and r["tok_s"].get("source graph")]
    if not rows:
        return []
    out = ["## Targets (issue 13), checked on the whole model (CUDA graph) and the kernel table above", ""]
    ratio = {(r["batch"], r["context"]): r["tok_s"]["MLA graph"] / r["tok_s"]["source graph"] for r in rows}
    slower = [f"B={b} {ctx_label(c)}" for (b, c), x in ratio.items() if x < 1]
    out.append(f"- Whole-model decode, MLA graph tokens/s at least the source graph's at every measured point "
               f"({len(ratio)}: batches {sorted({b for b, _ in ratio})}, contexts "
               f"{', '.join(ctx_label(c) for c in sorted({c for _, c in ratio}))}): "
               f"{min(ratio.values()):.2f}x to {max(ratio.values()):.2f}x -> "
               f"**{'met' if not slower else 'not met'}**" + (f" (slower at {', '.join(slower)})" if slower else "")
               + ".")
    top = max(rows, key=lambda r: (r["batch"], r["context"]))
    kv = top["kv_bytes"]
    byte_ratio = kv["source graph"] / kv["MLA graph"]
    speedup = ratio[(top["batch"], top["context"])]
    out.append(f"- At batch {top['batch']} and {ctx_label(top['context'])} context: MLA / source tokens/s "
               f"{speedup:.2f}x against 0.8 x the cache byte ratio ({byte_ratio:.2f}) = {0.8 * byte_ratio:.2f}x -> "
               f"**{'met' if speedup >= 0.8 * byte_ratio else 'not met'}**.")
    at = [k for k in kernel_rows if (k["batch"], k["context"]) == (top["batch"], top["context"])]
    if at:
        share = at[0]["triton_bw"] / at[0]["copy_bw"]
        out.append(f"- The kernel there: {at[0]['us']['triton']:.1f} us, {at[0]['triton_bw'] / 1e9:.0f} GB/s, "
                   f"{share:.0%} of copy bandwidth against 85% -> **{'met' if share >= 0.85 else 'not met'}**.")
    out.append("")
    return out


def kernel_section(kernel_rows, meta) -> list[str]:
    copy_bw = kernel_rows[0]["copy_bw"]
    has_before = any("triton_before_us" in r for r in kernel_rows)

    def us(v):
        return "n/a" if v is None else f"{v:.1f}"

    lines = [
        "## Attention core alone (CUDA)",
        "",
        "One decode step of attention alone, the same shapes for every column (the MLA forms read the latent cache, "
        f"{meta['d_c']} + {meta['d_r']} values per token; the source's GQA sdpa reads its K/V cache, 2 x "
        f"{meta['kv_heads']} x {meta['head_dim']} values per token, {meta['heads']} query heads). GPU time per call "
        "in microseconds: a CUDA graph runs each form once on each of several input sets (together at least 256 MiB, "
        "so a set is cold in the 50 MB L2 when its turn comes) and its replays are timed with CUDA events; launch "
        "gaps are left out. **triton**: the kernel (`mla_decode`, backend triton); **triton eager**: the same, one "
        "call from Python timed with events, launch cost included (what an eager decode step pays); **torch "
        "absorbed**: the model's torch decode path (`latent_attention`, the A_CC_ME core: rope scores as an sdpa "
        "bias); **fp32 ref**: the float32 einsum reference; **sdpa** / **sdpa flash**: the source's GQA attention "
        "(`scaled_dot_product_attention(..., enable_gqa=True)`, default dispatch / flash backend forced)."
        + (" **before**: the kernel as it was before this run's tuning (see the note below the table)."
           if has_before else ""),
        "",
        f"Achieved bandwidth = cache bytes read / GPU time, against the measured device copy bandwidth "
        f"({copy_bw / 1e9:.0f} GB/s, read + write, 512 MiB copy).",
        "",
        "| batch | context | KV MLA | KV source | triton us |" + (" before us |" if has_before else "") +
        " triton eager us | torch absorbed us | fp32 ref us | sdpa us | sdpa flash us | triton GB/s (% of copy) |"
        " torch absorbed GB/s | sdpa GB/s (% of copy) | triton speedup vs torch absorbed | vs sdpa |",
        "|---:|---:|---:|---:|---:|" + ("---:|" if has_before else "") + "---:|" * 10,
    ]
    for r in kernel_rows:
        u = r["us"]
        lines.append(
            f"| {r['batch']} | {ctx_label(r['context'])} | {fmt_bytes(r['mla_bytes'])} | {fmt_bytes(r['src_bytes'])} | "
            f"{us(u['triton'])} |" + (f" {us(r.get('triton_before_us'))} |" if has_before else "") +
            f" {us(u['triton_eager'])} | {us(u['torch_absorbed'])} | {us(u['reference'])} | {us(u['sdpa'])} |"
            f" {us(u['sdpa_flash'])} | {r['triton_bw'] / 1e9:.0f} ({r['triton_bw'] / copy_bw:.0%}) |"
            f" {r['torch_absorbed_bw'] / 1e9:.0f} | {r['sdpa_bw'] / 1e9:.0f} ({r['sdpa_bw'] / copy_bw:.0%}) |"
            f" {u['torch_absorbed'] / u['triton']:.2f}x | {u['sdpa'] / u['triton']:.2f}x |")
    warm = [f"B={r['batch']} {ctx_label(r['context'])}" for r in kernel_rows
            if r["input_sets"] * r["mla_bytes"] < 100e6]
    if warm:
        lines += ["", f"At {', '.join(warm)} the rotated latent-cache sets total under 100 MB (2x L2, at most 256 sets), "
                      "so part of the MLA forms' reads may come from L2; these points are launch- and latency-bound "
                      "anyway."]
    errs = [r["triton_rel_err"] for r in kernel_rows]
    lines += ["", f"Kernel output vs the float32 reference on the timed inputs: relative error (Frobenius) "
                  f"{min(errs):.1e} to {max(errs):.1e} ({meta['dtype']} inputs).", ""]
    if has_before:
        lines += [f"Before: {meta.get('kernel_baseline_note', '')}", ""]
    return lines


def load_note(meta) -> list[str]:
    """How busy the machine was: on a shared CPU, other jobs' load makes absolute times noisy."""
    if meta.get("load_before") is None:
        return []
    note = (f"- Run time {meta['minutes']:.1f} min. Load average (1 min) {meta['load_before']:.1f} at the start and "
            f"{meta['load_after']:.1f} at the end, on {meta['cpus']} CPUs")
    if max(meta["load_before"], meta["load_after"]) > 0.8 * meta["cpus"]:
        note += (": the machine was shared with other jobs, so absolute times are noisy (the forms were timed in "
                 "interleaved rounds so that load hits them alike; compare the ratios, which are from this run)")
    return [note + "."]


def targets_section(layer_rows, model_rows=()):
    """The issue's targets, checked on this run's per-layer numbers (whole-model numbers beside them)."""
    if not layer_rows:
        return []
    out = ["## Targets (issue 5), checked on the per-layer numbers above", ""]
    at = [r for r in layer_rows if r["batch"] == 8 and r["context"] == 8192]
    if at:
        r = at[0]["ms"]
        speedup = r["source"] / r["A_CC_ME"]
        out.append(f"- Absorbed (A_CC_ME) attention step at least 2x faster than the source's at 8K context, batch 8: "
                   f"{speedup:.2f}x -> **{'met' if speedup >= 2 else 'not met'}** "
                   f"(source {r['source']:.2f} ms, A_CC_ME {r['A_CC_ME']:.2f} ms, CC {r['CC']:.2f} ms).")
        g = at[0].get("graph_ms") or {}
        if g.get("source") and g.get("A_CC_ME"):
            out.append(f"- The same check on GPU time (CUDA graph, the table above): source / A_CC_ME "
                       f"{g['source'] / g['A_CC_ME']:.2f}x"
                       + (f", source / triton {g['source'] / g['triton']:.2f}x" if g.get("triton") else "")
                       + f" -> **{'met' if g['source'] / g.get('triton', g['A_CC_ME']) >= 2 else 'not met'}**"
                       + (" with the Triton kernel" if g.get("triton") else "") + ".")
    else:
        out.append("- 8K context at batch 8 was not in this run's sweep.")
    long = [r for r in layer_rows if r["context"] > 1024]
    slower = [f"B={r['batch']} {ctx_label(r['context'])}" for r in long if r["ms"]["A_CC_ME"] >= r["ms"]["CC"]]
    out.append(f"- Absorbed faster than the naive path (CC) at every context above 1K: "
               f"**{'met' if long and not slower else 'not met'}**"
               + (f" (slower at {', '.join(slower)})" if slower else f" ({len(long)} of {len(long)} points)")
               + (f"; CC time / A_CC_ME time from {min(r['ms']['CC'] / r['ms']['A_CC_ME'] for r in long):.1f}x to "
                  f"{max(r['ms']['CC'] / r['ms']['A_CC_ME'] for r in long):.1f}x" if long else "") + ".")
    for r in model_rows:
        if r["batch"] == 8 and r["context"] == 8192 and "MLA A_CC_ME" in r["tok_s"]:
            t = r["tok_s"]
            out.append(f"- Beside it, the whole model at 8K context, batch 8: source {t['source']:.1f} tokens/s, MLA "
                       f"A_CC_ME {t['MLA A_CC_ME']:.1f} tokens/s ({t['MLA A_CC_ME'] / t['source']:.2f}x), MLA CC "
                       f"{t['MLA CC']:.1f} tokens/s.")
    out.append("")
    return out


def plot(layer_rows, path: Path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = "graph_ms" if all(r.get("graph_ms") for r in layer_rows) else "ms"
    batches = sorted({r["batch"] for r in layer_rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, batch in zip(axes[0], batches):
        rows = [r for r in layer_rows if r["batch"] == batch]
        for name in rows[0]["ms"]:
            pts = [(r["context"], r[key][name]) for r in rows if r[key].get(name) is not None]
            ax.plot([c for c, _ in pts], [v for _, v in pts], marker="o", label=name,
                    linewidth=2.5 if name in ("source", "A_CC_ME", "triton") else 1.2)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks([r["context"] for r in rows], [ctx_label(r["context"]) for r in rows])
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("ms per decode step, one layer" + (" (GPU time, CUDA graph)" if key == "graph_ms" else ""))
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Decode step, one attention layer ({meta['device']}, {meta['dtype']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main


def report(args, meta, layer_rows, model_rows, kernel_rows, generate_rows):
    """The markdown report at --out and, with per-layer rows, the plot at --plot (default: beside it, .png)."""
    out = Path(args.out)
    beside = out.with_name(f"{out.parent.name}.png") if out.name == "README.md" else out.with_suffix(".png")
    plot_path = Path(args.plot) if args.plot else beside
    out.parent.mkdir(parents=True, exist_ok=True)
    if layer_rows:
        plot(layer_rows, plot_path, meta)
    write_report(out, args, meta, layer_rows, model_rows, kernel_rows, plot_path, generate_rows)
    return out, plot_path


def parse_ints(text: str) -> list[int]:
    return [int(float(x[:-1]) * 1024) if x.lower().endswith("k") else int(x) for x in text.split(",") if x]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from-config", action="store_true", help="SmolLM2-135M-shaped models, random weights (default)")
    src.add_argument("--model", help="a converted MLA folder")
    p.add_argument("--source", help="with --model: the source model (folder or hub id); default: built from the "
                                    "converted config with random weights")
    p.add_argument("--gguf-file", help="with --source: the GGUF file name inside the source folder")
    p.add_argument("--d-c", type=int, default=64, help="latent dims per layer with --from-config (default 64)")
    p.add_argument("--d-r", type=int, default=32, help="rope key dims with --from-config (default 32)")
    p.add_argument("--d-n", type=int, default=None, help="nope query/key dims with --from-config (default: the "
                   "converter's, head_dim - d_r where d_r <= head_dim/2; the runs before --nope-dims had 64)")
    p.add_argument("--contexts", type=parse_ints, default=parse_ints("1k,2k,4k,8k,16k,32k"),
                   help="per-layer sweep contexts, comma-separated, k = 1024 (default 1k..32k)")
    p.add_argument("--batches", type=parse_ints, default=[1, 8], help="per-layer sweep batch sizes (default 1,8)")
    p.add_argument("--model-contexts", type=parse_ints, default=parse_ints("1k,8k"),
                   help="whole-model contexts (default 1k,8k)")
    p.add_argument("--model-batches", type=parse_ints, default=[1, 8], help="whole-model batch sizes (default 1,8)")
    p.add_argument("--layer-budget", type=float, default=0.6, help="seconds of timed steps per form per layer point")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds over the forms per layer point")
    p.add_argument("--model-budget", type=float, default=3.0, help="seconds of timed steps per whole-model point")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--clock", choices=sorted(_CLOCK), default="wall",
                   help="wall (default) or cpu: CPU time of the one benchmark thread (CPU device, --threads 1), for a "
                        "machine shared with other jobs")
    p.add_argument("--kernel-contexts", type=parse_ints, default=parse_ints("1k,8k,32k,64k"),
                   help="attention-core table contexts (CUDA; default 1k,8k,32k,64k)")
    p.add_argument("--kernel-batches", type=parse_ints, default=[1, 8, 32],
                   help="attention-core table batch sizes (CUDA; default 1,8,32)")
    p.add_argument("--skip-layer", action="store_true", help="no per-layer sweep")
    p.add_argument("--no-graph", action="store_true", help="CUDA: no CUDA-graph timing of the per-layer step")
    p.add_argument("--skip-model", action="store_true", help="no whole-model sweep")
    p.add_argument("--skip-static", action="store_true",
                   help="whole model: no preallocated-cache (StaticCache) forms, and on CUDA no CUDA-graph forms")
    p.add_argument("--skip-kernel", action="store_true", help="no attention-core table (CUDA)")
    p.add_argument("--generate", action="store_true", help="also time `model.generate` (default cache, and the "
                                                            "static cache, compiled on CUDA), source and MLA")
    p.add_argument("--generate-batches", type=parse_ints, default=[1, 8, 32], help="generate batch sizes")
    p.add_argument("--generate-prompt", type=int, default=1024, help="generate prompt tokens (default 1024)")
    p.add_argument("--generate-new", type=int, default=128, help="generate new tokens (default 128)")
    p.add_argument("--kernel-sweep", metavar="JSON", help="CUDA: also time the Triton kernel's launch knobs over a "
                                                          "few shapes and write them here")
    p.add_argument("--kernel-baseline", metavar="JSON", help="an earlier run's --json: its Triton times go beside "
                                                             "this run's in the attention-core table")
    p.add_argument("--kernel-note", help="a note on the kernel version, stored in the JSON (used with "
                                         "--kernel-baseline)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "decode" / "README.md"))
    p.add_argument("--plot", default=None,
                   help="PNG path (default: beside --out, .png; FOLDER.png for FOLDER/README.md)")
    p.add_argument("--json", default=None, help="also write the raw numbers here")
    p.add_argument("--report-only", metavar="JSON", help="rewrite --out (and --plot) from an earlier run's --json; "
                                                         "nothing is timed")
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if args.report_only:
        saved = json.loads(Path(args.report_only).read_text())
        out, plot_path = report(args, saved["meta"], saved["layer"], saved["model"], saved["kernel"],
                                saved.get("generate", []))
        print(f"wrote {out} from {args.report_only}")
        return
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        p.error("--clock cpu times one thread: use it on the CPU with --threads 1")
    global _clock
    _clock = _CLOCK[args.clock]

    def log(msg):
        print(msg, flush=True)

    source, mla, origin = build_models(args, dtype, device)
    attn = mla.model.layers[0].self_attn
    scfg = source.config
    esize = torch.tensor([], dtype=dtype).element_size()
    copy_bw = copy_bandwidth(device, dtype)
    log(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    started = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "scripts/bench_decode.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "device": f"{device.type} ({device_name})", "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "origin": origin, "clock": args.clock,
        "hidden": scfg.hidden_size, "heads": scfg.num_attention_heads, "kv_heads": scfg.num_key_value_heads,
        "head_dim": scfg.head_dim, "layers": scfg.num_hidden_layers, "d_c": attn.kv_lora_rank,
        "d_r": attn.qk_rope_head_dim, "src_elems": 2 * scfg.num_key_value_heads * scfg.head_dim,
        "mla_elems": attn.kv_lora_rank + attn.qk_rope_head_dim,
        "cd_elems": attn.groups * (attn.qk_nope_head_dim + attn.qk_rope_head_dim + attn.v_head_dim),
        "copy_bw": copy_bw, "element_size": esize, "cpus": os.cpu_count(), "load_before": load_before,
    }
    if args.kernel_note:
        meta["kernel_note"] = args.kernel_note
    layer_rows = [] if args.skip_layer else bench_layers(source, mla, args, device, dtype, log)
    model_rows = [] if args.skip_model else bench_models(source, mla, args, device, dtype, log)
    generate_rows = bench_generate(source, mla, args, device, log) if args.generate else []
    cuda = device.type == "cuda"
    kernel_rows = bench_kernel(mla, args, device, dtype, copy_bw, log) if cuda and not args.skip_kernel else []
    meta["load_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    meta["minutes"] = (time.perf_counter() - started) / 60
    if args.kernel_baseline:
        before = json.loads(Path(args.kernel_baseline).read_text())
        by_shape = {(r["batch"], r["context"]): r["us"]["triton"] for r in before.get("kernel", [])}
        for r in kernel_rows:
            if (r["batch"], r["context"]) in by_shape:
                r["triton_before_us"] = by_shape[(r["batch"], r["context"])]
        note = before["meta"].get("kernel_note")
        meta["kernel_baseline_note"] = (f"`{args.kernel_baseline}`, written by `{before['meta']['command']}`"
                                        + (f" ({note})" if note and note not in before["meta"]["command"] else "")
                                        + ".")
    sweep_rows = kernel_sweep(mla, device, dtype, copy_bw, log) if args.kernel_sweep else []
    out, plot_path = report(args, meta, layer_rows, model_rows, kernel_rows, generate_rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "layer": layer_rows, "model": model_rows,
                                               "kernel": kernel_rows, "generate": generate_rows}, indent=1))
    if args.kernel_sweep:
        Path(args.kernel_sweep).write_text(json.dumps({"meta": meta, "sweep": sweep_rows}, indent=1))
    log(f"wrote {out} and {plot_path}")


if __name__ == "__main__":
    main()
