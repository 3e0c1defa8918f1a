#!/usr/bin/env python
"""Where one step of the model stage (`--refine-model-steps`, `model_stage.refine_model`) spends its time on this machine.

    python benchmarks/convert/model_stage.py --model out/FOLDER [--steps 3] [--seq-len 2048] [--precision bfloat16]

Runs the stage's step on a converted (native MLA) checkpoint as `refine_model` runs it: the forward through every layer
(`model_stage.final_hidden`), the head and the KL to a teacher with its gradient (`model_stage._kl_chunks`, from the teacher's
`model_stage.teacher_terms`, formed once and timed apart), the layers' backward and Adam over the attention's weights.
Random tokens and teacher states (the cost does not depend on them). Prints the four parts' seconds for each of
--steps timed steps after a warm-up, then one step's operators by their own CPU time (`torch.profiler`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="a converted folder")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--precision", choices=("float32", "bfloat16"), default="bfloat16")
    args = parser.parse_args()

    import mla_convert  # noqa: F401  (registers the native MLA model with transformers)
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from mla_convert.conversion import model_stage, refine_layer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    names = set(model_stage.model_parameter_names(model))
    for name, p in model.named_parameters():
        p.requires_grad_(name in names)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    ids = torch.randint(0, model.config.vocab_size, (args.seq_len,))
    teacher = torch.randn(args.seq_len, model.config.hidden_size)
    start = time.perf_counter()
    terms = model_stage.teacher_terms(model, teacher)  # once a window, before the steps
    formed = time.perf_counter() - start
    model.train()

    def step() -> tuple[float, ...]:
        marks = [time.perf_counter()]
        with refine_layer._compute(ids, args.precision):
            hidden = model_stage.final_hidden(model, ids)
        marks.append(time.perf_counter())
        leaf = hidden.detach().float().requires_grad_(True)
        model_stage._kl_chunks(model, leaf, terms, backward=True, precision=args.precision)
        marks.append(time.perf_counter())
        optimizer.zero_grad(set_to_none=True)
        hidden.backward(leaf.grad.to(hidden.dtype))
        marks.append(time.perf_counter())
        optimizer.step()
        marks.append(time.perf_counter())
        return tuple(round(b - a, 2) for a, b in zip(marks, marks[1:]))

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.model}, {args.seq_len} tokens, "
          f"{args.precision} steps; the teacher's terms {formed:.2f} s a window (once)")
    step()
    for _ in range(args.steps):
        forward, head, backward, adam = step()
        print(f"forward {forward} s, head and KL (forward and backward) {head} s, layers' backward {backward} s, "
              f"Adam {adam} s")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
