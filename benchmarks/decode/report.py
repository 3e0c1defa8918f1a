"""The decode benchmark's report: the markdown tables, the targets, the plot."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.common import harness


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


def header_section(meta) -> list[str]:
    """The report's head: the command, the machine, the shapes, the clock and the decode forms."""
    return [
        "# Decode speed and KV-cache size: source GQA vs converted MLA",
        "",
        f"Written by `benchmarks/decode/run.py` on {meta['date']}. Command (from the repository root):",
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


def layer_section(layer_rows, plot_path: Path) -> list[str]:
    """One attention layer's decode step per form: eager time, cache bytes read a second, and GPU time (CUDA graph)."""
    names, lines = list(layer_rows[0]["ms"]), []
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
    return lines


def model_section(model_rows) -> list[str]:
    """The whole model's tokens a second per form, each against the source run the same way."""
    lines = []
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
    return lines


def write_report(path: Path, args, meta, layer_rows, model_rows, kernel_rows, plot_path, generate_rows=()):
    lines = header_section(meta)
    if layer_rows:
        lines += layer_section(layer_rows, plot_path)
    if model_rows:
        lines += model_section(model_rows)
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
