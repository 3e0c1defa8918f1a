#!/usr/bin/env python
"""8B-class conversions on one box: wall time, peak RSS against the plan's printed estimate, output size, and the
unchanged tensors checked byte for byte.

    OMP_NUM_THREADS=2 python benchmarks/scale/run.py run llama3-8b --layers 4     # build, convert, check, delete
    OMP_NUM_THREADS=2 python benchmarks/scale/run.py run llama3-8b                # all 32 layers
    python benchmarks/scale/run.py run qwen2.5-7b --layers 4
    python benchmarks/scale/run.py plan llama3-70b                                # --dry-run only
    python benchmarks/scale/run.py report                                         # benchmarks/scale/README.md from .json
    python benchmarks/scale/run.py parse LOG                                      # what a row reads from a --log
    python benchmarks/scale/run.py run llama3-8b --device cuda                    # on a machine with a GPU

The checkpoints are random-weight (normal, std 0.02; norms 1; Qwen's q/k/v biases std 0.1), bfloat16 safetensors in
5 GB shards like the published ones, with the published models' config shapes (vocab included, so the embeddings
weigh what they weigh). They live under out/scale/ (never committed) and are deleted after each run unless --keep.
The tokenizer is SmolLM2-135M's (the embedded default's, 49152 tokens): every id it makes is a valid row of the
larger embedding, so calibration runs on real text (WikiText-2 validation, --calib-samples x --calib-seq-len) with
the real vocab size. Random weights calibrate as fast as trained ones: the timing and memory are what a real 8B costs;
the quality is meaningless and not measured here.

The 70B row is a plan only: a config and shards that are all hole (headers declare every tensor, the data is a
sparse file: 0 bytes on disk), enough for `--dry-run`.

Each run is one `mla-convert` process (`benchmarks/common/harness.py`: wall time, ru_maxrss of the child); the estimate is
the one it printed; each row records the machine (`harness.machine`). Results merge into
benchmarks/scale/scale.json by case name.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common import harness  # noqa: E402  (timed mla-convert processes, the machine record)

DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
WORK = ROOT / "out" / "scale"
RESULTS = ROOT / "benchmarks" / "scale" / "scale.json"
REPORT = ROOT / "benchmarks" / "scale" / "README.md"
SHARD_BYTES = 5 * 10**9

SHAPES = {  # the published configs' shapes (dtype bfloat16)
    "llama3-8b": dict(model_type="llama", family="llama", vocab_size=128256, hidden_size=4096,
                      intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, bias=False),
    "qwen2.5-7b": dict(model_type="qwen2", family="qwen", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bias=True),
    "llama3-70b": dict(model_type="llama", family="llama", vocab_size=128256, hidden_size=8192,
                       intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, bias=False),
    "smollm2-135m": dict(model_type="llama", family="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, bias=False),
}  # fmt: skip


def tensor_shapes(shape: dict, layers: int) -> list[tuple[str, list[int]]]:
    """Every tensor of the checkpoint, in the published checkpoints' order."""
    d, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q, kv = shape["num_attention_heads"] * shape["head_dim"], shape["num_key_value_heads"] * shape["head_dim"]
    out = [("model.embed_tokens.weight", [vocab, d])]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", [d]), (p + "post_attention_layernorm.weight", [d])]
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out.append((f"{p}self_attn.{name}.weight", [rows, d]))
            if shape["bias"]:
                out.append((f"{p}self_attn.{name}.bias", [rows]))
        out += [(p + "self_attn.o_proj.weight", [d, q]), (p + "mlp.gate_proj.weight", [inter, d]),
                (p + "mlp.up_proj.weight", [inter, d]), (p + "mlp.down_proj.weight", [d, inter])]
    return out + [("model.norm.weight", [d]), ("lm_head.weight", [vocab, d])]


def random_tensor(name: str, dims: list[int], gen: torch.Generator) -> torch.Tensor:
    """Normal weights (ones for norms) drawn on the generator's device (a GPU draws 16 GB in seconds), on the CPU."""
    if name.endswith("norm.weight"):
        return torch.ones(dims, dtype=torch.bfloat16)
    out = torch.empty(dims, dtype=torch.bfloat16, device=gen.device)
    return out.normal_(0, 0.1 if name.endswith("bias") else 0.02, generator=gen).cpu()


