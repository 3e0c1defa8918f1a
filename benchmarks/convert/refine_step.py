#!/usr/bin/env python
"""Time of one whole-layer refinement step (forward, backward, Adam) at the embedded model's layer shape, in float32
and under bfloat16 autocast: what `--refine-precision` trades (docs/decisions.md#refinement-precision).

    python benchmarks/convert/refine_step.py [--steps 5] [--attention sdpa|eager] [--shape NAME] [--seq-len 2048]
    python benchmarks/convert/refine_step.py --model out/FOLDER [--layer 3] [--seq-len 1024 --batch 2] [--compile]
    python benchmarks/convert/refine_step.py --model out/FOLDER --queries 256 [--profile [float32|bfloat16]]
    python benchmarks/convert/refine_step.py --model out/FOLDER --queries 256 --grouped-ab [--rounds 3]

The layer is a Llama decoder layer of SmolLM2-135M's shape (hidden 576, 9 query / 3 kv heads, head_dim 64,
intermediate 1536), of Llama-3-8B's (hidden 4096, 32 / 8 heads, head_dim 128, intermediate 14336), of the tests'
tiny models (hidden 64) or of a hidden-256 model, on one window (2048 tokens by default: the refinement's step); it prints seconds a step for each precision, measured twice in alternation
after a warm-up step, and what `--refine-steps` (200 by default) would cost a layer at that rate.
`--model` takes one decoder layer of a converted (native MLA) checkpoint instead, as the refinement trains it
(`refine_layer.layer_update`); `--compile` runs its forward through `torch.compile`; `--batch` windows a step (the
refinement takes 2048 / T windows of T tokens); `--queries N` takes the loss at N random positions a step
(`refine_layer.layer_update_at`, `--refine-queries`); `--profile` prints the operators of the steps in one precision
(float32 unless named) by their own CPU time (`torch.profiler`) instead of timing both precisions; `--grouped-ab`
times, in bfloat16 and in alternation for `--rounds` rounds, the step as the refinement takes it (a kv group's query
heads stacked over its keys, `modeling_mla.grouped_sdpa`; Adam fused, `refine_layer.adam`) against the step before them
(each group's keys and values repeated for its heads; Adam's per-tensor update).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding


SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
    "h256": dict(hidden_size=256, intermediate_size=768, num_attention_heads=4, num_key_value_heads=2, head_dim=64),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128),
}


def plain(layer, x, embeddings):
    out = layer(x, position_embeddings=embeddings, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


def update(layer, x, embeddings):
    from mla_convert.conversion.refine_layer import layer_update

    return layer_update(layer, x, embeddings)


def timed(step, bf16: bool, steps: int) -> float:
    """Seconds a step of `step(bf16)` over `steps` steps, after one untimed."""
    step(bf16)
    start = time.perf_counter()
    for _ in range(steps):
        step(bf16)
    return (time.perf_counter() - start) / steps


def mla_layer(folder: str, index: int):
    """(decoder layer `index` of the converted checkpoint `folder`, trainable, float32; its config; its rotary)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from mla_convert.modeling.modeling_mla import MLAForCausalLM

    model = MLAForCausalLM.from_pretrained(folder, dtype=torch.float32)
    layer = model.model.layers[index]
    layer.requires_grad_(True)
    return layer, model.config, model.model.rotary_emb


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per measurement")
    parser.add_argument("--attention", default="sdpa", choices=("sdpa", "eager"))
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
    parser.add_argument("--layer-steps", type=int, default=200, help="steps a layer for the per-layer cost line")
    parser.add_argument("--model", help="a converted checkpoint folder: time one of its MLA decoder layers")
    parser.add_argument("--layer", type=int, default=3, help="which layer of --model")
    parser.add_argument("--compile", action="store_true", help="the forward through torch.compile")
    parser.add_argument("--batch", type=int, default=1, help="windows a step")
    parser.add_argument("--queries", type=int, default=0, help="with --model: the loss at this many positions a step")
    parser.add_argument("--grouped-ab", action="store_true",
                        help="with --queries: the step with grouped attention and fused Adam against without")
    parser.add_argument("--rounds", type=int, default=3, help="--grouped-ab: rounds of the alternation")
    parser.add_argument("--profile", choices=("float32", "bfloat16"), nargs="?", const="float32", default=None,
                        help="profile --steps steps in this precision (default float32; torch.profiler)")
    args = parser.parse_args()
    if args.queries and (not args.model or args.compile):
        parser.error("--queries takes a converted layer (--model) and runs uncompiled (no --compile)")
    if args.grouped_ab and not args.queries:
        parser.error("--grouped-ab times the step at chosen positions: give --queries")
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    batch = args.batch
    if args.model:
        layer, config, rotary = mla_layer(args.model, args.layer)
    else:
        config = LlamaConfig(**SHAPES[args.shape], num_hidden_layers=1)
        config._attn_implementation = args.attention
        layer, rotary = LlamaDecoderLayer(config, 0), LlamaRotaryEmbedding(config)
    x = torch.randn(batch, args.seq_len, config.hidden_size)
    target = torch.randn_like(x)
    embeddings = tuple(t.expand(batch, -1, -1) for t in rotary(x, torch.arange(args.seq_len)[None]))
    from mla_convert.modeling import modeling_mla
    from mla_convert.conversion.refine_layer import adam, layer_update_at

    optimizer = adam([{"params": list(layer.parameters()), "lr": 1e-3}])
    forward = update if args.model else plain
    if args.compile:
        forward = torch.compile(forward, dynamic=False)

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            if args.queries:
                index = torch.randperm(args.seq_len)[: args.queries].sort().values
                out, want = layer_update_at(layer, x, embeddings, index), target[:, index]
            else:
                out, want = forward(layer, x, embeddings), target
        loss = (out.float() - want).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    what = f"{args.model} layer {args.layer}" if args.model else f"{args.shape}, attention {args.attention}"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {what}, {batch} x {args.seq_len} tokens"
          + (", compiled" if args.compile else "") + (f", loss at {args.queries} positions" if args.queries else ""))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        bf16 = args.profile == "bfloat16"
        step(bf16)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                step(bf16)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    if args.grouped_ab:
        grouped = modeling_mla.grouped_fits
        for _ in range(args.rounds):
            for now in (False, True):
                modeling_mla.grouped_fits = grouped if now else (lambda *a: False)
                optimizer = adam([{"params": list(layer.parameters()), "lr": 1e-3}]) if now else \
                    torch.optim.Adam(layer.parameters(), 1e-3)
                seconds = timed(step, True, args.steps)
                print(f"{'grouped attention, fused Adam' if now else 'repeated keys, per-tensor Adam'}: "
                      f"{seconds:.4f} s a step (bfloat16 autocast)")
        return
    for bf16 in (False, True, False, True):
        seconds = timed(step, bf16, args.steps)
        print(f"{'bfloat16 autocast' if bf16 else 'float32'}: {seconds:.3f} s a step, "
              f"{args.layer_steps * seconds / 60:.1f} min for {args.layer_steps} steps of one layer")


if __name__ == "__main__":
    main()
