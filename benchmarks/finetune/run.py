#!/usr/bin/env python
"""Fine-tuning benchmark on the embedded default (SmolLM2-135M-Instruct) converted to 25% of its KV cache.

Converts it, measures WikiText-2 raw test perplexity (16 x 2048-token windows) of the source and the converted model,
fine-tunes with the LM loss only and with distillation from the source at the same token budget (recipe
recipes/smollm2-135m.yaml, training on the WikiText-2 validation text), evaluates both results the same way, measures
what precomputed top-k teacher logits would cost instead of a teacher loaded alongside, and writes
benchmarks/finetune/README.md with the loop's plots copied beside it.

Every stage keeps its result under runs/bench-finetune/ and is skipped when that result exists (--fresh starts over),
so an interrupted benchmark continues where it stopped. Run it alone on the machine, niced:

    nice python benchmarks/finetune/run.py --tokens 40960
    nice python benchmarks/finetune/run.py --sweep 1e-4,3e-4,1e-3 --sweep-tokens 4096   # short LR sweep, held-out text

The sweep's runs are judged on the loop's held-out tail of the validation text, never on the test text.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks.common import harness  # noqa: E402  (timed mla-convert processes, the machine record)

DATA = Path(os.environ.get("SHARED", REPO.parent / "shared")) / "data" / "wikitext-2"
CALIB = DATA / "wiki.valid.tokens"
TEST = DATA / "wiki.test.raw"
RECIPE = Path("recipes/smollm2-135m.yaml")
STUDENT = Path("out/smollm2-25")
WORK = Path("runs/bench-finetune")
BENCH = Path("benchmarks") / "finetune"
SEQ_LEN, WINDOWS = 2048, 16  # the evaluation's windows of TEST
CONVERT_ARGS = ["llama", "--kv-budget", "0.25", "--calib-data", CALIB, "--overwrite"]  # the student, -o STUDENT
TOPK = (16, 64, 256)


def rel(path: Path | str) -> str:
    """A path as written in the report: relative to the repository root when inside it."""
    p = Path(path).resolve()
    try:
        return str(p.relative_to(REPO))
    except ValueError:
        try:
            return "../" + str(p.relative_to(REPO.parent))
        except ValueError:
            return str(p)


def git_state() -> dict:
    """The full commit and the uncommitted changes that matter to these runs (the library, the recipes)."""
    return {"commit": harness.commit(full=True), "dirty": harness.dirty(("mla_convert/", "recipes/"))}


def env() -> dict:
    return {**os.environ, **harness.OFFLINE}


def timing(command: str, wall_s: float, peak_rss: int, load_before: float, threads: int, where: dict) -> dict:
    """The record of a timed command: wall seconds, peak RSS (wait4), the load average around it, the machine."""
    return {"command": command, "wall_s": round(wall_s, 1), "peak_rss_mib": peak_rss / 2**20,
            "load_avg_1m_before": round(load_before, 2), "load_avg_1m_after": round(os.getloadavg()[0], 2),
            "threads": threads, "machine": where}  # fmt: skip


def timed(cmd: list[str], log: Path, threads: int) -> dict:
    """Run `cmd` (its output into `log`), timed; a failure stops the benchmark with the end of the log."""
    where, load_before = harness.machine(), os.getloadavg()[0]
    run = harness.timed(cmd, log=log, env=env(), threads=threads, echo=True)
    return timing(run.command, run.wall_s, run.peak_rss, load_before, threads, where)


def stage(name: str, fn):
    """Run fn() once: its JSON result is kept in WORK/name.json and reused afterwards."""
    path = REPO / WORK / f"{name}.json"
    if path.is_file():
        return json.loads(path.read_text())
    print(f"== {name}", flush=True)
    result = fn()
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def run_convert(threads: int) -> dict:
    where, load_before = harness.machine(), os.getloadavg()[0]
    run, record = harness.convert(CONVERT_ARGS, STUDENT, log=REPO / WORK / "convert.log", env=env(), threads=threads,
                                  echo=True)  # fmt: skip
    r = timing(run.command, run.wall_s, run.peak_rss, load_before, threads, where)
    return {**r, **git_state(), "method": record.get("method"), "kv_cache": record.get("kv_cache")}


def run_eval(name: str, model: Path | None, threads: int) -> dict:
    where, load_before = harness.machine(), os.getloadavg()[0]
    res = harness.score(model, TEST, SEQ_LEN, WINDOWS, json_out=REPO / WORK / f"eval-{name}.result.json",
                        log=REPO / WORK / f"eval-{name}.log", env=env(), threads=threads)  # fmt: skip
    r = timing(res.pop("command"), res.pop("wall_s"), res.pop("peak_rss"), load_before, threads, where)
    return {**r, **res}


def finetune_cmd(output: Path, kd_weight: float, tokens: int, lr: float | None, threads: int, extra=()) -> list[str]:
    overrides = [f"model={STUDENT}", f"output={output}", f"kd_weight={kd_weight:g}", f"max_tokens={tokens}",
                 f"threads={threads}", "overwrite=true", *extra]
    if lr is not None:
        overrides.append(f"lr={lr:g}")
    return harness.mla("finetune", "--config", RECIPE, *overrides)


def run_finetune(name: str, kd_weight: float, tokens: int, lr: float | None, threads: int, extra=()) -> dict:
    output = WORK / name
    r = timed(finetune_cmd(output, kd_weight, tokens, lr, threads, extra), REPO / WORK / f"{name}.log", threads)
    record = json.loads((REPO / output / "final" / "provenance.json").read_text())
    return {**r, **git_state(), "output": str(output), "kd_weight": kd_weight, "lr": record["options"]["lr"],
            "options": record["options"], "finetune": record["measurements"]["finetune"]}


def measure_topk(cfg_overrides: list[str], sequences: int, threads: int) -> dict:
    """What precomputing the teacher's top-k logits would cost for the training text: teacher forward and top-k time
    per token, the bytes per token stored, and how much of the teacher's probability mass the top k keep."""
    import torch

    from mla_convert import evaluate, finetune

    torch.set_num_threads(threads)
    cfg = finetune.load_config(REPO / RECIPE, cfg_overrides)
    t0 = time.perf_counter()
    teacher, tokenizer, label = evaluate.load_model(None)
    load_s = time.perf_counter() - t0
    train, _ = finetune.prepare_data(cfg, tokenizer)  # [N, T]: the sequences the loop trains on
    vocab = teacher.get_output_embeddings().weight.shape[0]
    forward_s, topk_s = 0.0, {k: 0.0 for k in TOPK}
    mass = {k: 0.0 for k in TOPK}
    tokens = 0
    with torch.inference_mode():
        for ids in train[:sequences]:
            t0 = time.perf_counter()
            logits = teacher(input_ids=ids[None], use_cache=False).logits[0].float()  # [T, V]
            forward_s += time.perf_counter() - t0
            probs = torch.softmax(logits, dim=-1)  # [T, V]
            for k in TOPK:
                t0 = time.perf_counter()
                values, index = logits.topk(k, dim=-1)  # [T, k]
                _ = values.half(), index.int()  # as stored: fp16 logits + int32 token ids
                topk_s[k] += time.perf_counter() - t0
                mass[k] += probs.gather(-1, index).sum().item()
            tokens += ids.numel()
    per_token = {k: 2 * k + 4 * k for k in TOPK}  # fp16 value + int32 index (the vocabulary exceeds int16)
    return {
        "teacher": label, "load_s": round(load_s, 1), "sequences": sequences, "tokens": tokens, "vocab": vocab,
        "teacher_forward_ms_per_token": round(1000 * forward_s / tokens, 3),
        # string keys: the result goes through JSON
        "topk_ms_per_token": {str(k): round(1000 * v / tokens, 4) for k, v in topk_s.items()},
        "topk_probability_mass": {str(k): round(v / tokens, 4) for k, v in mass.items()},
        "bytes_per_token": {str(k): v for k, v in per_token.items()}, "full_fp16_bytes_per_token": 2 * vocab,
        "teacher_parameters": sum(p.numel() for p in teacher.parameters()),
        "teacher_weight_mib": round(sum(p.numel() * p.element_size() for p in teacher.parameters()) / 2**20, 1),
        "threads": threads,
    }