def write_shard(path: Path, tensors: list[tuple[str, list[int]]], make) -> None:
    """A safetensors file written tensor by tensor (header first: the shapes are known), so one tensor is in memory
    at a time. make(name, dims) -> the tensor, or None to leave the data a hole (a sparse file)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dims in tensors:
        size = 2 * int(torch.Size(dims).numel())
        header[name] = {"dtype": "BF16", "shape": dims, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, dims in tensors:
            tensor = make(name, dims)
            if tensor is None:
                f.seek(2 * int(torch.Size(dims).numel()), os.SEEK_CUR)
            else:
                f.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        f.truncate()


def build(name: str, layers: int, folder: Path, sparse: bool = False, tokenizer_from: str | None = None,
          device: str = "cpu") -> Path:
    """A random-weight (or, with `sparse`, all-hole) checkpoint of `name`'s shapes with `layers` layers; the tokenizer
    is the embedded SmolLM2-135M's, or the one saved in `tokenizer_from` (a machine without the embedded model)."""
    from transformers import AutoConfig, AutoTokenizer

    from mla_convert.evaluate import load_model

    shape = dict(SHAPES[name])
    model_type, bias = shape.pop("model_type"), shape.pop("bias")
    shape.pop("family")
    shape["num_hidden_layers"] = layers
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    config = AutoConfig.for_model(model_type, **shape, bos_token_id=1, eos_token_id=2)
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    if tokenizer_from:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    else:
        _, tokenizer, _ = load_model(None)  # SmolLM2-135M's tokenizer (see the docstring)
    tokenizer.save_pretrained(folder)
    gen = torch.Generator(device).manual_seed(0)
    make = (lambda n, d: None) if sparse else (lambda n, d: random_tensor(n, d, gen))
    shards, current, size = [], [], 0
    for tname, dims in tensor_shapes({**SHAPES[name], "bias": bias}, layers):
        nbytes = 2 * int(torch.Size(dims).numel())
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((tname, dims))
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(folder / fname, tensors, make)
        weight_map.update({t: fname for t, _ in tensors})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def trained_layers(prov: dict) -> list[int]:
    """The layers whose MLP and norms the conversion trained, as its provenance (provenance.json, loaded) records
    it: every layer where a model stage of scope layer was kept, else those where whole-layer refinement
    (`--refine-scope layer`) was kept. The model stage's default scope trains attention only."""
    stage, refined = prov["plan"].get("refine_model") or {}, prov["plan"].get("refine") or []
    if stage.get("kept") and stage.get("scope") == "layer":
        return list(range(len(prov["plan"]["ranks"])))
    if prov["options"].get("refine_scope") != "layer":
        return []
    return [r["layer"] for r in refined if r.get("kept")]


def unchanged_identical(src: Path, out: Path, trained: list[int]) -> dict:
    """Every tensor outside self_attn, raw bytes and dtype: those the conversion does not change (compared, how many
    differ) and those of the `trained` layers (how many differ: refinement changed them on purpose)."""
    from mla_convert.checkpoint import open_source

    a, b = open_source(str(src)), open_source(str(out))
    prefixes = tuple(f"model.layers.{i}." for i in trained)
    counts = {"unchanged_tensors": 0, "unchanged_differ": 0, "trained_tensors": 0, "trained_differ": 0}
    for n in a.keys():
        if ".self_attn." in n:
            continue
        x, y = a.get_raw(n), b.get_raw(n)
        same = x.dtype == y.dtype and x.shape == y.shape
        differ = not (same and torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)))
        kind = "trained" if n.startswith(prefixes) else "unchanged"
        counts[f"{kind}_tensors"] += 1
        counts[f"{kind}_differ"] += differ
    return counts


