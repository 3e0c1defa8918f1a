#!/usr/bin/env python
"""Quality per cache byte: the source with each cache type the engines offer against our conversions with each
latent cache type, on the three development domains, relative to the source on the same windows.

    python benchmarks/frontier/run.py --models 25=out/smollm2-135m-mla-25,50=out/smollm2-135m-mla-50 \
        [--windows 4] [--seq-len 2048] [--source-types f16,q8_0,...] [--latent-types f16,q8_0,...] \
        [--bases native,balanced] [--out benchmarks/frontier]

Routes (one line each on the chart):
  source, llama.cpp   the source's keys and values as llama.cpp stores them (tokens in the GGUF's order, a Hadamard
                      rotation of each quantized head since April 2026, ggml's blocks, the query rounded as its CPU
                      flash attention takes it): `kvquant.read_source_cache_as`.
  source, unrotated   the same without the rotation (llama.cpp before April 2026, or LLAMA_ATTN_ROT_DISABLE=1).
  MODEL, BASIS        a conversion whose cached row [latent, rope key] is stored in each cache type
                      (`latent_cache_type`), its latent in BASIS (mla_convert.latent_basis; folded in memory).
  LABEL, llama.cpp (real)  a GGUF (`--gguf LABEL=FILE`; `source=auto`: the embedded default re-typed to f32;
                      LABEL=FOLDER: a `--target deepseek` conversion, exported to out/frontier-gguf/LABEL.gguf in f32
                      weights, as `mla-convert export --format gguf` writes it) run in llama.cpp itself with each
                      of its cache types (`--gguf-types`, flash attention on), on the same
                      token ids; bytes per token from llama.cpp's own allocation log. A GGUF exported from a
                      `--models` folder of the same LABEL gets its parity column: llama.cpp against the simulation.
Simulated points are transformers with ggml's rounding bit for bit (tests/test_kvquant.py); real ones are labelled
with the engine. Bytes per token are all layers' cached rows in the cache type
(ggml's block sizes). The balanced basis is fitted on the first windows of the conversion's own calibration text
(`--calib`, default the data-free self text the conversion sampled), never on a development text.
Writes OUT/frontier.json (rewritten after each point: a stopped run keeps what it measured; `--keep` measures only
the points it lacks, on the same windows), OUT/frontier.md (the
table) and OUT/frontier.png (x: bytes per token, log scale; y: perplexity ratio to the source, the geometric mean
over the domains).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

DEV = ROOT / "out" / "dev"
TEXTS = {"wiki-dev": DEV / "wiki.valid.second-half.tokens", "devref-dev": DEV / "devref.txt",
         "fortunes-dev": DEV / "fortunes.txt"}  # fmt: skip
SOURCE_TYPES = "f16,q8_0,q5_0,q4_1,q4_0,iq4_nl"
LATENT_TYPES = "f16,q8_0,q5_0,q4_0,iq4_nl"


class Points:
    """frontier.json's points: `record` adds one (the file rewritten at once), `has` says whether `--keep` may
    reuse one already measured."""

    def __init__(self, data: dict, path: Path, keep: bool):
        self.data, self.path, self.keep = data, path, keep

    def has(self, route: str, kind: str) -> bool:
        return self.keep and any((p["route"], p["cache"]) == (route, kind) for p in self.data["points"])

    def __call__(self, route, kind, byte_count, ppl, measured="simulated (transformers, ggml rounding)") -> None:
        points = [p for p in self.data["points"] if (p["route"], p["cache"]) != (route, kind)]
        self.data["points"] = points + [{"route": route, "cache": kind, "bytes_per_token": byte_count,
                                         "perplexity": ppl, "measured": measured, "at": time.strftime("%F %T")}]
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")
        scores = "  ".join(f"{t} {v:.3f}" for t, v in ppl.items())
        print(f"{route:28s} {kind:6s} {byte_count:9,.0f} B/token  {scores}", flush=True)


def perplexities(model, ids: dict, args) -> dict:
    from mla_convert.evaluate import perplexity

    return {name: perplexity(model, t, args.seq_len, args.windows, progress=False)["perplexity"] for name, t in ids.items()}


def calibration_windows(model, args, count: int = 4):
    """The first `count` windows of the calibration text a default conversion to this model's share of the cache
    reads (`--calib self`: the self text at its temperature, from the cache the conversion filled), or of a text."""
    from mla_convert.conversion import selftext
    from mla_convert.conversion.calibration import calibration_tokens
    from mla_convert.checkpoint import open_source
    from mla_convert.latent_basis import cache_kept

    temperature = args.calib_temperature or selftext.calib_temperature(cache_kept(model.config))
    return calibration_tokens(open_source(args.source), args.calib, count, args.seq_len, seed=0,
                              temperature=temperature)


def source_points(args, ids: dict, record) -> None:
    from mla_convert import evaluate, kvquant

    model, _, _ = evaluate.load_model(args.source)
    layers, row = model.config.num_hidden_layers, 2 * model.config.num_key_value_heads * model.config.head_dim
    for rotation, kinds in ((True, args.source_types), (False, args.unrotated_types)):
        for kind in [k for k in kinds.split(",") if k]:
            route = "source, llama.cpp" if rotation else "source, unrotated"
            if record.has(route, kind):
                continue
            kvquant.read_source_cache_as(model, kind, rotation=rotation)
            record(route, kind, layers * kvquant.row_bytes(row, kind), perplexities(model, ids, args))


def model_points(label: str, folder: str, kinds: list, args, ids: dict, record) -> None:
    from transformers import AutoModelForCausalLM

    import mla_convert  # noqa: F401
    from mla_convert import evaluate, kvquant, latent_basis

    model, _, _ = evaluate.load_model(folder)
    d_r = model.config.qk_rope_head_dim
    moments = None
    for basis in args.bases.split(","):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype).eval()
        if basis != "native":
            if moments is None:
                moments = latent_basis.latent_moments(model, calibration_windows(model, args))
            latent_basis.apply_basis(model, basis, moments)
        for kind in kinds:
            if kind in ("f16", "f32") and basis != "native":
                continue  # a basis changes nothing in 16 bits
            if record.has(f"{label}, {basis}", kind):
                continue
            model.config.latent_cache_type = None if kind == "f32" else kind
            byte_count = sum(kvquant.latent_row_bytes(r, d_r, kind) for r in model.config.kv_lora_ranks)
            record(f"{label}, {basis}", kind, byte_count, perplexities(model, ids, args))


def gguf_points(label: str, gguf: str, kinds: list, args, ids: dict, record) -> None:
    """`label`'s GGUF in llama.cpp itself at each cache type of `kinds` the file takes (flash attention for quantized
    types); the source's (`auto`) is the embedded default re-typed to f32 by llama.cpp."""
    from mla_convert.serving import llamacpp

    if gguf == "auto":
        from benchmarks.llamacpp.run import source_gguf

        gguf = str(source_gguf(ROOT / "out"))  # weights stay out of benchmarks/ (out/ is ignored)
    elif Path(gguf).is_dir():
        gguf = str(exported_gguf(label, Path(gguf)))
    layout = llamacpp.gguf_mla_layout(gguf)
    for kind in kinds:
        if record.has(f"{label}, llama.cpp (real)", kind):
            continue
        quantized = kind not in llamacpp.FLOAT_CACHE_TYPES
        if layout and quantized and not llamacpp.quantized_cache_ok(*layout):
            print(f"{label}: skips {kind}: " + llamacpp.llamacpp_cache_types(*layout), flush=True)
            continue
        runs = {name: llamacpp.llamacpp_perplexity(gguf, t, args.seq_len, args.windows, cache_type=kind)
                for name, t in ids.items()}  # fmt: skip
        first = next(iter(runs.values()))
        record(f"{label}, llama.cpp (real)", kind, first["kv_cache_bytes_per_token"],
               {name: r["perplexity"] for name, r in runs.items()},
               measured=f"real: {first['engine']}, flash attention " + ("on" if quantized else "off"))