# ------------------------------------------------------------------------------------------------------ report


def held_out_series(output: str) -> list[tuple[int, float]]:
    lines = (REPO / output / "metrics.jsonl").read_text().splitlines()
    return [(r["tokens"], r["perplexity"]) for r in map(json.loads, lines) if r["event"] == "eval"]


def plot_held_out(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, r in runs.items():
        points = held_out_series(r["output"])
        ax.plot([t for t, _ in points], [p for _, p in points], marker="o", label=label)
    ax.set_xlabel("training tokens")
    ax.set_ylabel("held-out perplexity (validation tail)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def fmt_s(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def gap_closed(res: dict, key: str):
    """The share of the converted model's gap to the source that a fine-tuned evaluation closes, on `key`."""
    src, conv = res["eval-source"], res["eval-converted"]
    return lambda e: (conv[key] - e[key]) / (conv[key] - src[key])


def result_section(res: dict, args) -> list[str]:
    """The report's head and its table: every model's test perplexity and the share of the gap it closes."""
    src, conv = res["eval-source"], res["eval-converted"]
    lm, kd = res["finetune-lm"], res["finetune-kd"]
    elm, ekd = res["eval-lm"], res["eval-kd"]
    mix = res.get("finetune-mix")
    closed, closed_nll = gap_closed(res, "perplexity"), gap_closed(res, "nll")
    loads = [r[k] for r in (lm, kd, mix) if r for k in ("load_avg_1m_before", "load_avg_1m_after")]
    lines = [
        "# Fine-tuning SmolLM2-135M after conversion to 25% of its KV cache",
        "",
        "On a GPU (scripts/gpu_finetune.sh, data-free distillation at scale): [gpu.md](gpu.md). Below: the CPU runs.",
        "",
        f"Written by `{args.command_line}` (benchmarks/finetune/run.py). Git commits (the repository is shared and "
        "moved on between stages): " + "; ".join(
            f"{label} `{r['commit'][:10]}`" + (f" (uncommitted changes in {', '.join(r['dirty'])})" if r["dirty"] else "")
            for label, r in [("conversion", res["convert"]), ("LM fine-tune", lm), ("distillation fine-tune", kd)]
            + ([("mixed fine-tune", res["finetune-mix"])] if "finetune-mix" in res else [])) + ".",
        f"Machine: {machine_line(kd)} shared with other jobs (1-minute load average during the fine-tunes: "
        f"{min(loads):.1f}-{max(loads):.1f}), so times are "
        "upper bounds; torch threads per process: " + str(kd["threads"]) + ".",
        "",
        "## Result",
        "",
        "Perplexity on the WikiText-2 raw test text, 16 non-overlapping 2048-token windows from its start, float32 "
        f"(`mla-convert eval MODEL --data {rel(TEST)} --seq-len {SEQ_LEN} --windows {WINDOWS}`):",
        "",
        "| model | test perplexity | gap closed (perplexity) | gap closed (nll) | fine-tune wall time | peak RSS |",
        "|---|---:|---:|---:|---:|---:|",
        f"| source (embedded SmolLM2-135M-Instruct, Q4_1 GGUF de-quantized) | {src['perplexity']:.3f} | | | | |",
        f"| converted, 25% KV cache (`{rel(STUDENT)}`) | {conv['perplexity']:.3f} | 0 | 0 | | |",
        f"| + LM-only fine-tune | {elm['perplexity']:.3f} | {closed(elm):.1%} | {closed_nll(elm):.1%} | "
        f"{fmt_s(lm['wall_s'])} | {lm['peak_rss_mib']:.0f} MiB |",
        f"| + distillation fine-tune | {ekd['perplexity']:.3f} | {closed(ekd):.1%} | {closed_nll(ekd):.1%} | "
        f"{fmt_s(kd['wall_s'])} | {kd['peak_rss_mib']:.0f} MiB |",
    ]
    if mix:
        emx = res["eval-mix"]
        lines.append(f"| + mixed fine-tune (kd_weight {mix['kd_weight']:g}) | {emx['perplexity']:.3f} | "
                     f"{closed(emx):.1%} | {closed_nll(emx):.1%} | {fmt_s(mix['wall_s'])} | {mix['peak_rss_mib']:.0f} MiB |")
    return lines


def runs_section(res: dict) -> list[str]:
    """The reading of the result, the fine-tunes' settings, their runs' table and plots."""
    lm, kd = res["finetune-lm"], res["finetune-kd"]
    elm, ekd = res["eval-lm"], res["eval-kd"]
    mix = res.get("finetune-mix")
    closed, fk, o = gap_closed(res, "perplexity"), kd["finetune"], kd["options"]
    target = closed(ekd) >= 0.5
    lines = []
    lines += [
        "",
        f"Gap closed = (converted - fine-tuned) / (converted - source), on perplexity and on mean nll. Target: "
        f"distillation closes at least half of the perplexity gap: **{'met' if target else 'NOT met'}** "
        f"({closed(ekd):.1%}).",
        "",
        "Reading: at this budget the losses end close together on the test text (LM only "
        f"{elm['perplexity']:.2f}, distillation {ekd['perplexity']:.2f}"
        + (f", mixed {res['eval-mix']['perplexity']:.2f}" if mix else "") + "), while on the loop's held-out tail of "
        f"the validation text the LM loss looks better ({lm['finetune']['held_out_perplexity_after']:.2f} against "
        f"{kd['finetune']['held_out_perplexity_after']:.2f}"
        + (f" and {mix['finetune']['held_out_perplexity_after']:.2f} mixed" if mix else "") + "). That tail is in "
        "the training text's own format (WikiText's tokenized form: `<unk>` for rare words), which the LM loss "
        "learns and the teacher's distribution does not contain; the test text is the raw form. The recipe "
        "(recipes/smollm2-135m.yaml) keeps the teacher in the loss and takes the distilling setting with the lower "
        "held-out perplexity (kd_weight " + (f"{mix['kd_weight']:g}" if mix and mix['finetune']['held_out_perplexity_after']
        < kd['finetune']['held_out_perplexity_after'] else "1") + "); that rule, not the test numbers, decides (the "
        "mixed run was added after the first two had finished).",
        "",
        f"Every fine-tune: {fk['tokens']:,} training tokens ({fk['steps']} optimizer steps of "
        f"{o['seq_len']} x {o['batch_size']} x {o['grad_accum']} tokens) of `{rel(o['data'])}` minus its held-out "
        f"tail, train={o['train']} ({fk['trainable_parameters']:,} of the parameters), AdamW, lr "
        f"{lm['lr']:g} (LM) / {kd['lr']:g} (distillation), {o['schedule']} schedule to {o['min_lr_ratio']:g} x lr "
        f"after {o['warmup']:g} warmup, gradient clipping {o['max_grad_norm']:g}, float32, one process. "
        f"Distillation: kd_weight {o['kd_weight']:g} (pure KL(teacher || student) at temperature "
        f"{o['kd_temperature']:g})" + (f"; mixed: kd_weight {mix['kd_weight']:g} ({1 - mix['kd_weight']:g} x CE + "
                                       f"{mix['kd_weight']:g} x KL)" if mix else "")
        + "; the teacher is the source the student was converted from.",
        "",
        "| run | held-out perplexity before -> after | train loss first -> last (LM: CE; distillation: KL; mixed: "
        "their weighted sum) | "
        "training time (loop) | "
        "teacher forward | student forward+backward | fine-tune command wall | peak RSS | load average before/after |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for label, r in [("LM only", lm), ("distillation", kd)] + ([(f"mixed ({mix['kd_weight']:g})", mix)] if mix else []):
        f = r["finetune"]
        teacher = f"{sum(f['teacher_forward_seconds_per_process']):.0f} s" if f["teacher_forward_seconds_per_process"] else "-"
        lines.append(
            f"| {label} | {f['held_out_perplexity_before']:.2f} -> {f['held_out_perplexity_after']:.2f} | "
            f"{f['loss_first']:.3f} -> {f['loss_last']:.3f} | {fmt_s(f['seconds'])} "
            f"({f['tokens'] / f['seconds']:.0f} tokens/s) | {teacher} | {sum(f['student_seconds_per_process']):.0f} s | "
            f"{fmt_s(r['wall_s'])} | {r['peak_rss_mib']:.0f} MiB | {r['load_avg_1m_before']:.1f} / "
            f"{r['load_avg_1m_after']:.1f} |"
        )
    lines += [
        "",
        f"Held-out: {fk['held_out_protocol']} (the loop's own periodic evaluation; not the test text). The fine-tune "
        "command's wall time includes loading the models, the held-out evaluations and saving; peak RSS is the "
        "maximum resident set of the whole command (ru_maxrss by wait4, what `/usr/bin/time -v` reports). The runs "
        "shared the 2 cores with other "
        "jobs to different degrees (load average column), so compare speeds only within a run (the teacher's "
        "share below), not across runs.",
        "",
        "Plots written by the loop (training loss and held-out perplexity against optimizer steps), and the held-out "
        "perplexity of the runs against training tokens:",
        "",
        "![LM-only fine-tune](finetune_lm.png) ![distillation fine-tune](finetune_kd.png)"
        + (" ![mixed fine-tune](finetune_mix.png)" if mix else ""),
        "",
        "![held-out perplexity](finetune_heldout.png)",
        "",
    ]
    return lines


def teacher_section(res: dict) -> list[str]:
    """The teacher loaded alongside against precomputed top-k logits: what the distillation run measured."""
    lm, kd, topk = res["finetune-lm"], res["finetune-kd"], res["topk"]
    fk = kd["finetune"]
    t_teacher = sum(fk["teacher_forward_seconds_per_process"])
    t_student = sum(fk["student_seconds_per_process"])
    share = t_teacher / (t_teacher + t_student)
    tokens, ms_tok = fk["tokens"], topk["teacher_forward_ms_per_token"]
    return [
        "## Teacher loaded alongside vs precomputed top-k logits",
        "",
        f"The distillation run loads the teacher next to the student and runs it on each batch. Measured in that run: "
        f"the teacher forward took {t_teacher:.0f} s of {t_teacher + t_student:.0f} s of model compute "
        f"(**{share:.0%} of a step**); peak RSS {kd['peak_rss_mib']:.0f} MiB against {lm['peak_rss_mib']:.0f} MiB for "
        f"the LM-only run (+{kd['peak_rss_mib'] - lm['peak_rss_mib']:.0f} MiB: the float32 teacher, "
        f"{topk['teacher_weight_mib']:.0f} MiB of weights, and its [B, T, V] logits).",
        "",
        f"Precomputing instead (measured on the first {topk['sequences']} training sequences, {topk['tokens']:,} "
        f"tokens, {topk['threads']} threads): the teacher forward costs the same {ms_tok:.1f} ms per token "
        f"(here, under the load of the moment) and must run once per training token either way; top-k selection adds "
        + ", ".join(f"{v:.3f} ms (k={k})" for k, v in topk["topk_ms_per_token"].items()) + " per token. Storage for "
        f"this run's {tokens:,} tokens (fp16 logit + int32 token id per entry): "
        + ", ".join(f"k={k}: {tokens * b / 2**20:.1f} MiB" for k, b in topk["bytes_per_token"].items())
        + f"; the full distribution in fp16 would take {tokens * topk['full_fp16_bytes_per_token'] / 2**30:.1f} GiB "
        f"({topk['full_fp16_bytes_per_token']:,} bytes per token). Probability mass of the teacher that the top k keep "
        "(mean over tokens): "
        + ", ".join(f"k={k}: {v:.1%}" for k, v in topk["topk_probability_mass"].items()) + ".",
        "",
        "Choice: **the teacher loaded alongside**. For one pass over the data, precomputing moves the teacher "
        f"forward ({share:.0%} of each step here) out of the training run but not out of the work: the same "
        f"forward runs once per token during precomputation, so the total is unchanged (plus the top-k and the "
        f"writes), while the stored targets are a truncated distribution (the top 64 keep "
        f"{topk['topk_probability_mass']['64']:.1%} of the mass; the rest of the KL target is lost) that has to be "
        f"recomputed whenever the data, the sequence packing or the teacher changes. Loading alongside costs "
        f"memory instead ({kd['peak_rss_mib'] - lm['peak_rss_mib']:.0f} MiB here; on GPU a bf16 copy of the source, "
        "e.g. 16 GB for an 8B model, which recipes/llama-3-8b.yaml budgets for). Precomputed top-k pays off when the "
        "same tokens are seen many times (several epochs, or many runs of a sweep over the same data) or when the "
        "teacher does not fit beside the student; neither holds for these recipes (one pass).",
        "",
    ]


def sweep_section(sweep: dict, res: dict) -> list[str]:
    """The learning-rate sweep's held-out perplexities."""
    lines = [
        "## Learning-rate sweep (held-out validation tail, not the test text)",
        "",
        f"Short runs of {sweep['tokens']:,} tokens each, same recipe otherwise; held-out perplexity after "
        f"(before: {sweep['before']:.2f}). Command: `{sweep['command']}`; student converted at commit "
        f"`{sweep['student']['commit']}` ({sweep['student']['method']})"
        + (" (the default conversion method of that commit; the result above uses a later one)"
           if sweep["student"]["commit"] != res["convert"]["commit"] else "") + ".",
        "",
        "| lr | LM only | distillation |",
        "|---:|---:|---:|",
    ]
    for lr in sorted({r["lr"] for r in sweep["runs"]}):
        cells = []
        for kdw in (0.0, 1.0):
            m = [r for r in sweep["runs"] if r["lr"] == lr and r["kd_weight"] == kdw]
            cells.append(f"{m[0]['held_out_after']:.2f}" if m else "-")
        lines.append(f"| {lr:g} | {' | '.join(cells)} |")
    lines.append("")
    return lines


def commands_section(res: dict) -> list[str]:
    """The commands that made the numbers, with their times."""
    src, conv = res["eval-source"], res["eval-converted"]
    lm, kd = res["finetune-lm"], res["finetune-kd"]
    elm, ekd = res["eval-lm"], res["eval-kd"]
    mix = res.get("finetune-mix")
    c = res["convert"]
    return [
        "## Commands",
        "",
        "```bash",
        f"# conversion (git commit {c['commit']}"
        + (f", uncommitted changes in {', '.join(c['dirty'])}" if c["dirty"] else "")
        + f"; {fmt_s(c['wall_s'])}, peak RSS {c['peak_rss_mib']:.0f} MiB; method: {c['method']})",
        short(c["command"]),
        "# test perplexity of the source and the converted model",
        short(src["command"]),
        short(conv["command"]),
        "# fine-tunes",
        short(lm["command"]),
        short(kd["command"]),
        *([short(mix["command"])] if mix else []),
        "# test perplexity after",
        short(elm["command"]),
        short(ekd["command"]),
        *([short(res["eval-mix"]["command"])] if mix else []),
        "```",
        "",
        "Times: wall clock of each command; evaluation of 16 x 2048 tokens took "
        f"{fmt_s(src['wall_s'])} (source) and {fmt_s(conv['wall_s'])} (converted).",
        "",
    ]


def report(res: dict, sweep: dict | None, args) -> str:
    lines = result_section(res, args) + runs_section(res) + teacher_section(res)
    if sweep:
        lines += sweep_section(sweep, res)
    return "\n".join(lines + commands_section(res))


def machine_line(r: dict) -> str:
    """The machine a stage recorded (stages run before the record: the CPU count of this one)."""
    return f"{harness.describe(r['machine'])}" if r.get("machine") else f"{os.cpu_count()} CPU cores"


def short(cmd: str) -> str:
    """A command as a reader would type it: `mla-convert` on PATH, paths relative to the repository."""
    parts = shlex.split(cmd)
    parts[0] = Path(parts[0]).name
    out = []
    for p in parts:
        if "=" in p and not p.startswith("-"):
            k, v = p.split("=", 1)
            out.append(f"{k}={rel(v) if v.startswith('/') else v}")
        else:
            out.append(rel(p) if p.startswith("/") else p)
    return shlex.join(out)


# ------------------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=None, help="training tokens per fine-tune (default: the recipe's)")
    parser.add_argument("--lr-lm", type=float, default=None, help="LM-only learning rate (default: the recipe's)")
    parser.add_argument("--lr-kd", type=float, default=None, help="distillation learning rate (default: the recipe's)")
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument("--mix", type=float, default=None,
                        help="also a run mixing both losses with this kd_weight (0 < w < 1), same budget")
    parser.add_argument("--topk-sequences", type=int, default=8)
    parser.add_argument("--sweep", default=None, help="comma-separated learning rates: run the short sweep only")
    parser.add_argument("--sweep-tokens", type=int, default=4096)
    parser.add_argument("--sweep-kd-weights", default="0,1")
    parser.add_argument("--fresh", action="store_true", help="delete runs/bench-finetune/ first")
    args = parser.parse_args()
    args.command_line = "python benchmarks/finetune/run.py " + shlex.join(sys.argv[1:])
    os.chdir(REPO)
    from mla_convert import finetune

    if args.fresh and WORK.exists():
        shutil.rmtree(WORK)
    WORK.mkdir(parents=True, exist_ok=True)
    recipe = finetune.load_config(RECIPE)
    tokens = args.tokens or recipe.max_tokens

    if not (STUDENT / "config.json").is_file() or not (WORK / "convert.json").is_file():
        (WORK / "convert.json").unlink(missing_ok=True)
    res = {"convert": stage("convert", lambda: run_convert(args.threads))}

    if args.sweep:
        runs = []
        for lr in map(float, args.sweep.split(",")):
            for kdw in map(float, args.sweep_kd_weights.split(",")):
                name = f"sweep-{'kd' if kdw else 'lm'}-{lr:g}"
                r = stage(name, lambda: run_finetune(name, kdw, args.sweep_tokens, lr, args.threads,
                                                     ["eval_every=0"]))
                runs.append({"lr": lr, "kd_weight": kdw, "held_out_after": r["finetune"]["held_out_perplexity_after"],
                             "held_out_before": r["finetune"]["held_out_perplexity_before"], "wall_s": r["wall_s"]})
                print(f"lr {lr:g} kd_weight {kdw:g}: held-out {runs[-1]['held_out_before']:.2f} -> "
                      f"{runs[-1]['held_out_after']:.2f} ({r['wall_s']:.0f} s)", flush=True)
        sweep = {"tokens": args.sweep_tokens, "runs": runs, "before": runs[0]["held_out_before"],
                 "command": args.command_line, "student": {k: res["convert"][k] for k in ("commit", "dirty", "method")}}
        (WORK / "sweep.json").write_text(json.dumps(sweep, indent=1) + "\n")
        return

    res["eval-source"] = stage("eval-source", lambda: run_eval("source", None, args.threads))
    res["eval-converted"] = stage("eval-converted", lambda: run_eval("converted", STUDENT, args.threads))
    res["finetune-lm"] = stage("finetune-lm", lambda: run_finetune("lm", 0.0, tokens, args.lr_lm, args.threads))
    res["finetune-kd"] = stage("finetune-kd", lambda: run_finetune("kd", 1.0, tokens, args.lr_kd, args.threads))
    res["eval-lm"] = stage("eval-lm", lambda: run_eval("lm", WORK / "lm" / "final", args.threads))
    res["eval-kd"] = stage("eval-kd", lambda: run_eval("kd", WORK / "kd" / "final", args.threads))
    if args.mix is not None:
        res["finetune-mix"] = stage("finetune-mix", lambda: run_finetune("mix", args.mix, tokens, args.lr_kd, args.threads))
        res["eval-mix"] = stage("eval-mix", lambda: run_eval("mix", WORK / "mix" / "final", args.threads))
    res["topk"] = stage("topk", lambda: measure_topk([f"model={STUDENT}", f"max_tokens={tokens}"],
                                                     args.topk_sequences, args.threads))
    sweep_path = WORK / "sweep.json"
    sweep = json.loads(sweep_path.read_text()) if sweep_path.is_file() else None

    BENCH.mkdir(parents=True, exist_ok=True)
    shutil.copy(WORK / "lm" / "loss.png", BENCH / "finetune_lm.png")
    shutil.copy(WORK / "kd" / "loss.png", BENCH / "finetune_kd.png")
    curves = {"LM only": res["finetune-lm"], "distillation": res["finetune-kd"]}
    if "finetune-mix" in res:
        curves[f"mix (kd_weight {args.mix:g})"] = res["finetune-mix"]
        shutil.copy(WORK / "mix" / "loss.png", BENCH / "finetune_mix.png")
    plot_held_out(curves, BENCH / "finetune_heldout.png")
    (BENCH / "finetune.json").write_text(json.dumps({**res, "sweep": sweep}, indent=1) + "\n")
    (BENCH / "README.md").write_text(report(res, sweep, args))
    print(f"wrote {BENCH / 'README.md'}")


if __name__ == "__main__":
    main()