def mla_args(family: str, src: Path, args, *extra: str) -> list[str]:
    """`mla-convert` arguments of a case (without -o)."""
    return [family, str(src), "--kv-budget", str(args.kv_budget), "--calib-data", str(args.calib_file),
            "--calib-samples", str(args.samples), "--calib-seq-len", str(args.seq_len), "--device", args.device,
            *shlex.split(args.options), *extra]  # fmt: skip


def parse_plan(output: str) -> dict:
    estimate = re.search(r"estimated peak memory ([\d.]+) GiB", output)
    attn = re.search(r"attention parameters: ([\d,]+) -> ([\d,]+)", output)
    steps = re.search(r"refinement: (\d+) steps per layer.*; model stage: (\d+) steps?", output)
    cost = re.search(r"time on this CPU[^:]*: about (.+)", output)
    return {"refine_steps": [int(steps.group(1)), int(steps.group(2))] if steps else None,
            "time_estimate": cost.group(1).strip() if cost else None,
            "estimate_gib": float(estimate.group(1)) if estimate else None,
            "attn_params": [int(attn.group(1).replace(",", "")), int(attn.group(2).replace(",", ""))] if attn else None}


def refined_layers(output: str) -> dict:
    """Each refined layer's seconds and held-out error (before, after), from its log line (`stages.refined_layer`),
    which a layer refined in a worker process prints as well (the layer clock then times only the hand-off)."""
    lines = re.findall(r"refine: layer (\d+) held-out error (\S+) -> (\S+) \((?:not )?kept\), ([\d.]+) s", output)
    return {"refine_seconds": {int(n): float(s) for n, _, _, s in lines},
            "refine_error": {int(n): [float(a), float(b)] for n, a, b, _ in lines}}


def read_log(output: str) -> dict:
    """What a row takes from a conversion's output: the plan, the last layer's phase times, each refined layer."""
    layers = re.findall(r"calibration [\d.]+s, factorization [\d.]+s(?:, refine [\d.]+s)?", output)[-1:]
    return {**parse_plan(output), "layer_seconds": layers, **refined_layers(output)}


def save(case: str, row: dict) -> None:
    rows = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    rows[case] = row
    RESULTS.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    report(rows)


def run(args) -> None:
    layers = args.layers or SHAPES[args.shape]["num_hidden_layers"]
    budget = "" if args.kv_budget == 0.25 else f", {args.kv_budget:.0%} budget"
    case = f"{args.shape} {layers} layers, {args.samples} x {args.seq_len}, {args.device}{budget}"
    case += f", {args.options}" if args.options else ""
    src, out = WORK / f"{args.shape}-L{layers}", WORK / f"{args.shape}-L{layers}-mla"
    row = {"shape": args.shape, "layers": layers, "calibration": f"{args.samples} x {args.seq_len}",
           "device": args.device, "kv_budget": args.kv_budget, **harness.machine()}  # fmt: skip
    start = time.perf_counter()
    if not (args.keep and src.exists()):
        build(args.shape, layers, src, tokenizer_from=args.tokenizer, device=args.device)
    row["build_s"] = round(time.perf_counter() - start, 1)
    row["source_bytes"] = folder_bytes(src)
    conv = harness.convert(mla_args(SHAPES[args.shape]["family"], src, args, "--overwrite", "-v"), out).run
    output, wall, rss = conv.output, conv.wall_s, conv.peak_rss
    if args.log:
        args.log.write_text(output)
    row.update(read_log(output), wall_s=round(wall, 1), peak_rss_bytes=rss, output_bytes=folder_bytes(out),
               load_after=[round(x, 2) for x in os.getloadavg()])
    row["peak_over_estimate"] = round(rss / (row["estimate_gib"] * 2**30), 3) if row["estimate_gib"] else None
    prov = json.loads((out / "provenance.json").read_text())
    row["refine_kept_layers"] = trained_layers(prov)
    row["model_stage"] = {k: (prov["plan"].get("refine_model") or {}).get(k) for k in ("kept", "seconds")}
    row.update(unchanged_identical(src, out, row["refine_kept_layers"]))
    print(json.dumps(row, indent=1))
    save(case, row)
    if not args.keep:
        shutil.rmtree(out)
        shutil.rmtree(src)


