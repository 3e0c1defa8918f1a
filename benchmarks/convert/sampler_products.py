#!/usr/bin/env python
"""What bounds the self text's sampler on this CPU: the rate of a sampling step's matrix products in each arithmetic
(64 rows, SmolLM2-135M's MLP and head shapes, 1 thread), and where a step's time goes (torch's profiler over 30 steps
of `mla_convert.sampler` on the embedded default, 64 slots, after 150 steps).

    python benchmarks/convert/sampler_products.py [--json FILE]

int8 is `torch._int_mm` (int8 x int8 -> int32) on weights quantized once per output channel, alone and with the
activations quantized per row each call (what a sampler would run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import harness  # noqa: E402  (the machine record)

ROWS, HIDDEN = 64, 576


def rate(fn, flops: float, seconds: float = 1.0) -> float:
    """GFLOP/s of `fn` over about `seconds`."""
    with torch.inference_mode():
        for _ in range(3):
            fn()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < seconds:
            fn()
            n += 1
    return flops * n / (time.perf_counter() - start) / 1e9


def products() -> list[dict]:
    rows = []
    gen = torch.Generator().manual_seed(0)
    for width in (1536, 49152):
        w, x = torch.randn(width, HIDDEN, generator=gen), torch.randn(ROWS, HIDDEN, generator=gen)
        wb, xb = w.bfloat16(), x.bfloat16()
        scale = w.abs().amax(1) / 127
        wq = (w / scale[:, None]).round().to(torch.int8).t()  # [K, N], column-major (a view of [N, K])

        def int8_dynamic():
            s = x.abs().amax(1, keepdim=True) / 127
            return torch._int_mm((x / s).round_().to(torch.int8), wq).float() * s * scale

        xq = (x / (x.abs().amax(1, keepdim=True) / 127)).round().to(torch.int8)
        flops = 2 * ROWS * width * HIDDEN
        row = {"width": width, "float32": rate(lambda: x @ w.t(), flops), "bfloat16": rate(lambda: xb @ wb.t(), flops),
               "int8": rate(lambda: torch._int_mm(xq, wq), flops), "int8_dynamic": rate(int8_dynamic, flops)}
        rows.append({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def profile() -> dict:
    """Self CPU time shares of 30 sampler steps, by operation group."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from mla_convert import sampler
    from mla_convert.checkpoint import open_source
    from mla_convert.conversion import selftext

    source = open_source(None)
    model = selftext.causal_lm(source, "cpu", selftext.sampling_dtype(source))
    steps, forward, prof = [0], sampler._forward, torch_profile(activities=[ProfilerActivity.CPU])

    def counted(*args, **kwargs):
        steps[0] += 1
        if steps[0] == 150:
            prof.__enter__()
        out = forward(*args, **kwargs)
        if steps[0] == 180:
            prof.__exit__(None, None, None)
            raise StopIteration
        return out

    sampler._forward = counted
    try:
        for _ in selftext.sample_stream(model, source.tokenizer(), 0, 0, 1.2, selftext.SAMPLE_TOKENS, 64, "chat",
                                        budget=8000):
            pass
    except (StopIteration, RuntimeError):  # a generator turns StopIteration into RuntimeError
        pass
    finally:
        sampler._forward = forward
    totals = {}
    for e in prof.key_averages():
        group = {"aten::mm": "products", "aten::_scaled_dot_product_flash_attention_for_cpu": "attention"}.get(
            e.key, "rest")
        totals[group] = totals.get(group, 0.0) + e.self_cpu_time_total
    whole = sum(totals.values())
    shares = {k: round(v / whole, 3) for k, v in totals.items()}
    shares["ms_per_step"] = round(whole / 1e3 / 30, 1)
    print(json.dumps(shares), flush=True)
    return shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, default=Path(__file__).with_name("sampler_products.json"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    record = {"products_gflops": products(), "step_profile": profile(), "machine": harness.machine()}
    args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