def specs(text: str, default_types: str) -> list[tuple[str, str, list]]:
    """`LABEL=PATH[@TYPE+TYPE...],...` as (label, path, cache types); no @: `default_types` (comma-separated)."""
    out = []
    for spec in [s for s in text.split(",") if s]:
        label, _, rest = spec.partition("=")
        path, _, kinds = rest.partition("@")
        out.append((label, path, kinds.split("+") if kinds else default_types.split(",")))
    return out


def exported_gguf(label: str, folder: Path) -> Path:
    """`folder` (a native conversion made with `--target deepseek`) as llama.cpp reads it: the GGUF the user's
    `mla-convert export FOLDER --format gguf` writes (f32 weights, like the source's), re-written when the folder's
    weights are newer."""
    from mla_convert.export.gguf import export_gguf

    out = ROOT / "out" / "frontier-gguf" / f"{label}.gguf"
    weights = max(p.stat().st_mtime for p in folder.glob("*.safetensors"))
    if not out.is_file() or out.stat().st_mtime < weights:
        out.parent.mkdir(parents=True, exist_ok=True)
        export_gguf(folder, out, "f32", overwrite=True)
    return out


def reference_for(point: dict, points: list) -> dict:
    """The source's 16-bit point a ratio is taken against: llama.cpp's own for a real llama.cpp point (where
    measured), the simulated one otherwise."""
    real = [p for p in points if p["route"] == "source, llama.cpp (real)" and p["cache"] == "f16"]
    simulated = [p for p in points if p["route"] == "source, llama.cpp" and p["cache"] == "f16"]
    return (real if point["route"].endswith("(real)") and real else simulated or real)[0]


