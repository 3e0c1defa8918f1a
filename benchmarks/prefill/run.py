#!/usr/bin/env python
"""Prefill, eval and training speed: the source model against the converted MLA model, whole model, same run.

Three measurements, every ratio taken within the same run, the models timed in interleaved rounds (the order
alternates every round) so that load on a shared machine hits them alike; medians over the rounds:

1. Attention core, one layer, per shape (causal, batch 1, `--lengths` and `--train-lengths` tokens): the source's
   sdpa (GQA, head dim d_h for query, key and value: the fused kernel), the MLA expanded attention (the value
   zero-padded to d_n + d_r, the output sliced: the fused kernel), with `--unpadded` also as it was before the padding
   (query/key d_n + d_r, value d_v: sdpa falls back to its math kernel), and for the model's narrowest latent when it
   is narrower than the nope key (d_c < d_n) the attention over the latent those layers run (one kv head [c, k_r] of
   width d_c + d_r, also the value). Forward, and forward + backward.
2. The whole model: one forward over `--lengths` tokens (no cache, full logits, as `mla-convert eval` runs it), one
   eval window (`mla_convert.evaluate.perplexity` with one window of the largest length: forward + cross-entropy; the
   README's 16 x 2048 eval is 16 of them) and one fine-tune step over `--train-lengths` tokens (forward, LM loss,
   backward; every parameter trains, as `train: all`; the optimizer step is left out: it is per parameter, not per
   token). With `--expanded`, the MLA model is also timed with every layer in the expanded form
   (`mla_attention_mode="expanded"`: before the attention over the latent); with `--unpadded`, with the old unpadded
   attention (the "before" column; one of the two).
3. A plot of the MLA/source time ratios.

The numbers in benchmarks/prefill/README.md (a 2-core CPU shared with other jobs, hence one thread and the CPU clock):
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/prefill/run.py --threads 1 --clock cpu \
        --model out/bench-quality/mlaconvert-96-self --expanded \
        --out benchmarks/prefill/README.md --json benchmarks/prefill/prefill.json --plot benchmarks/prefill/prefill.png
The 12.5% run (benchmarks/prefill/prefill_12.md: every layer's latent narrower than the nope key; the closed form only,
`mla-convert llama --kv-budget 0.125 --refine-steps 0 -o out/bench-prefill/energy-125-cf`, since speed does not depend
on the weights' values):
    OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python benchmarks/prefill/run.py --threads 1 --clock cpu \
        --model out/bench-prefill/energy-125-cf --expanded --rounds 3 --train-rounds 3 \
        --out benchmarks/prefill/prefill_12.md --json benchmarks/prefill/prefill_12.json \
        --plot benchmarks/prefill/prefill_12.png
`--source` defaults to the embedded SmolLM2-135M (`mla_convert.evaluate.load_model(None)`). On a GPU (not yet run):
    python benchmarks/prefill/run.py --device cuda --dtype bfloat16 --model out/bench-serving/native-250 --unpadded \
        --lengths 1024,2048,8192 --out benchmarks/prefill/prefill_gpu.md --json benchmarks/prefill/prefill_gpu.json \
        --plot benchmarks/prefill/prefill_gpu.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common.harness import cpu_name  # noqa: E402  (the CPU's model name)

_CLOCK = {"wall": time.perf_counter, "cpu": time.thread_time}
_clock = time.perf_counter

UNPADDED = "sdpa_unpadded"  # an attention implementation name the MLA model does not pad for (the old path)
EXPANDED = "expanded only"  # a variant, not an implementation: sdpa with every layer in the expanded form
BEFORE = {  # the whole-model comparison column: what it times
    "MLA before": "the MLA model with the unpadded expanded attention (sdpa's math kernel), as before the padding",
    "MLA expanded only": "the same MLA model with every layer in the expanded form (`mla_attention_mode` "
                         "\"expanded\"), as before layers with d_c < d_n attended over the latent",
}


def register_unpadded():
    """Register transformers' own sdpa under another name: MLAAttention pads only for "sdpa", so a model set to this
    name runs the expanded attention exactly as before the padding (value narrower than query/key: math kernel)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(UNPADDED, sdpa_attention_forward)