def plan(args) -> None:
    src = build(args.shape, SHAPES[args.shape]["num_hidden_layers"], WORK / f"{args.shape}-plan", sparse=True)
    output = harness.convert(mla_args(SHAPES[args.shape]["family"], src, args, "--dry-run"), None).run.output
    shutil.rmtree(src)
    lines = [line for line in output.splitlines()
             if not line.startswith(("warning", "dry run", "not refining", "no model stage"))]
    save(f"{args.shape} plan", {"shape": args.shape, "plan": lines, "calibration": f"{args.samples} x {args.seq_len}",
                                **parse_plan(output)})  # fmt: skip


def gib(n: float) -> str:
    return f"{n / 2**30:.2f}"


def steps(r: dict) -> str:
    """The refinement steps per layer and the model stage's, as the plan printed them (rows before they were
    recorded ran on a CPU, where auto skips both at these shapes)."""
    if not r.get("refine_steps"):
        return "- (not recorded; none ran)"
    refine, stage = r["refine_steps"]
    kept = (r.get("model_stage") or {}).get("kept")
    return f"{refine} / {stage}" + (f" (stage {'kept' if kept else 'not kept'})" if stage and kept is not None else "")


def unchanged(r: dict) -> str:
    """Identical / compared; with the tensors whole-layer refinement trained (changed on purpose) beside them."""
    text = f"{r['unchanged_tensors'] - r['unchanged_differ']} / {r['unchanged_tensors']}"
    if r.get("trained_tensors"):
        layers = r["refine_kept_layers"]
        text += (f" (+{r['trained_tensors']} trained, layer{'s' if len(layers) > 1 else ''} "
                 f"{', '.join(map(str, layers))}: {r['trained_differ']} changed)")
    return text


def last_layer(r: dict) -> str:
    """The last layer's seconds a phase; its refinement as its own log line says (rows written before the clock
    named a worker's hand-off apart carry a `refine` lap of about 0 for it)."""
    text, refined = "; ".join(r.get("layer_seconds") or ["-"]), r.get("refine_seconds")
    if not refined:  # rows from before the log line was read, and runs that did not refine
        return text
    return re.sub(r", refine [\d.]+s", "", text) + f", refine {refined[max(refined, key=int)]:.1f}s"