def parity(point: dict, points: list) -> str:
    """A real llama.cpp point of a GGUF against the simulation of its folder (route `LABEL, native`, same type)."""
    if not point["route"].endswith(", llama.cpp (real)") or point["route"].startswith("source,"):
        return ""
    label = point["route"][: -len(", llama.cpp (real)")]
    twin = [p for p in points if p["route"] == f"{label}, native" and p["cache"] == point["cache"]]
    if not twin:
        return ""
    diffs = [point["perplexity"][t] / twin[0]["perplexity"][t] - 1 for t in point["perplexity"]]
    return " / ".join(f"{d:+.2%}" for d in diffs)


def geomean(values) -> float:
    values = list(values)
    return math.exp(sum(math.log(v) for v in values) / len(values))


def report(data: dict, out: Path) -> None:
    points = data["points"]
    full = reference_for({"route": ""}, points)["bytes_per_token"]  # the source's 16-bit cache: fractions of it
    lines = ["| route | cache type | bytes per token (all layers) | fraction of the source's 16-bit | "
             + " | ".join(f"{t} ratio" for t in data["texts"]) + " | geometric mean | measured | llama.cpp vs "
             "simulation (per domain) |", "|---|---|---:|---:|" + "---:|" * len(data["texts"]) + "---:|---|---|"]
    for p in sorted(points, key=lambda p: (-p["bytes_per_token"], p["route"])):
        source = reference_for(p, points)
        ratios = [p["perplexity"][t] / source["perplexity"][t] for t in data["texts"]]
        p["ratio"] = geomean(ratios)
        lines.append(f"| {p['route']} | {p['cache']} | {p['bytes_per_token']:,.0f} | {p['bytes_per_token'] / full:.3f} | "
                     + " | ".join(f"{r:.3f}" for r in ratios) + f" | {p['ratio']:.3f} | {p['measured']} | "
                     + f"{parity(p, points)} |")
    (out / "frontier.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for route in dict.fromkeys(p["route"] for p in points):
        line = [p for p in points if p["route"] == route]
        model, _, basis = route.partition(", ")
        if basis not in ("native", "llama.cpp", "unrotated", "llama.cpp (real)"):  # a basis: 16 bits as native
            line += [p for p in points if p["route"] == f"{model}, native" and p["cache"] in ("f16", "f32")]
        line.sort(key=lambda p: p["bytes_per_token"])
        style = dict(marker="s", linestyle="--") if route.endswith("(real)") else dict(marker="o")
        ax.plot([p["bytes_per_token"] for p in line], [p["ratio"] for p in line], label=route, **style)
        for p in line:
            ax.annotate(p["cache"], (p["bytes_per_token"], p["ratio"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    for share in (0.125, 0.25):
        ax.axvline(share * full, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"1/{round(1 / share)} of the source's bytes", (share * full, ax.get_ylim()[1]), fontsize=7,
                    rotation=90, va="top", ha="right")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("KV-cache bytes per token, all layers (log)")
    ax.set_ylabel("perplexity / source's (16-bit), geometric mean of 3 dev domains")
    ax.set_title(f"SmolLM2-135M: quality per cache byte ({data['windows']} x {data['seq_len']} tokens per domain)\n"
                 "dashed: llama.cpp itself; solid: simulated in transformers, ggml rounding", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="", help="LABEL=FOLDER[@TYPE+TYPE],... (converted MLA folders; their "
                    "latent cache types, else --latent-types)")
    ap.add_argument("--source", default=None, help="the source (default: the embedded default)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--source-types", default=SOURCE_TYPES)
    ap.add_argument("--unrotated-types", default="q8_0,q4_0", help="the source's types without llama.cpp's rotation")
    ap.add_argument("--latent-types", default=LATENT_TYPES)
    ap.add_argument("--bases", default="native,balanced")
    ap.add_argument("--calib", default="self", help="text the balanced basis is fitted on (a conversion's spec)")
    ap.add_argument("--calib-temperature", type=float, default=None,
                    help="the self text's temperature, where the conversions were made with --calib-temperature")
    ap.add_argument("--gguf", default="", help="LABEL=FILE,... GGUFs run in llama.cpp itself (source=auto: the "
                    "embedded default re-typed to f32; LABEL=FOLDER: a --target deepseek conversion, exported; "
                    "@TYPE+TYPE: its cache types, else --gguf-types)")
    ap.add_argument("--gguf-types", default="f16,q8_0,q5_1,q5_0,q4_1,q4_0,iq4_nl", help="llama.cpp cache types")
    ap.add_argument("--texts", default="", help="NAME=FILE,... instead of the three development domains")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "frontier")
    ap.add_argument("--keep", action="store_true", help="measure only the points OUT/frontier.json lacks")
    ap.add_argument("--report-only", action="store_true", help="rewrite the table and chart from frontier.json")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "frontier.json"
    if args.report_only:
        report(json.loads(path.read_text()), args.out)
        return
    import torch

    from mla_convert import evaluate
    from mla_convert.data import load_text

    from benchmarks.quality import run as bench_quality

    texts = dict(pair.split("=", 1) for pair in args.texts.split(",") if pair) or TEXTS
    if texts is TEXTS:
        bench_quality.prepare_texts()
    _, tokenizer, _ = evaluate.load_model(args.source)
    ids = {name: evaluate.tokenize(tokenizer, load_text(str(p))) for name, p in texts.items()}
    data = json.loads(path.read_text()) if path.is_file() else {"points": []}
    protocol = {"texts": list(texts), "windows": args.windows, "seq_len": args.seq_len}
    if data["points"] and any(data.get(k) != v for k, v in protocol.items()):
        sys.exit(f"{path} holds points on other windows ({ {k: data.get(k) for k in protocol} }): choose another "
                 "--out, or pass the same --texts, --windows and --seq-len")
    data.update(protocol, threads=torch.get_num_threads(), machine=platform.processor() or platform.machine())
    record = Points(data, path, keep=args.keep)
    if args.source_types or args.unrotated_types:
        source_points(args, ids, record)
    for label, gguf, kinds in specs(args.gguf, args.gguf_types):
        gguf_points(label, gguf, kinds, args, ids, record)
    for label, folder, kinds in specs(args.models, args.latent_types):
        model_points(label, folder, kinds, args, ids, record)
    report(data, args.out)


if __name__ == "__main__":
    main()
