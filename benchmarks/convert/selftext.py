#!/usr/bin/env python
"""The self text's sampler (`--calib-data self`, `finetune --data self`) against transformers' `generate`, in one
process on this machine: tokens a second, the text's statistics and `--dry-run`'s estimate of the sampling.

    python benchmarks/convert/selftext.py [MODEL] [--tokens 8192] [--widths 64] [--tiny] [--generate-dtype float32]
        [--cache-dir DIR] [--json FILE]

For the source (default: the embedded SmolLM2-135M; `--tiny`: also a random 3-layer, 192-wide model with its
tokenizer and vocabulary) both samplers sample the first `--tokens` tokens of the chat text a conversion samples
(seed 0, temperature `--temperature`, `selftext.SAMPLE_TOKENS` new tokens at most, in the precision a conversion
samples in here), uncached:

- `generate`: the previous sampler, batches of `selftext.BATCH` requests through `model.generate` (each batch runs
  until its last answer ends; the tokens after an answer's EOS are dropped), in `--generate-dtype` (default: the
  slots' precision; float32 is how conversions sampled before bfloat16 sampling);
- `slots`: `mla_convert.sampler` at each width of `--widths` (a finished answer's slot takes the next request).

Each row: tokens kept (prompt and answer, as the calibration stream reads them) per second of wall time; the text's
statistics (answers' mean length, the share ending at EOS, distinct tokens per answer token, and the source's own
mean negative log-likelihood at temperature 1 of the answer tokens, with its standard error: the same distribution
gives the same figures within their errors); and for the slots, `--dry-run`'s estimate of that sampling
(`estimates.sample_seconds`) over the measured time.

With `--cache-dir DIR` each sampler's text is also written where a conversion reads its self text (`DIR/SAMPLER`,
as `MLA_CONVERT_CACHE`, under the key of `--calib-data self` at seed 0 and `--temperature`), so that the same
conversion can be run on either sampler's text (benchmarks/convert/README.md#the-self-texts-sampler).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.common import harness  # noqa: E402  (the machine record)


def generate_batches(model, tokenizer, tokens: int, temperature: float, batch: int, seed: int = 0):
    """The previous sampler: batch after batch of `model.generate` (left-padded prompts, plain temperature
    sampling, torch's global generator seeded per batch) until `tokens` are kept."""
    from mla_convert.conversion import selftext

    out, have, index = [], 0, 0
    while have < tokens:
        prompt = selftext.prompts(tokenizer, index * batch, batch)
        width = max(len(p) for p in prompt)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompt])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt])
        torch.manual_seed(seed * 1_000_003 + index)
        rows = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0,
                              top_p=1.0, max_new_tokens=selftext.SAMPLE_TOKENS, pad_token_id=pad,
                              eos_token_id=tokenizer.eos_token_id).tolist()
        for p, row in zip(prompt, rows):
            answer = row[width:]
            if tokenizer.eos_token_id in answer:
                answer = answer[: answer.index(tokenizer.eos_token_id) + 1]
            out.append((p, answer))
            have += len(p) + len(answer)
        index += 1
    return out


def slot_samples(model, tokenizer, tokens: int, temperature: float, width: int, seed: int = 0):
    from mla_convert.conversion import selftext

    table = {tuple(p) for p in selftext.prompts(tokenizer, 0, len(selftext.PROMPTS))}
    out = []
    for s in selftext.sample_stream(model, tokenizer, 0, seed, temperature, selftext.SAMPLE_TOKENS, width,
                                    budget=tokens):
        cut = max(n for n in range(len(s) + 1) if tuple(s[:n]) in table)  # the prompt, then the answer
        out.append((s[:cut], s[cut:]))
    return out


def statistics(model, samples, eos: int) -> dict:
    """The answers' mean length, EOS share, distinct-token share and the source's mean nll (temperature 1) of the
    answer tokens with its standard error (over answers)."""
    nll = []
    with torch.inference_mode():
        for prompt, answer in samples:
            ids = torch.tensor([prompt + answer])
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
            nll.append(torch.nn.functional.cross_entropy(logits, ids[0, len(prompt):], reduction="none"))
    per_answer = torch.stack([n.mean() for n in nll])
    flat = torch.cat(nll)
    answers = [a for _, a in samples]
    return {"answers": len(answers), "answer_mean_tokens": round(sum(map(len, answers)) / len(answers), 1),
            "eos_share": round(sum(bool(a) and a[-1] == eos for a in answers) / len(answers), 3),
            "distinct_share": round(len({t for a in answers for t in a}) / max(1, sum(map(len, answers))), 3),
            "nll": round(flat.mean().item(), 4),
            "nll_se": round(per_answer.std().item() / math.sqrt(len(answers)), 4)}  # fmt: skip


