"""The decode benchmark's measurements on the models: one attention layer per form, the whole model over a pre-filled
cache (dynamic, static, CUDA graph), and `generate`."""

from __future__ import annotations

import functools
import gc
import statistics

import torch

from benchmarks.decode.kernel import input_sets
from benchmarks.decode.models import SlotCache, cache_bytes, layer_variants
from benchmarks.decode.timing import captured, graph_seconds, now, reps_for, sync, time_fn, time_samples
from mla_convert.evaluate import cache_bytes as measured_cache_bytes
from mla_convert.modeling.compat import cache_kwargs


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
