#!/usr/bin/env python
"""The attention of a layer step at chosen positions (`refine.layer_update_at`), forward and backward in bfloat16
autocast: the chosen queries against every key through a causal mask (what the step runs), against the queries split
by position into parts that each read only the keys up to their last position.

    OMP_NUM_THREADS=1 python benchmarks/convert/subset_attention.py [--parts 2 4 8 16] [--steps 20]

Shapes of the 50% default's step on SmolLM2-135M: 9 query heads over 3 kv groups, 256 of 2048 positions, query/key
width 112 (the value padded to it, as the fused kernel needs). Why the split was not built:
docs/decisions.md#attention-forms-in-the-model.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

HEADS, GROUPS, WINDOW, QUERIES, WIDTH = 9, 3, 2048, 256, 112


def masked(q, k, v, index):
    mask = index[:, None] >= torch.arange(WINDOW)[None]
    return sdpa(q, k, v, attn_mask=mask[None, None], enable_gqa=True)


def split(q, k, v, index, parts: int):
    outs, first = [], 0
    for end in (WINDOW * (p + 1) // parts for p in range(parts)):
        last = int((index < end).sum())
        if last > first:
            mask = index[first:last, None] >= torch.arange(end)[None]
            outs.append(sdpa(q[:, :, first:last], k[:, :, :end], v[:, :, :end], attn_mask=mask[None, None],
                             enable_gqa=True))
        first = last
    return torch.cat(outs, dim=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    index = torch.randperm(WINDOW)[:QUERIES].sort().values
    q = torch.randn(1, HEADS, QUERIES, WIDTH, requires_grad=True)
    k = torch.randn(1, GROUPS, WINDOW, WIDTH, requires_grad=True)
    v = torch.randn(1, GROUPS, WINDOW, WIDTH, requires_grad=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    forms = {"masked": lambda: masked(q, k, v, index)}
    forms.update({f"{p} parts": (lambda p=p: split(q, k, v, index, p)) for p in args.parts})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = forms["masked"]().float()
    for name, form in forms.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            difference = (form().float() - whole).abs().max().item()
        for _ in range(2):
            start = time.perf_counter()
            for _ in range(args.steps):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = form()
                out.float().pow(2).mean().backward()
            print(f"{name}: {(time.perf_counter() - start) / args.steps * 1000:.1f} ms a forward and backward "
                  f"(largest difference from masked {difference:.1e})")


if __name__ == "__main__":
    main()
