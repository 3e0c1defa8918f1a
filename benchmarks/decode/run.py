#!/usr/bin/env python
"""Decode speed and KV-cache bytes: the source GQA model against the converted MLA model in each decode form.

Two measurements, every ratio taken within the same run:

1. One attention layer, one decode step (projections, RoPE, cache write, attention, o_proj) over a cache pre-filled
   to the context length, for each form (docs/method.md section 5):
     source    the GQA source layer (LlamaAttention, sdpa), caching K and V per kv head
     CD        converted weights, caching the expanded per-group K/V (what the public converters do)
     CC        cache the latent, expand it to K/V every step (the model's "expanded" mode): the naive path
     A_CC      absorbed; scores against concat([c, k_r]) (copies the cache every step)
     A_CC_ME   absorbed; nope and rope scores taken apart and added (the model's torch decode path)
     triton    A_CC_ME with the Triton kernel (CUDA only)
   The cache is a fixed buffer of context+1 rows; each step overwrites the last row, so every timed step sees the same
   context (as a serving engine's preallocated cache would).
2. The whole model, tokens per second, with transformers' DynamicCache pre-filled to the context length with random
   values (no prefill is timed: decode cost does not depend on the values); then the same over a preallocated
   StaticCache ("static", what `generate(..., cache_implementation="static")` uses) and, on CUDA, that static step
   captured in a CUDA graph ("graph"), each against the source model run the same way (`--skip-static`: neither).

On CUDA it also times the attention core alone at the same shapes (the Triton kernel, the model's torch absorbed path,
the float32 reference, the source's GQA sdpa), as GPU time per call from CUDA-graph replays over rotating input sets,
and reports the achieved bandwidth (cache bytes read per second) against the measured device copy bandwidth.

Weights: `--from-config` (default) builds SmolLM2-135M-shaped models with random weights (timing does not depend on
weight values); `--model DIR` loads a converted folder (the source is `--source` if given, else built from the
converted config with random weights).

The numbers in benchmarks/decode/README.md (a 2-core CPU shared with other jobs, hence one thread and the CPU clock):
    OMP_NUM_THREADS=1 nice python benchmarks/decode/run.py --threads 1 --clock cpu --json benchmarks/decode/decode.json
On CUDA (adds the Triton kernel, the attention-core table and its before/after), the numbers in
benchmarks/decode_gpu/README.md (H100):
    python benchmarks/decode/run.py --device cuda --contexts 1k,2k,4k,8k,16k,32k,64k --batches 1,8,32 \
        --model-contexts 1k,8k,32k --model-batches 1,8,32 --model-budget 1.5 \
        --kernel-baseline benchmarks/decode_gpu/decode_gpu.before.json \
        --out benchmarks/decode_gpu/README.md --json benchmarks/decode_gpu/decode_gpu.json \
        --plot benchmarks/decode_gpu/decode_gpu.png
The whole-model table alone, with the static-cache forms (benchmarks/decode/decode_static.md, CPU):
    OMP_NUM_THREADS=1 nice python benchmarks/decode/run.py --threads 1 --clock cpu --skip-layer \
        --model-contexts 1k,8k --model-batches 1,8 --out benchmarks/decode/decode_static.md \
        --json benchmarks/decode/decode_static.json
The Triton kernel's launch-knob sweep (benchmarks/decode_gpu/decode_gpu.sweep.json, which chose the kernel's defaults):
    python benchmarks/decode/run.py --skip-layer --skip-model --skip-kernel \
        --kernel-sweep benchmarks/decode_gpu/decode_gpu.sweep.json \
        --out $TMPDIR/decode_gpu.sweep.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.decode import timing  # noqa: E402
from benchmarks.decode.kernel import bench_kernel, kernel_sweep  # noqa: E402
from benchmarks.decode.measure import bench_generate, bench_layers, bench_models  # noqa: E402
from benchmarks.decode.models import build_models  # noqa: E402
from benchmarks.decode.report import cpu_name, report  # noqa: E402


def parse_ints(text: str) -> list[int]:
    return [int(float(x[:-1]) * 1024) if x.lower().endswith("k") else int(x) for x in text.split(",") if x]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--from-config", action="store_true", help="SmolLM2-135M-shaped models, random weights (default)")
    src.add_argument("--model", help="a converted MLA folder")
    p.add_argument("--source", help="with --model: the source model (folder or hub id); default: built from the "
                                    "converted config with random weights")
    p.add_argument("--gguf-file", help="with --source: the GGUF file name inside the source folder")
    p.add_argument("--d-c", type=int, default=64, help="latent dims per layer with --from-config (default 64)")
    p.add_argument("--d-r", type=int, default=32, help="rope key dims with --from-config (default 32)")
    p.add_argument("--d-n", type=int, default=None, help="nope query/key dims with --from-config (default: the "
                   "converter's, head_dim - d_r where d_r <= head_dim/2; the runs before --nope-dims had 64)")
    p.add_argument("--contexts", type=parse_ints, default=parse_ints("1k,2k,4k,8k,16k,32k"),
                   help="per-layer sweep contexts, comma-separated, k = 1024 (default 1k..32k)")
    p.add_argument("--batches", type=parse_ints, default=[1, 8], help="per-layer sweep batch sizes (default 1,8)")
    p.add_argument("--model-contexts", type=parse_ints, default=parse_ints("1k,8k"),
                   help="whole-model contexts (default 1k,8k)")
    p.add_argument("--model-batches", type=parse_ints, default=[1, 8], help="whole-model batch sizes (default 1,8)")
    p.add_argument("--layer-budget", type=float, default=0.6, help="seconds of timed steps per form per layer point")
    p.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds over the forms per layer point")
    p.add_argument("--model-budget", type=float, default=3.0, help="seconds of timed steps per whole-model point")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 or bfloat16 (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--clock", choices=sorted(timing.CLOCKS), default="wall",
                   help="wall (default) or cpu: CPU time of the one benchmark thread (CPU device, --threads 1), for a "
                        "machine shared with other jobs")
    p.add_argument("--kernel-contexts", type=parse_ints, default=parse_ints("1k,8k,32k,64k"),
                   help="attention-core table contexts (CUDA; default 1k,8k,32k,64k)")
    p.add_argument("--kernel-batches", type=parse_ints, default=[1, 8, 32],
                   help="attention-core table batch sizes (CUDA; default 1,8,32)")
    p.add_argument("--skip-layer", action="store_true", help="no per-layer sweep")
    p.add_argument("--no-graph", action="store_true", help="CUDA: no CUDA-graph timing of the per-layer step")
    p.add_argument("--skip-model", action="store_true", help="no whole-model sweep")
    p.add_argument("--skip-static", action="store_true",
                   help="whole model: no preallocated-cache (StaticCache) forms, and on CUDA no CUDA-graph forms")
    p.add_argument("--skip-kernel", action="store_true", help="no attention-core table (CUDA)")
    p.add_argument("--generate", action="store_true", help="also time `model.generate` (default cache, and the "
                                                            "static cache, compiled on CUDA), source and MLA")
    p.add_argument("--generate-batches", type=parse_ints, default=[1, 8, 32], help="generate batch sizes")
    p.add_argument("--generate-prompt", type=int, default=1024, help="generate prompt tokens (default 1024)")
    p.add_argument("--generate-new", type=int, default=128, help="generate new tokens (default 128)")
    p.add_argument("--kernel-sweep", metavar="JSON", help="CUDA: also time the Triton kernel's launch knobs over a "
                                                          "few shapes and write them here")
    p.add_argument("--kernel-baseline", metavar="JSON", help="an earlier run's --json: its Triton times go beside "
                                                             "this run's in the attention-core table")
    p.add_argument("--kernel-note", help="a note on the kernel version, stored in the JSON (used with "
                                         "--kernel-baseline)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "decode" / "README.md"))
    p.add_argument("--plot", default=None,
                   help="PNG path (default: beside --out, .png; FOLDER.png for FOLDER/README.md)")
    p.add_argument("--json", default=None, help="also write the raw numbers here")
    p.add_argument("--report-only", metavar="JSON", help="rewrite --out (and --plot) from an earlier run's --json; "
                                                         "nothing is timed")
    return p


def main(argv=None):
    p = build_parser()
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if args.report_only:
        saved = json.loads(Path(args.report_only).read_text())
        out, plot_path = report(args, saved["meta"], saved["layer"], saved["model"], saved["kernel"],
                                saved.get("generate", []))
        print(f"wrote {out} from {args.report_only}")
        return
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        p.error("--clock cpu times one thread: use it on the CPU with --threads 1")
    timing.set_clock(args.clock)

    def log(msg):
        print(msg, flush=True)

    source, mla, origin = build_models(args, dtype, device)
    attn = mla.model.layers[0].self_attn
    scfg = source.config
    esize = torch.tensor([], dtype=dtype).element_size()
    copy_bw = timing.copy_bandwidth(device, dtype)
    log(f"copy bandwidth {copy_bw / 1e9:.1f} GB/s")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    started = time.perf_counter()
    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    meta = {
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["python", "benchmarks/decode/run.py"] + (sys.argv[1:] if argv is None else list(argv))),
        "device": f"{device.type} ({device_name})", "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__, "threads": torch.get_num_threads(), "origin": origin, "clock": args.clock,
        "hidden": scfg.hidden_size, "heads": scfg.num_attention_heads, "kv_heads": scfg.num_key_value_heads,
        "head_dim": scfg.head_dim, "layers": scfg.num_hidden_layers, "d_c": attn.kv_lora_rank,
        "d_r": attn.qk_rope_head_dim, "src_elems": 2 * scfg.num_key_value_heads * scfg.head_dim,
        "mla_elems": attn.kv_lora_rank + attn.qk_rope_head_dim,
        "cd_elems": attn.groups * (attn.qk_nope_head_dim + attn.qk_rope_head_dim + attn.v_head_dim),
        "copy_bw": copy_bw, "element_size": esize, "cpus": os.cpu_count(), "load_before": load_before,
    }
    if args.kernel_note:
        meta["kernel_note"] = args.kernel_note
    layer_rows = [] if args.skip_layer else bench_layers(source, mla, args, device, dtype, log)
    model_rows = [] if args.skip_model else bench_models(source, mla, args, device, dtype, log)
    generate_rows = bench_generate(source, mla, args, device, log) if args.generate else []
    cuda = device.type == "cuda"
    kernel_rows = bench_kernel(mla, args, device, dtype, copy_bw, log) if cuda and not args.skip_kernel else []
    meta["load_after"] = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    meta["minutes"] = (time.perf_counter() - started) / 60
    if args.kernel_baseline:
        before = json.loads(Path(args.kernel_baseline).read_text())
        by_shape = {(r["batch"], r["context"]): r["us"]["triton"] for r in before.get("kernel", [])}
        for r in kernel_rows:
            if (r["batch"], r["context"]) in by_shape:
                r["triton_before_us"] = by_shape[(r["batch"], r["context"])]
        note = before["meta"].get("kernel_note")
        meta["kernel_baseline_note"] = (f"`{args.kernel_baseline}`, written by `{before['meta']['command']}`"
                                        + (f" ({note})" if note and note not in before["meta"]["command"] else "")
                                        + ".")
    sweep_rows = kernel_sweep(mla, device, dtype, copy_bw, log) if args.kernel_sweep else []
    out, plot_path = report(args, meta, layer_rows, model_rows, kernel_rows, generate_rows)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "layer": layer_rows, "model": model_rows,
                                               "kernel": kernel_rows, "generate": generate_rows}, indent=1))
    if args.kernel_sweep:
        Path(args.kernel_sweep).write_text(json.dumps({"meta": meta, "sweep": sweep_rows}, indent=1))
    log(f"wrote {out} and {plot_path}")


if __name__ == "__main__":
    main()