def set_attention(model, name: str):
    model.config._attn_implementation = name
    for module in model.modules():
        if getattr(module, "config", None) is not None and module.config is not model.config:
            module.config._attn_implementation = name


# ---------------------------------------------------------------------------------------------- timing


_DEVICE = torch.device("cpu")
_DTYPE = torch.float32


def sync():
    if _DEVICE.type == "cuda":
        torch.cuda.synchronize(_DEVICE)


def timed(fn) -> float:
    sync()
    start = _clock()
    fn()
    sync()
    return _clock() - start


def interleaved(fns: dict, rounds: int, warmup: int = 1) -> dict:
    """{name: fn} -> {name: [seconds per round]}; the order alternates every round, a warm-up call each first."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    names = list(fns)
    out = {n: [] for n in names}
    for r in range(rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            out[n].append(timed(fns[n]))
    return out


# ---------------------------------------------------------------------------------------------- attention core


def attention_rows(src_cfg, mla_cfg, lengths, train_lengths, rounds, log, unpadded=False):
    import torch.nn.functional as F

    heads, groups = mla_cfg.num_attention_heads, mla_cfg.num_key_value_heads
    d_h = src_cfg.head_dim
    d_qk, d_v = mla_cfg.qk_nope_head_dim + mla_cfg.qk_rope_head_dim, mla_cfg.v_head_dim
    rep = heads // groups
    d_r = mla_cfg.qk_rope_head_dim
    ranks = mla_cfg.kv_lora_ranks
    narrow = min(ranks) if min(ranks) < mla_cfg.qk_nope_head_dim else None  # layers that attend over the latent
    rows = []
    for length in sorted(set(lengths) | set(train_lengths)):
        g = torch.Generator().manual_seed(length)

        def rand(*shape, grad=False):
            return torch.randn(*shape, generator=g).to(_DEVICE, _DTYPE).requires_grad_(grad)

        for backward in (False, True) if length in train_lengths else (False,):
            q_s, k_s, v_s = rand(1, heads, length, d_h, grad=backward), rand(1, groups, length, d_h, grad=backward), \
                rand(1, groups, length, d_h, grad=backward)
            q_m, k_m, v_m = rand(1, heads, length, d_qk, grad=backward), rand(1, groups, length, d_qk, grad=backward), \
                rand(1, groups, length, d_v, grad=backward)
            if narrow is not None:
                q_l, k_l = rand(1, heads, length, narrow + d_r, grad=backward), rand(1, 1, length, narrow + d_r,
                                                                                   grad=backward)

            def run(fn):
                def call():
                    if backward:
                        fn().sum().backward()
                    else:
                        with torch.no_grad():
                            fn()
                return call

            def source():
                return F.scaled_dot_product_attention(q_s, k_s, v_s, is_causal=True, scale=d_h**-0.5, enable_gqa=True)

            def before():  # what transformers' sdpa does with unequal widths: repeat the kv heads, math kernel
                k, v = k_m.repeat_interleave(rep, 1), v_m.repeat_interleave(rep, 1)
                return F.scaled_dot_product_attention(q_m, k, v, is_causal=True, scale=mla_cfg.softmax_scale)

            def padded():
                v = F.pad(v_m, (0, d_qk - d_v)) if d_qk > d_v else v_m
                q, k = (F.pad(q_m, (0, d_v - d_qk)), F.pad(k_m, (0, d_v - d_qk))) if d_v > d_qk else (q_m, k_m)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=mla_cfg.softmax_scale,
                                                     enable_gqa=True)
                return out[..., :d_v]

            def latent():  # as MLAAttention._latent_prefill: the shared [c, k_r] is the key and the value
                k = k_l.expand(-1, heads, -1, -1)
                out = F.scaled_dot_product_attention(q_l, k, k, is_causal=True, scale=mla_cfg.softmax_scale)
                return out[..., :narrow]

            fns = {"source": run(source), "padded": run(padded)}
            if unpadded:
                fns["before"] = run(before)
            if narrow is not None:
                fns["latent"] = run(latent)
            times = interleaved(fns, rounds)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append(dict(length=length, backward=backward, shape=f"H{heads}/G{groups} q,k {d_qk} v {d_v}",
                             source_s=med["source"], before_s=med.get("before"), padded_s=med["padded"],
                             latent_s=med.get("latent"), latent_rank=narrow, samples=times))
            log(f"attention T={length} {'fwd+bwd' if backward else 'fwd'}: "
                + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in med.items()))
    return rows


# ---------------------------------------------------------------------------------------------- whole model


def model_rows(source, mla, args, log):
    from mla_convert.evaluate import perplexity
    from mla_convert.finetune import lm_loss

    vocab = min(source.config.vocab_size, mla.config.vocab_size)
    rows = []

    def variants(make):
        fns = {"source": make(source, "sdpa"), "mla": make(mla, "sdpa")}
        if args.unpadded:
            fns["mla_before"] = make(mla, UNPADDED)
        elif args.expanded:
            fns["mla_before"] = make(mla, EXPANDED)
        return fns

    def with_attention(model, impl, fn):
        mla_model = hasattr(model.config, "mla_attention_mode")

        def call():
            set_attention(model, "sdpa" if impl == EXPANDED else impl)
            if mla_model:
                model.config.mla_attention_mode = "expanded" if impl == EXPANDED else "auto"
            try:
                fn()
            finally:
                set_attention(model, "sdpa")
                if mla_model:
                    model.config.mla_attention_mode = "auto"
        return call

    jobs = []
    for length in args.lengths:
        ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(length)).to(_DEVICE)

        def forward(model, impl, ids=ids):
            def fn():
                with torch.no_grad():
                    model(input_ids=ids, use_cache=False)
            return with_attention(model, impl, fn)

        jobs.append(("forward", length, forward, args.rounds))
    if args.eval_length:
        length = args.eval_length
        ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(1))

        def eval_window(model, impl, ids=ids, length=length):
            return with_attention(model, impl, lambda: perplexity(model, ids, seq_len=length, windows=1,
                                                                  progress=False))

        jobs.append(("eval window", length, eval_window, args.rounds))
    for length in args.train_lengths:
        ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(2 * length)).to(_DEVICE)

        def train_step(model, impl, ids=ids):
            def fn():
                model.train()
                try:
                    loss = lm_loss(model(input_ids=ids, use_cache=False).logits, ids)
                    loss.backward()
                finally:
                    model.zero_grad(set_to_none=True)
                    model.eval()
            return with_attention(model, impl, fn)

        jobs.append(("train step", length, train_step, args.train_rounds))

    for what, length, make, rounds in jobs:
        times = interleaved(variants(make), rounds)
        med = {k: statistics.median(v) for k, v in times.items()}
        row = dict(what=what, length=length, source_s=med["source"], mla_s=med["mla"],
                   mla_before_s=med.get("mla_before"), ratio=med["mla"] / med["source"], samples=times)
        rows.append(row)
        log(f"{what} T={length}: source {med['source']:.2f} s, MLA {med['mla']:.2f} s ({row['ratio']:.3f}x)"
            + (f", MLA before {med['mla_before']:.2f} s" if "mla_before" in med else ""))
    return rows


# ---------------------------------------------------------------------------------------------- report


def load_model(spec, dtype="float32"):
    from mla_convert.evaluate import load_model as load

    model, _, label = load(spec, dtype=dtype, device=str(_DEVICE))
    set_attention(model, "sdpa")
    return model, label


def targets(rows) -> list[tuple[str, str, bool]]:
    """(acceptance line, measured, holds) for issue 13's CPU lines."""
    out = []
    for r in rows:
        if r["what"] == "forward":
            out.append((f"forward over {r['length']} tokens at most 1.1x the source's time", f"{r['ratio']:.3f}x",
                        r["ratio"] <= 1.1))
        elif r["what"] == "train step":
            out.append((f"fine-tune step ({r['length']} tokens) at most 1.15x the source's", f"{r['ratio']:.3f}x",
                        r["ratio"] <= 1.15))
        elif r["what"] == "eval window":
            out.append(("16 x 2048 eval no slower than the source's (16 x one window, estimated)",
                        f"{16 * r['mla_s'] / 60:.1f} min vs {16 * r['source_s'] / 60:.1f} min ({r['ratio']:.3f}x)",
                        r["ratio"] <= 1.0))
    return out