def tiny_model(folder: Path, embedded) -> Path:
    """A random 3-layer, 192-wide Llama with the embedded source's tokenizer and vocabulary, saved to `folder`."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = embedded.config
    config = LlamaConfig(vocab_size=base.vocab_size, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=base.bos_token_id, eos_token_id=base.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    embedded.tokenizer().save_pretrained(folder)
    return folder


def measure(source, label: str, args, out: Path | None) -> None:
    from mla_convert.conversion import selftext
    from mla_convert.conversion import estimates

    tokenizer = source.tokenizer()
    dtype = selftext.sampling_dtype(source)
    model = selftext.causal_lm(source, "cpu", dtype)
    runs = [("generate", selftext.BATCH)] if not args.no_generate else []
    runs += [("slots", w) for w in args.widths]
    generate_dtype = getattr(torch, args.generate_dtype) if args.generate_dtype else dtype
    for sampler, width in runs:
        model = model.to(generate_dtype if sampler == "generate" else dtype)
        load = [round(x, 2) for x in __import__("os").getloadavg()]
        start = time.perf_counter()
        if sampler == "generate":
            samples = generate_batches(model, tokenizer, args.tokens, args.temperature, width)
        else:
            samples = slot_samples(model, tokenizer, args.tokens, args.temperature, width)
        seconds = time.perf_counter() - start
        tokens = sum(len(p) + len(a) for p, a in samples)
        row = {"model": label, "sampler": sampler, "width": width, "dtype": str(model.dtype).removeprefix("torch."),
               "temperature": args.temperature, "tokens": tokens, "seconds": round(seconds, 2),
               "tokens_per_s": round(tokens / seconds, 1), "load_at_start": load}
        if sampler == "slots":
            estimate = estimates.sample_seconds(source.config, tokens, width, dtype == torch.bfloat16,
                                                selftext.SAMPLE_TOKENS, *selftext.prompt_tokens(tokenizer))
            row["estimate_s"], row["estimate_over_measured"] = round(estimate, 1), round(estimate / seconds, 3)
        model = model.to(dtype)  # every row's statistics in the one precision
        row.update(statistics(model, samples, tokenizer.eos_token_id))
        row["machine"] = harness.machine()
        print(json.dumps(row), flush=True)
        if out:
            harness.append_jsonl(out, row)
        if args.cache_dir:
            as_cached(source, [p + a for p, a in samples], args.cache_dir / sampler, args.temperature)


def as_cached(source, samples: list[list[int]], root: Path, temperature: float) -> None:
    """`samples` written as the self-text cache of seed 0 at `temperature` under `root` (as MLA_CONVERT_CACHE)."""
    from mla_convert.conversion import selftext

    settings, path = selftext._entry(source, 0, temperature, None, None, "chat", "cpu")
    selftext._keep(root / path.parent.name / path.name, settings, [], samples, source.tokenizer())


def check_estimate(source, args, tmp: str) -> None:
    """`selftext.self_tokens` end to end (the model's loading included) into an empty cache, against the estimate."""
    import os

    from mla_convert.conversion import selftext
    from mla_convert.conversion import estimates

    os.environ["MLA_CONVERT_CACHE"] = str(Path(tmp) / "cache")
    load = [round(x, 2) for x in os.getloadavg()]
    start = time.perf_counter()
    tokens = selftext.self_tokens(source, args.self_tokens, 0, temperature=args.temperature).numel()
    seconds = time.perf_counter() - start
    bf16 = selftext.sampling_dtype(source) == torch.bfloat16
    estimate = estimates.sample_seconds(source.config, args.self_tokens, selftext.BATCH, bf16, selftext.SAMPLE_TOKENS,
                                        *selftext.prompt_tokens(source.tokenizer()))
    row = {"model": args.model or ("random llama, 3 layers, 192 wide" if args.tiny_only else "embedded"),
           "sampler": "self_tokens", "width": selftext.BATCH, "temperature": args.temperature,
           "asked": args.self_tokens, "tokens": tokens, "seconds": round(seconds, 2),
           "tokens_per_s": round(tokens / seconds, 1), "estimate_s": round(estimate, 1),
           "estimate_over_measured": round(estimate / seconds, 3), "load_at_start": load, "machine": harness.machine()}
    print(json.dumps(row), flush=True)
    if args.json:
        harness.append_jsonl(args.json, row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None, help="source (default: the embedded SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--widths", type=int, nargs="+", default=[64])
    parser.add_argument("--temperature", type=float, default=1.2)
    parser.add_argument("--tiny", action="store_true", help="also a random 3-layer, 192-wide model")
    parser.add_argument("--tiny-only", action="store_true", help="only the random 3-layer, 192-wide model")
    parser.add_argument("--no-generate", action="store_true", help="the slots sampler alone")
    parser.add_argument("--generate-dtype", choices=["float32", "bfloat16"], default=None,
                        help="the precision `generate` samples in (default: the slots')")
    parser.add_argument("--json", type=Path, default=None, help="append one record per run to this file")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="also write each sampler's text as a conversion's self-text cache under DIR/SAMPLER")
    parser.add_argument("--self-tokens", type=int, default=0, metavar="N",
                        help="instead: time `selftext.self_tokens` (N tokens, empty cache, as a conversion samples "
                             "them) against `--dry-run`'s estimate of it")
    args = parser.parse_args()

    from mla_convert.sources import open_source

    source = open_source(args.model)
    if args.self_tokens:
        with tempfile.TemporaryDirectory() as tmp:
            model = source if not args.tiny_only else open_source(str(tiny_model(Path(tmp) / "tiny", source)))
            check_estimate(model, args, tmp)
        return
    if not args.tiny_only:
        measure(source, args.model or "embedded SmolLM2-135M-Instruct", args, args.json)
    if args.tiny or args.tiny_only:
        with tempfile.TemporaryDirectory() as tmp:
            measure(open_source(str(tiny_model(Path(tmp), source))), "random llama, 3 layers, 192 wide", args,
                    args.json)


if __name__ == "__main__":
    main()