def report(rows: dict) -> None:
    runs = [(k, r) for k, r in rows.items() if "wall_s" in r]
    lines = [
        "# 8B-class conversions on one box",
        "",
        "Written by `python benchmarks/scale/run.py` (its docstring: random-weight bfloat16 checkpoints of the published",
        "shapes, SmolLM2's tokenizer, WikiText-2 validation for calibration; deleted after each run). One `mla-convert`",
        "process per row, default options except `--kv-budget` and the calibration size; peak RSS is the child's",
        "ru_maxrss, the estimate is the one the plan printed (`Plan.memory_estimate`, explained below).",
        "",
        "| case | wall | per layer (last) | peak RSS GiB | estimate GiB | peak / estimate | source GB | output GB | "
        "attention params | refinement / model stage steps | unchanged tensors identical | load before / after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case, r in runs:
        attn = r.get("attn_params") or [0, 0]
        lines.append(
            f"| {case} | {r['wall_s'] / 60:.1f} min | {last_layer(r)} | "
            f"{gib(r['peak_rss_bytes'])} | {r['estimate_gib']:.2f} | {r['peak_over_estimate']:.2f} | "
            f"{r['source_bytes'] / 1e9:.1f} | {r['output_bytes'] / 1e9:.1f} | {attn[0] / 1e9:.2f} G -> "
            f"{attn[1] / 1e9:.2f} G | {steps(r)} | {unchanged(r)} | {r['load_before'][0]} / {r['load_after'][0]} |"
        )
    for case, r in rows.items():
        if "progress" in r:  # a run still going when the report was written: what its monitor saw so far
            lines.append(f"| {case} (unfinished) | {r['progress']} | | {gib(r['peak_rss_bytes'])} so far | "
                         f"{r['estimate_gib']:.2f} | {r['peak_rss_bytes'] / (r['estimate_gib'] * 2**30):.2f} | "
                         f"{r['source_bytes'] / 1e9:.1f} | | | | | |")
    timed = [(case, r) for case, r in runs if r.get("time_estimate")]
    if timed:
        lines += ["", "Time against the estimate `--dry-run` prints for the same command (its phases in minutes):", "",
                  "| case | estimate | wall | refinement a layer | model stage |", "|---|---|---|---|---|"]
        for case, r in timed:
            per_layer = sorted(r["refine_seconds"].items(), key=lambda kv: int(kv[0]))  # JSON keys are strings
            layers = ", ".join(f"{s / 60:.1f} min" for _, s in per_layer) or "-"
            stage = (r.get("model_stage") or {}).get("seconds")
            lines.append(f"| {case} | {r['time_estimate']} | {r['wall_s'] / 60:.1f} min | {layers} | "
                         f"{f'{stage / 60:.1f} min' if stage is not None else '-'} |")
    machines = {(r["machine"], r["cores"], r["torch_threads"], r["cuda"]) for _, r in runs}
    lines += ["", "Machines: " + "; ".join(f"{m}, {c} cores, torch threads {t}" + (f", {g}" if g else "")
                                          for m, c, t, g in sorted(machines, key=str)), ""]  # fmt: skip
    for case, r in rows.items():
        if "plan" in r:
            lines += [f"## {case} (`--dry-run`, calibration {r['calibration']})", "", "```", *r["plan"], "```", ""]
    REPORT.write_text("\n".join(lines).rstrip() + "\n" + NOTES)


NOTES = """
## What the estimate counts (`Plan.memory_parts`, printed by the plan and `--dry-run`)

Resident for the whole run: the runtime (Python, torch, transformers, the tokenizer: 0.6 GiB counted, 0.4-0.5 GiB
measured) and the calibration hidden states (float32, three copies). Never resident: the embeddings, lm_head and the
other layers. Layers stream from the source one at a time, read with plain file reads (no memory-mapped shard pages
stay mapped: a mapped 5 GB shard counts in the resident set until it is closed, which is most of what the first 8B
run measured, 5.9 GB against an estimate of 3.4 GiB). The shards are written last, from the kept layer files, by a
writer holding at most one 2 GiB shard. Tensors the conversion does not change (embeddings, lm_head, norms, MLP) are
copied through as stored, in their own dtype, never as float32; the "unchanged" column checks them byte for byte.
Where whole-layer refinement (`--refine-scope layer`, the default when it refines) was kept, that layer's MLP and norms
were trained on purpose: they are counted apart.

At its heaviest a layer holds its tensors as stored, its attention in float32, its calibration statistics (float64
[D+1, D+1]: 2 second moments plus one per kv group for the attended values: 1.25 GiB at 8B shapes) and the larger of
the calibration phase (the float32 decoder layer the calibration runs; one group's attended-input product; one
sample's attention activations) and the factorization phase (the float64 RoPE-split maps and the solver's [D, D]
copies). The writing phase (one shard and one kept layer) is counted when it is the heavier one (no calibration).

The printed estimate is 1.15 x the modelled parts. The factor covers what the model leaves out: short-lived copies
inside torch operations, the allocator's pages between frees, the tokenizer's and Python's growth. It is set from
these runs: the measured peak should sit between 0.8 and 1.0 of the estimate.

Depth costs nothing: nothing but the runtime, the hidden states and the current layer is resident, so 32 layers peak
where 4 do (`tests/test_scale.py` checks that the estimate does not grow with depth; the rows above measure it).
With `--rank-allocation energy` every layer's statistics are held until the ranks are chosen (the estimate adds them:
about 39 GiB at 32 layers of 8B shapes; use the uniform default at this size).

## Runs and machine

The 4-layer rows and the Qwen row ran on a shared 2-core machine with other jobs running (load average about 10 on 2
cores: their wall times are upper bounds, several times a quiet machine's); `OMP_NUM_THREADS=2`. The 32-layer row
was re-run on the code of 2026-11-23 on a quiet machine (load about 1-2): 9.5 min wall, 7 s calibration and 10 s
factorization per layer. The first 4-layer run used earlier code (noted in benchmarks/scale/scale.json), which peaked in
the calibration statistics on 1 GB float64 temporaries (the attended-input products of all kv groups at once, and
a divided copy of the attended moments); both are gone since (one group at a time, division in place). The depth check,
same code: 3.58 GiB at 4 layers, 3.65 GiB at 32 (+2%), both 0.83-0.84 of the printed 4.32 GiB. An earlier 32-layer
run on the older code peaked at 4.59 GiB (estimate 5.02) against 4.45 GiB at 4 layers with that code. The CPU rows
predate two later defaults: the nope query/key narrowed to head_dim - d_r (`--nope-dims`, 2026-11-24: smaller query
and key maps, so fewer attention parameters and a slightly smaller output) and refinement (which auto skips on this CPU
at these shapes, so their conversion work is unchanged). The 70B plan below is today's code.

The `cuda` rows ran on lent NVIDIA H200s (16 cores): `python benchmarks/scale/run.py run llama3-8b --layers N
--device cuda [--kv-budget 0.5] --tokenizer .dev/tokenizer --calib-file .dev/wiki.valid.tokens` (that machine has
neither the embedded model nor ../shared, so the tokenizer and the text were carried; `scripts/gpu_checks.sh` runs it
with the CUDA tests and the decode benchmark). On a GPU the defaults refine every layer (whole layer, every position
of the window: 200 steps at 25%, 300 at 50%) and run the model stage (64 steps), which auto skips on this CPU at 8B
shapes (hours). The 8-layer rows (2026-11-30, commit abc6cc3 plus the random weights drawn on the GPU: 15-17 s to
build 5.6 GB) at 25%: per layer calibration 0.5-0.6 s, factorization 0.1 s, refinement 13.4 s (11.9 s of training,
the rest its targets and held-out checks), after a 6 s statistics pass over all 8; the model stage 12.7 s; 163 s in
all, of which about 30 s are the process start and the shards' reads and writes; host memory peaked at 0.67 of the
printed estimate (the 0.8-1.0 above is the CPU's). At 50%: refinement 19.6 s a layer,
the model stage 14.8 s, 210 s in all. The 4-layer row (2026-11-26, older code) measured the same per layer (12.7 s).
The 32-layer conversion on a GPU was not run (15 minutes of device time a session). From the 8-layer rows it takes
about 32 x 14.8 s = 8 min of layer work at 25% (32 x 21 s = 11 min at 50%), plus a model stage of 32 layers (about
1 min) and 16 GB of shards read and written (about 1.5 min): about 10 min at 25% and 14 min at 50%, an extrapolation,
not a measurement. With `--refine-steps 0 --refine-model-steps 0` the layer work is under 1 s a layer. On the random
weights refinement is kept only where it lowers the held-out error (layers 0 and 4-7 at 25%), so those layers' MLP
and norms changed; the other tensors are byte-identical (the "unchanged" column).

What refining an 8B model would cost on the 2-core CPU, by the estimate `auto` decides on (`mla-convert llama SRC
--kv-budget B --dry-run` on an all-hole 32-layer checkpoint of Llama-3-8B's shapes, 2026-11-30, 2 Intel Xeon cores
with AMX, the bfloat16 rate refitted that day): with the data-free default's text (16 or 32 windows of 2048 tokens)
3.3 h at 25% (200 steps at 256 positions) and 10.9 h at 50% (600 steps), and from 1 x 512 tokens of a file
(`--calib-data wiki.valid.tokens --calib-samples 1 --calib-seq-len 512`) 11.7 h and 36.0 h (a step then takes four
512-token windows' positions where a 2048-token window's step takes one 256-position subset): `auto` skips it over
1.5 h, and says so. The
data-free default's text alone is about 2 h to sample on that CPU at 25% (`--dry-run`: self text 121 min), and its
statistics through 32 layers 4.7 h (calibration 282 min), which is why the runs above calibrate from a file.

Measured on the same CPU (the "Time against the estimate" table;
docs/decisions.md#time-estimate-and-when-auto-refines-on-a-cpu): 2 of the 32 layers with the default's text shape (16 x 2048 tokens of WikiText-2 validation), 25%,
every other option the default. At 2 layers the estimate is 42 min, so `auto` refined them: 200 bfloat16 steps a
layer at 256 positions, the two layers at once in workers of 1 thread, 553 s and 526 s, 9.2 min of wall time for
both (the estimate: 10), about 4.6 min a layer, 2.5 h for 32 layers; the model stage (32 steps) 19.2 min (20); the
run 43.3 min (42). On these random weights neither layer's refinement was kept: the held-out error rose (0.50 ->
29.4, 0.022 -> 11.8), and in float32 too (one layer, `--options "--refine-precision float32 --refine-model-steps
0"`: 0.49 -> 959, 10.1 min a layer on 2 threads against an estimate of 17, the float32 rate being fitted on cores
without bfloat16 arithmetic). The held-out check keeps the closed form; whether a trained 8B keeps its refinement
on a CPU is not measured here.

SmolLM2-135M's shapes (`smollm2-135m`: random weights, untied head) on the same H200 (2026-11-30, built with `build`
on the GPU, then `mla-convert llama SRC --kv-budget 0.25 --device cuda -v`, the data-free default): 98 s in all,
the self text sampled on the GPU, a 6 s statistics pass, then 1.3-1.5 s a layer (200 whole-window steps of about
5.8 ms: bound by kernel launches, not arithmetic, at this size) and the model stage (64 steps). At 50% (300 steps)
the layers took 2.4-2.6 s each; that run was stopped by the session's device time after 5 layers. On random weights
the model stage is not kept (its held-out KL starts at 0.0018 and rises): the times are what the phases cost, the
quality is not meaningful. The 2-core CPU's estimate for the same 25% run is 20 min.

Attention parameters: with today's defaults they shrink a little (4 layers of 8B shapes: 0.168 G -> 0.145 G, the
4-layer `cuda` row; the 70B plan: 12.08 G -> 11.13 G), because the nope query/key is narrowed to head_dim - d_r.
Before that default the MLA query carried a rope part per head on top of the full head (`q_proj` [H (d_h + d_r), D])
and they grew (the CPU rows: 1.34 G -> 1.44 G at 32 layers). The KV cache is what shrinks (4x at `--kv-budget 0.25`).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "plan"):
        p = sub.add_parser(name)
        p.add_argument("shape", choices=sorted(SHAPES))
        p.add_argument("--layers", type=int, default=None, help="fewer layers than the published model")
        p.add_argument("--kv-budget", type=float, default=0.25)
        p.add_argument("--samples", type=int, default=1)
        p.add_argument("--seq-len", type=int, default=512)
        p.add_argument("--device", default="cpu")
        p.add_argument("--calib-file", type=Path, default=DATA / "wiki.valid.tokens",
                       help="calibration text (default: WikiText-2 validation from ../shared)")
        p.add_argument("--log", type=Path, default=None, help="write the conversion's output to this file")
        p.add_argument("--tokenizer", default=None,
                       help="a saved tokenizer folder instead of the embedded SmolLM2-135M's (a machine without it)")
        p.add_argument("--keep", action="store_true", help="keep (and reuse) the source and output folders")
        p.add_argument("--options", default="", help="more mla-convert options, one string (named in the case)")
    sub.add_parser("report")
    parse = sub.add_parser("parse", help="print as JSON what a row takes from a conversion's saved output (--log), "
                           "and the report's per-layer column for it")
    parse.add_argument("log", type=Path)
    args = parser.parse_args()
    if args.command == "run":
        run(args)
    elif args.command == "plan":
        plan(args)
    elif args.command == "parse":
        row = read_log(args.log.read_text())
        print(json.dumps({**row, "last_layer": last_layer(row)}, indent=1))
    else:
        report(json.loads(RESULTS.read_text()))


if __name__ == "__main__":
    main()