def write_report(path: Path, meta, attn, rows, plot_path):
    lines = [
        "# Prefill, eval and training speed: source vs converted MLA (whole model, CPU)",
        "",
        f"Written by `benchmarks/prefill/run.py` on {meta['date']}. Command (from the repository root):",
        "",
        "```",
        meta["command"],
        "```",
        "",
        f"- Device: {meta['gpu'] or 'cpu'} (host {meta['cpu']}, {meta['cores']} cores); {meta['dtype']}; torch "
        f"{meta['torch']}, threads {meta['threads']}.",
        f"- Source: `{meta['source']}`. MLA: `{meta['model']}` ({meta['mla_shape']}).",
        f"- Times are medians over {meta['rounds']} interleaved rounds ({meta['train_rounds']} for the train step), "
        + ("in CPU time of the benchmark's one thread (`--clock cpu`: time the scheduler gave to other jobs is left "
           "out; memory stalls and cache sharing still count)" if meta["clock"] == "cpu" else "in wall-clock time")
        + "; ratios are MLA / source within this run.",
        f"- Run time {meta['minutes']:.1f} min. Load average (1 min) {meta['load_start']:.1f} at the start and "
        f"{meta['load_end']:.1f} at the end, on {meta['cores']} CPUs (the benchmark itself adds 1)"
        + (": the machine was shared with other jobs, so absolute times are noisy; compare the ratios."
           if max(meta["load_start"], meta["load_end"] - 1) > 0.5 else ": no other long job ran."),
        "",
        "## Attention core, one layer (causal, batch 1)",
        "",
        "The source's sdpa runs its fused kernel (one head dim for query, key and value). The MLA expanded attention "
        "has query/key width d_n + d_r and value width d_v; *expanded* zero-pads the value to the query/key width and "
        "slices the output, which keeps the fused kernel and changes no result"
        + ("; *before* is the unpadded call, on which sdpa fell back to its math kernel (every score matrix "
           "materialised)" if any(r["before_s"] for r in attn) else "")
        + ("; *latent* is the attention over the latent that layers with d_c < d_n run (`_latent_prefill`: query "
           "mapped through W_uk, one shared kv head [c, k_r] of width d_c + d_r, also the value), at the model's "
           "narrowest latent" if any(r["latent_s"] for r in attn) else "")
        + ". Time per call in ms; in brackets the ratio to the source.",
        "",
    ]
    cols = [("padded_s", "MLA expanded")]
    if any(r["before_s"] for r in attn):
        cols.append(("before_s", "MLA before (unpadded)"))
    if any(r["latent_s"] for r in attn):
        cols.append(("latent_s", f"MLA latent, d_c {attn[0]['latent_rank']}"))
    if attn:
        lines += ["| tokens | pass | shape | source | " + " | ".join(c[1] for c in cols) + " |",
                  "|---:|---|---|---:|" + "---:|" * len(cols)]
    for r in attn:
        s = r["source_s"]
        lines.append(f"| {r['length']} | {'fwd+bwd' if r['backward'] else 'fwd'} | {r['shape']} | {s * 1e3:.1f} | "
                     + " | ".join(f"{r[k] * 1e3:.1f} ({r[k] / s:.2f}x)" for k, _ in cols) + " |")
    lines += [
        "",
        "Both products of the expanded core run at the padded width max(d_n + d_r, d_v), so it does that / d_h of the "
        "source's attention arithmetic: 1.0x with the default nope width d_n = d_h - d_r (conversions since "
        "`--nope-dims`; query and key as wide as the source's head), 1.5x at d_n 64, d_r 32, d_h 64 (the default "
        "before, `--nope-dims 64`); a layer over a latent of width d_c + d_r < d_h does less.",
        "",
        "## Whole model",
        "",
        "forward: one forward, no cache, full logits (what `mla-convert eval` and the teacher in fine-tuning run); "
        "eval window: `perplexity(..., windows=1)` (forward + cross-entropy); train step: forward, LM loss, backward, "
        "every parameter trainable, no optimizer step. Seconds; ratio MLA / source."
        + (f" *{meta['before']}*: {BEFORE[meta['before']]}." if meta["before"] in BEFORE else ""),
        "",
        f"| what | tokens | source s | MLA s | MLA / source | {meta['before']} s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        before = f"{r['mla_before_s']:.2f} ({r['mla_before_s'] / r['source_s']:.2f}x)" if r["mla_before_s"] else "-"
        lines.append(f"| {r['what']} | {r['length']} | {r['source_s']:.2f} | {r['mla_s']:.2f} | {r['ratio']:.3f}x | "
                     f"{before} |")
    if meta.get("cache_fraction", 0.25) == 0.25:
        lines += ["", "## Acceptance (issue 13, CPU lines)", "", "| line | measured | holds |", "|---|---|---|"]
        for line, measured, holds in targets(rows):
            lines.append(f"| {line} | {measured} | {'yes' if holds else '**no**'} |")
    else:
        lines += ["", f"Issue 13's CPU lines are stated for a conversion at 25% of the source's cache; this one keeps "
                  f"{100 * meta['cache_fraction']:g}% (benchmarks/prefill/README.md holds the 25% run)."]
    if plot_path:
        lines += ["", f"![MLA / source time]({plot_path.name})"]
    lines += ["", "GPU figures wait for a lent device (the same script runs there with `--device cuda`, not yet done)."
              if meta["device"] == "cpu" else ""]
    path.write_text("\n".join(lines).rstrip() + "\n")


def plot(rows, attn, path: Path, meta):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    nan = float("nan")
    labels, series = [], {"before": [], "now": [], "latent": []}  # comparison, MLA as it runs, latent core
    for r in attn:
        labels.append(f"attn {r['length']}\n{'fwd+bwd' if r['backward'] else 'fwd'}")
        series["before"].append(r["before_s"] / r["source_s"] if r["before_s"] else nan)
        series["now"].append(r["padded_s"] / r["source_s"])
        series["latent"].append(r["latent_s"] / r["source_s"] if r.get("latent_s") else nan)
    for r in rows:
        labels.append(f"{r['what']}\n{r['length']}")
        series["before"].append(r["mla_before_s"] / r["source_s"] if r["mla_before_s"] else nan)
        series["now"].append(r["ratio"])
        series["latent"].append(nan)
    names = {"before": f"{meta['before']} (whole model); unpadded core",
             "now": "MLA as it runs (whole model); expanded core",
             "latent": "core over the narrowest latent" + (f" (d_c {attn[0]['latent_rank']})" if attn else "")}
    colors = {"before": "#c0c0c0", "now": "#3070b0", "latent": "#60a060"}
    shown = [k for k, v in series.items() if any(x == x for x in v)]
    x = range(len(labels))
    width = 0.8 / len(shown)
    for j, key in enumerate(shown):
        ax.bar([i - 0.4 + width * (j + 0.5) for i in x], series[key], width=width, label=names[key],
               color=colors[key])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("time MLA / source")
    ax.set_title(f"SmolLM2-135M, {meta['gpu'] or 'CPU, %d thread' % meta['threads']}, {meta['dtype']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_ints(text: str) -> list[int]:
    return [int(float(t[:-1]) * 1024) if t.lower().endswith("k") else int(t) for t in text.split(",") if t]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="out/bench-serving/native-250", help="converted MLA folder")
    p.add_argument("--source", default=None, help="source model (folder or .gguf); default: the embedded SmolLM2")
    p.add_argument("--lengths", default="1024,2048", help="forward lengths (tokens)")
    p.add_argument("--eval-length", type=int, default=2048, help="eval window length (0: skip)")
    p.add_argument("--train-lengths", default="512,1024", help="fine-tune step lengths (tokens)")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds for forward / eval / attention")
    p.add_argument("--train-rounds", type=int, default=3, help="interleaved rounds for the train step")
    p.add_argument("--unpadded", action="store_true", help="also time the MLA model with the old unpadded attention")
    p.add_argument("--expanded", action="store_true",
                   help="also time the MLA model with every layer in the expanded form (no attention over the latent)")
    p.add_argument("--skip-attention", action="store_true")
    p.add_argument("--skip-model", action="store_true")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (weights and activations)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=sorted(_CLOCK), default="wall",
                   help="cpu: CPU time of this thread (needs --threads 1), for shared machines")
    p.add_argument("--out", default="benchmarks/prefill/README.md")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    args.lengths, args.train_lengths = parse_ints(args.lengths), parse_ints(args.train_lengths)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        p.error("--clock cpu times one thread: use it with --threads 1")
    global _clock, _DEVICE, _DTYPE
    _clock = _CLOCK[args.clock]
    _DEVICE, _DTYPE = torch.device(args.device), getattr(torch, args.dtype)
    if args.clock == "cpu" and _DEVICE.type != "cpu":
        p.error("--clock cpu times one CPU thread: use the wall clock on a GPU")
    start, load_start = time.time(), os.getloadavg()[0]

    def log(msg):
        print(f"[{time.time() - start:7.1f}s] {msg}", flush=True)

    register_unpadded()
    source, source_label = load_model(args.source, args.dtype)
    mla, mla_label = load_model(args.model, args.dtype)
    c = mla.config
    ranks = c.kv_lora_ranks
    mean = sum(ranks) / len(ranks)
    d_c = f"{ranks[0]}" if len(set(ranks)) == 1 else f"{min(ranks)}-{max(ranks)} by layer, mean {mean:g}"
    cache, source_cache = mean + c.qk_rope_head_dim, 2 * source.config.num_key_value_heads * source.config.head_dim
    mla_shape = (f"d_c {d_c}, d_r {c.qk_rope_head_dim}, d_n {c.qk_nope_head_dim}, d_v {c.v_head_dim}; "
                 f"cache {cache:g} values per token per layer vs the source's {source_cache}")
    if args.unpadded and args.expanded:
        p.error("--unpadded and --expanded both fill the comparison column: pick one")
    attn = [] if args.skip_attention else attention_rows(source.config, c, args.lengths, args.train_lengths,
                                                          args.rounds, log, unpadded=args.unpadded)
    rows = [] if args.skip_model else model_rows(source, mla, args, log)
    meta = dict(date=datetime.date.today().isoformat(), command="OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 python "
                + shlex.join(["benchmarks/prefill/run.py", *(argv if argv is not None else sys.argv[1:])]),
                cpu=cpu_name(), cores=os.cpu_count(), torch=torch.__version__, threads=torch.get_num_threads(),
                source=source_label if args.source else "embedded SmolLM2-135M (load_model(None))",
                model=args.model, mla_shape=mla_shape, cache_fraction=round(cache / source_cache, 4),
                before="MLA before" if args.unpadded else "MLA expanded only" if args.expanded else "-",
                rounds=args.rounds, train_rounds=args.train_rounds,
                clock=args.clock, minutes=(time.time() - start) / 60, load_start=load_start,
                load_end=os.getloadavg()[0], device=args.device, dtype=args.dtype,
                gpu=torch.cuda.get_device_name(_DEVICE) if _DEVICE.type == "cuda" else None)
    out = Path(args.out)
    plot_path = Path(args.plot) if args.plot else None
    if plot_path:
        plot(rows, attn, plot_path, meta)
    write_report(out, meta, attn, rows, plot_path)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, attention=attn, model=rows), indent=1) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
