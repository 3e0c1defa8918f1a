"""Qwen3's per-head q/k norms: the exact key norm against the calibrated (absorbable) one, on a small *trained* Qwen3.

There is no real Qwen3 checkpoint offline, so this script trains one: a small Qwen3 (GQA, head_dim != hidden/heads,
learned q/k norm weights) with a byte-level BPE tokenizer, both fit on WikiText-2 validation text (wiki.valid.tokens),
on the CPU. It then converts it with both --qk-norm modes at full rank and at 50% / 25% of the source's KV cache
(calibration on the same validation text) and measures perplexity on the test split (wiki.test.tokens, never trained
or calibrated on). Each conversion is one `mla-convert qwen` process (benchmarks/common/harness.py). Writes
benchmarks/qwen3/README.md and benchmarks/qwen3/qwen3.json (with the machine record).

    PYTHONPATH=. OMP_NUM_THREADS=2 .venv/bin/python benchmarks/qwen3/run.py [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.common import harness  # noqa: E402  (mla-convert processes, the machine record)

BENCH = ROOT / "benchmarks" / "qwen3"  # this benchmark's folder: README.md (the report) and its data
DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
SHAPE = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=48, max_position_embeddings=1024, vocab_size=4096)  # fmt: skip


def train_source(folder: Path, steps: int, seq_len: int, batch: int, seed: int) -> dict:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    text = (DATA / "wiki.valid.tokens").read_text()
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator([text], vocab_size=SHAPE["vocab_size"], special_tokens=["<unk>", "<s>", "</s>"],
                            show_progress=False)  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, unk_token="<unk>", bos_token="<s>",
                                        eos_token="</s>")  # fmt: skip
    ids = torch.tensor(tokenizer(text)["input_ids"])
    torch.manual_seed(seed)
    config = Qwen3Config(**SHAPE, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
    model = Qwen3ForCausalLM(config)
    optim = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)
    start, losses = time.time(), []
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, ids.numel() - seq_len - 1, (batch,), generator=gen)
        x = torch.stack([ids[s : s + seq_len] for s in starts.tolist()])
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step(), sched.step(), optim.zero_grad()
        losses.append(loss.item())
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    norms = [model.model.layers[i].self_attn.k_norm.weight.detach() for i in range(config.num_hidden_layers)]
    return {"steps": steps, "seq_len": seq_len, "batch": batch, "train_seconds": round(time.time() - start),
            "final_train_loss": round(sum(losses[-20:]) / 20, 3), "training_tokens": steps * batch * seq_len,
            "k_norm_weight_std": round(float(torch.cat(norms).std()), 3)}  # fmt: skip


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mla_convert.convert import max_rank
    from mla_convert.evaluate import perplexity

    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--windows", type=int, default=16)
    parser.add_argument("--report-only", action="store_true", help="rewrite README.md from benchmarks/qwen3/qwen3.json")
    args = parser.parse_args()
    if args.report_only:
        result = json.loads((BENCH / "qwen3.json").read_text())
        args.steps, args.batch = result["training"]["steps"], result["training"]["batch"]
        args.seq_len, args.windows = result["eval"]["seq_len"], result["eval"]["windows"]
        return write_report(result, args)
    work = Path(tempfile.mkdtemp(prefix="bench-qwen3-"))
    source = work / "qwen3"
    training = train_source(source, args.steps, args.seq_len, args.batch, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(source)
    test_ids = torch.tensor(tokenizer((DATA / "wiki.test.tokens").read_text())["input_ids"])

    def ppl(folder: Path) -> float:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        with torch.inference_mode():
            return perplexity(model, test_ids, args.seq_len, args.windows, progress=False)["perplexity"]

    config = AutoModelForCausalLM.from_pretrained(source).config
    groups, head_dim = config.num_key_value_heads, config.head_dim
    full = ["--rank", max_rank(config), "--rope-dims", groups * head_dim, "--force"]
    rows = [{"model": "source Qwen3", "cache": 1.0, "qk_norm": "-", "perplexity": ppl(source)}]
    print(training, rows[0], flush=True)
    for label, cache, sizing in (("full rank, every RoPE pair", 1.0, full), ("50% cache", 0.5, ["--kv-budget", 0.5]),
                                 ("25% cache", 0.25, ["--kv-budget", 0.25])):  # fmt: skip
        for mode in ("exact", "calibrated"):
            out = work / f"{mode}-{cache}"
            harness.convert(["qwen", source, *sizing, "--qk-norm", mode, "--calib-data", DATA / "wiki.valid.tokens",
                             "--calib-samples", 8, "--calib-seq-len", args.seq_len, "--dtype", "float32", "-q"], out)
            rows.append({"model": label, "cache": cache, "qk_norm": mode, "perplexity": ppl(out), **resolved(out)})
            print(rows[-1], flush=True)
    result = {"shape": SHAPE, "training": training, "eval": {"data": "wiki.test.tokens", "seq_len": args.seq_len,
              "windows": args.windows}, "rows": rows, "torch_threads": torch.get_num_threads(),
              "machine": harness.machine()}  # fmt: skip
    (BENCH / "qwen3.json").write_text(json.dumps(result, indent=1) + "\n")
    write_report(result, args)


def resolved(folder: Path) -> dict:
    """What the default options resolved to in a conversion (its provenance): rank allocation, latent dims per
    layer, refinement steps per layer."""
    prov = json.loads((folder / "provenance.json").read_text())
    return {"rank_allocation": prov["options"].get("rank_allocation"), "ranks": prov["plan"]["ranks"],
            "refine_steps": prov["options"].get("refine_steps")}


def write_report(result: dict, args) -> None:
    rows, training = result["rows"], result["training"]
    base = rows[0]["perplexity"]
    lines = [
        "# Qwen3's per-head q/k norms: exact against calibrated key norm",
        "",
        "No real Qwen3 checkpoint is available offline: `benchmarks/qwen3/run.py` trains a small Qwen3 "
        f"(hidden {SHAPE['hidden_size']}, {SHAPE['num_hidden_layers']} layers, {SHAPE['num_attention_heads']} query / "
        f"{SHAPE['num_key_value_heads']} kv heads, head_dim {SHAPE['head_dim']}, BPE vocab {SHAPE['vocab_size']}) on "
        f"WikiText-2 validation text ({training['steps']} steps x {training['batch']} x {training['seq_len']} tokens, "
        f"final train loss {training['final_train_loss']}; learned k_norm weights, std {training['k_norm_weight_std']}), "
        "converts it (calibration: 8 windows of the same validation text) and scores the WikiText-2 test split "
        f"(wiki.test.tokens, first {args.windows} windows of {args.seq_len} tokens, float32).",
        "",
        "Each conversion runs the default options (`ConvertOptions` with only the size, `--qk-norm` and the "
        "calibration set); the table shows what they resolved to (provenance): the rank allocation, the latent dims "
        "per layer and the refinement steps per layer.",
        "",
        "| conversion | --qk-norm | perplexity | vs source | allocation, d_c by layer | refinement steps |",
        "|---|---|---:|---:|---|---:|",
    ]
    for row in rows:
        shape = f"{row['rank_allocation']}, {row['ranks']}" if row.get("ranks") else "-"
        steps = row.get("refine_steps", "-") if row.get("ranks") else "-"
        lines.append(f"| {row['model']} | {row['qk_norm']} | {row['perplexity']:.3f} | "
                     f"{(row['perplexity'] / base - 1) * 100:+.2f}% | {shape} | {steps} |")  # fmt: skip
    lines += [
        "",
        "`exact` normalizes every key per token at attention time (expanded attention, also in decode); `calibrated` "
        "replaces each key's RMS by its calibration RMS per layer and kv group, which makes the key linear (plain MLA "
        "keys, absorbed decode). Both keep the query's per-token norm exactly.",
        "",
        "Command: `PYTHONPATH=. OMP_NUM_THREADS=2 .venv/bin/python benchmarks/qwen3/run.py` "
        f"(--steps {args.steps} --seq-len {args.seq_len} --batch {args.batch} --windows {args.windows}).",
    ]
    (BENCH / "README.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
