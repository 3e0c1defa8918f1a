"""Long context (`mla-convert eval --long-context`): perplexity by position bucket over windows of the model's full
context, and a pass-key retrieval check on generated filler text; in transformers and in llama.cpp, from the same
token ids and scored by the same code.

Position buckets: every window is scored on its own from an empty cache; the token at position p (p tokens of context
before it, p = 1 .. W-1) falls in the bucket [lo, hi) holding p. The buckets halve from the window down: for W = 8,192,
0-512, 512-1K, 1K-2K, 2K-4K, 4K-8K. A bucket's NLL is the mean over its tokens of every window.

Retrieval: a key (a seeded 5-6 digit number) is stated in one sentence hidden at a depth (the share of the filler
before it) in filler sentences drawn from a fixed vocabulary (no digits), and asked for at the end, inside the
model's chat template when its tokenizer has one. A prompt plus its answer fills at most a length's positions. The
greedy answer (`NEW_TOKENS` tokens, cut at the first end-of-sequence token) is scored: found when the key appears in it
as a whole number.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

from mla_convert.errors import UserError

NEW_TOKENS = 16  # the answer's tokens: "The pass key is 123456." and room to spare
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
MARKER = "\u2063HAYSTACK\u2063"  # where the filler goes in the rendered prompt (an invisible separator around a word)
INSTRUCTION = ("There is a pass key hidden somewhere in the long text below. Find it and remember it: you will be "
               "asked for it at the end.")
QUESTION = "What is the pass key? Answer with the number only."
ANSWER_START = "The pass key is"  # the answer's start, given to a model without a chat template

# filler: sentences of common words, drawn with a seeded generator (no digits: the key is the only number)
_SUBJECTS = ("The old farmer", "A small child", "The river", "Our neighbour", "The tall tree", "A grey cat",
             "The morning train", "The baker", "A quiet student", "The wind", "The city", "An old friend")
_VERBS = ("walked past", "looked at", "waited near", "sang about", "forgot", "painted", "carried", "watched",
          "remembered", "followed", "talked about", "cleaned")
_OBJECTS = ("the green hills", "a wooden bridge", "the busy market", "the blue sea", "a long road", "the small garden",
            "the red house", "a field of wheat", "the quiet library", "the open window", "the evening sky",
            "a basket of apples")
_ENDINGS = ("", " in the rain", " before noon", " for a while", " once again", " with great care", " at dusk",
            " without a word")


# ------------------------------------------------------------------------------------------------- the options


def parse_list(text: str, flag: str, kind: type) -> list:
    """`--lengths 1024,2048` / `--depths 0.1,0.5` as a list of `kind`, or a UserError naming the form."""
    example = "1024,2048,4096" if kind is int else "0.1,0.5,0.9"
    items = [part.strip() for part in text.split(",")]
    try:
        values = [kind(part) for part in items]
    except ValueError:
        values = []
    if not values or any(not part for part in items):
        raise UserError(f"{flag} takes {'whole ' if kind is int else ''}numbers separated by commas, e.g. {example}, "
                        f"got {text!r}")
    return values


def options(on: bool, lengths: str | None, depths: str | None, trials: int | None, reference: Path | None,
            record: bool, engine: str, data: str) -> dict | None:
    """`eval`'s --long-context options, parsed and checked before any work: the keyword arguments of
    `long_context_eval` they give (None without --long-context, where its own options are refused)."""
    if not on:
        given = [flag for flag, value in (("--lengths", lengths), ("--depths", depths), ("--trials", trials),
                                          ("--reference", reference)) if value is not None]
        if given:
            raise UserError(f"{given[0]} applies to --long-context: add --long-context, or drop {given[0]}")
        return None
    if engine not in ("transformers", "llamacpp"):
        raise UserError(f"--long-context runs in --engine transformers or llamacpp, not {engine}")
    if record:
        raise UserError("--record keeps the perplexity of fixed windows; --long-context's tables go to --json: "
                        "drop --record")
    run = {"lengths": list(dict.fromkeys(parse_list(lengths, "--lengths", int))) if lengths is not None else None,
           "depths": list(dict.fromkeys(parse_list(depths, "--depths", float) if depths is not None else DEFAULT_DEPTHS)),
           "trials": 3 if trials is None else trials}
    check_options(**run)
    run["reference"] = load_reference(reference) if reference is not None else None
    if run["reference"] is not None and run["reference"].get("data") != data:
        raise UserError(f"--reference {reference} was measured on {run['reference'].get('data')}, not {data}: "
                        "measure both on the same --data")
    return run


def check_options(lengths: list[int] | None, depths: list[float], trials: int) -> None:
    """Refuse, in one line each, lengths, depths or trials that cannot run (before any model is read)."""
    for length in lengths or []:
        if length < 2 * NEW_TOKENS:
            raise UserError(f"--lengths {length} is too short: a prompt and its {NEW_TOKENS}-token answer need at least "
                            f"{2 * NEW_TOKENS} positions")
    for depth in depths:
        if not 0 <= depth <= 1:
            raise UserError(f"--depths are shares of the filler before the key, from 0 to 1, got {depth:g}")
    if trials < 1:
        raise UserError(f"--trials must be at least 1, got {trials}")


def check_context(lengths: list[int], window: int | None, context: int, label: str) -> None:
    """Refuse lengths or a window above the model's context (`context` positions; 0: the model does not say)."""
    if not context:
        raise UserError(f"{label} states no context length (max_position_embeddings): --long-context cannot tell "
                        "which lengths it takes; add it to the model's config")
    for length in lengths:
        if length > context:
            raise UserError(f"--lengths {length} is above the context of {label} ({context} positions, "
                            f"max_position_embeddings): use lengths up to {context}")
    if window is not None and window > context:
        raise UserError(f"--seq-len {window} is above the context of {label} ({context} positions, "
                        f"max_position_embeddings): use --seq-len {context} or less (its default with --long-context)")


def load_reference(path: Path) -> dict:
    """The bucket table of an earlier `eval --long-context --json` file, or a UserError naming what to pass."""
    import json

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        buckets = record["long_context"]["buckets"]
        [(b["from"], b["to"], b["nll"]) for b in buckets]
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"--reference {path} is not a results file of `mla-convert eval --long-context --json`: "
                        "measure the reference model with --long-context --json first") from None
    return record


# --------------------------------------------------------------------------------------------- position buckets


def bucket_edges(window: int) -> list[int]:
    """Bucket edges for windows of `window` tokens: halving from the window, five buckets (fewer for tiny windows)."""
    return sorted({0, *(window >> k for k in range(4, -1, -1))})


def short(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def bucket_table(logprobs: list[list[float]], window: int, reference: dict | None = None) -> list[dict]:
    """Per bucket [from, to): its tokens, mean NLL and perplexity over every window's `logprobs` (entry i of a window:
    the log-probability of the token at position i + 1); with `reference` (an earlier result), the perplexity ratio
    exp(nll - reference nll) of each bucket."""
    edges = bucket_edges(window)
    sums, counts = [0.0] * (len(edges) - 1), [0] * (len(edges) - 1)
    for lp in logprobs:
        if len(lp) != window - 1:
            raise ValueError(f"a window of {window} tokens scores {window - 1} tokens, not {len(lp)}")
        for b, (lo, hi) in enumerate(zip(edges, edges[1:])):
            part = lp[max(lo, 1) - 1 : hi - 1]
            sums[b] -= math.fsum(part)
            counts[b] += len(part)
    rows = [{"from": lo, "to": hi, "tokens": n, "nll": s / n, "perplexity": math.exp(s / n)}
            for lo, hi, s, n in zip(edges, edges[1:], sums, counts) if n]  # fmt: skip
    if reference is not None:
        ref = {(b["from"], b["to"]): b["nll"] for b in reference["long_context"]["buckets"]}
        if set(ref) != {(r["from"], r["to"]) for r in rows}:
            raise UserError(f"--reference {reference.get('model')} was measured with windows of "
                            f"{reference.get('seq_len')} tokens, not {window}: measure both with the same --seq-len")
        for r in rows:
            r["ratio"] = math.exp(r["nll"] - ref[(r["from"], r["to"])])
    return rows


# ------------------------------------------------------------------------------------------------- retrieval


@dataclass
class Case:
    length: int  # positions the prompt and its answer may fill
    depth: float  # share of the filler before the key sentence
    trial: int
    key: int
    ids: list[int]  # the prompt's token ids
    key_at: int  # index in `ids` of the key sentence's first token
    filler: tuple[int, int]  # [start, end) of the haystack (filler and key sentence) in `ids`


def trial_key(seed: int, trial: int) -> int:
    return random.Random(f"pass-key:{seed}:{trial}").randint(10_000, 999_999)


def filler_sentences(seed: int, count: int) -> list[str]:
    """`count` filler sentences, the same for the same seed."""
    rng = random.Random(f"filler:{seed}")
    return [f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}{rng.choice(_ENDINGS)}."
            for _ in range(count)]  # fmt: skip


def prompt_frame(tokenizer, label: str) -> tuple[list[int], list[int]]:
    """The prompt's token ids before and after the haystack: the instruction and the question as one user message in
    the chat template (with its generation prompt) when the tokenizer has one, else as plain text ending in the
    answer's start."""
    body = f"{INSTRUCTION}\n\n{MARKER}\n\n{QUESTION}"
    if getattr(tokenizer, "chat_template", None):
        from mla_convert.templates import apply_chat_template

        text = apply_chat_template(tokenizer, [{"role": "user", "content": body}], label, tokenize=False,
                                   add_generation_prompt=True)
        before, after = text.split(MARKER)
        special = False  # the template writes its own special tokens
    else:
        before, after = body.split(MARKER)
        after += f"\n{ANSWER_START}"
        special = True
    head = tokenizer(before, add_special_tokens=special)["input_ids"]
    tail = tokenizer(after, add_special_tokens=False)["input_ids"]
    return list(head), list(tail)


def retrieval_cases(tokenizer, label: str, lengths: list[int], depths: list[float], trials: int,
                    seed: int = 0) -> list[Case]:
    """Every (length, depth, trial) prompt: the frame, then filler sentences with the key sentence at the sentence
    boundary nearest `depth` of the filler's tokens, as many sentences as leave room for the answer."""
    head, tail = prompt_frame(tokenizer, label)
    cases = []
    for trial in range(trials):
        key = trial_key(seed, trial)
        needle = tokenizer(f" The pass key is {key}. Remember it: {key} is the pass key.",
                           add_special_tokens=False)["input_ids"]  # fmt: skip
        room = max(lengths) - NEW_TOKENS - len(head) - len(tail) - len(needle)
        sentences = filler_sentences(seed * 1_000 + trial, max(room // 4, 1))  # a sentence is more than 4 tokens
        pieces = [list(p) for p in tokenizer([f" {s}" for s in sentences], add_special_tokens=False)["input_ids"]]
        for length in lengths:
            budget = length - NEW_TOKENS - len(head) - len(tail) - len(needle)
            if budget < 1:
                raise UserError(f"--lengths {length} is too short for the retrieval prompt of {label} (it needs "
                                f"{length - budget + 1} positions with its answer): use longer lengths")
            used, total = [], 0
            for piece in pieces:
                if total + len(piece) > budget:
                    break
                used.append(piece)
                total += len(piece)
            for depth in depths:
                starts = [0]
                for piece in used:
                    starts.append(starts[-1] + len(piece))
                cut = min(range(len(starts)), key=lambda i: abs(starts[i] - depth * total))
                before = [t for piece in used[:cut] for t in piece]
                after = [t for piece in used[cut:] for t in piece]
                ids = head + before + needle + after + tail
                cases.append(Case(length, depth, trial, key, ids, len(head) + len(before),
                                  (len(head), len(ids) - len(tail))))
    return cases


def answer_text(tokenizer, tokens: list[int]) -> str:
    """The answer's text: its tokens up to the first end-of-sequence token, decoded without special tokens."""
    eos = tokenizer.eos_token_id
    stops = set(eos if isinstance(eos, list) else [eos]) - {None}
    cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokenizer.decode(tokens[:cut], skip_special_tokens=True)


def found(answer: str, key: int) -> bool:
    """Whether the key appears in the answer as a whole number (not inside a longer one)."""
    return re.search(rf"(?<!\d){key}(?!\d)", answer) is not None


def retrieval_table(cases: list[Case], answers: list[list[int]], tokenizer) -> dict:
    """The scored cases and the count found per (length, depth)."""
    rows = []
    for case, tokens in zip(cases, answers, strict=True):
        text = answer_text(tokenizer, tokens)
        rows.append({"length": case.length, "depth": case.depth, "trial": case.trial, "key": case.key,
                     "prompt_tokens": len(case.ids), "key_at": case.key_at, "answer_ids": list(tokens),
                     "answer": text, "found": found(text, case.key)})  # fmt: skip
    return {"cases": rows, "found": sum(r["found"] for r in rows), "total": len(rows), "new_tokens": NEW_TOKENS}


# ------------------------------------------------------------------------------------------------ the engines


def transformers_scores(net, windows: list[list[int]], prompts: list[list[int]], new_tokens: int,
                        progress: bool = True) -> dict:
    """The per-token log-probabilities of each window (scored from an empty cache) and `new_tokens` greedy tokens
    after each prompt (a cached decode: a quantized cache type is read back as it is written), in transformers; the
    fields llama.cpp's worker returns."""
    import torch
    from tqdm.auto import tqdm

    from mla_convert.modeling.compat import cache_kwargs, output_cache

    device = next(net.parameters()).device
    out: dict = {"logprobs": [], "greedy": []}
    with torch.inference_mode():
        for w in tqdm(windows, desc="long windows", disable=not progress, unit="window"):
            ids = torch.tensor([w], device=device)
            logits = net(input_ids=ids, use_cache=False).logits[0, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            out["logprobs"].append((-nll.double()).tolist())
            del logits, nll
        for p in tqdm(prompts, desc="retrieval prompts", disable=not progress, unit="prompt"):
            step = net(input_ids=torch.tensor([p], device=device), use_cache=True, logits_to_keep=1)
            tokens = []
            while True:
                tokens.append(int(step.logits[0, -1].argmax()))
                if len(tokens) == new_tokens:
                    break
                step = net(input_ids=torch.tensor([tokens[-1:]], device=device), use_cache=True, logits_to_keep=1,
                           **cache_kwargs(output_cache(step)))
            out["greedy"].append(tokens)
    return out


def in_transformers(model: str | None, text: str, window: int | None, windows: int, dtype: str, device: str,
                     cache_type: str | None, cases_for, progress: bool) -> tuple[dict, list, object, str]:
    """Load `model` in transformers, check its context, and score; -> (scores, cases, tokenizer, label)."""
    from mla_convert import evaluate

    net, tokenizer, label = evaluate.load_model(model, dtype, device)
    context = getattr(net.config, "max_position_embeddings", None) or 0
    window, cases = cases_for(tokenizer, label, context)
    cache_type, stored = evaluate.read_cache_as_served(net, cache_type)
    chunks = evaluate.eval_windows(evaluate.tokenize(tokenizer, text), window, windows).tolist()
    scores = transformers_scores(net, chunks, [c.ids for c in cases], NEW_TOKENS, progress)
    scores.update(engine="transformers", cache_type=cache_type, context=context, seq_len=window,
                  kv_cache_bytes_per_token=stored or evaluate.kv_cache_bytes_per_token(net))
    return scores, cases, tokenizer, label


def in_llamacpp(model: str, text: str, window: int | None, windows: int, cache_type: str | None,
                 cases_for) -> tuple[dict, list, object, str]:
    """The same in llama.cpp, from the same token ids (the GGUF's source tokenizer: `gguf_tokenizer`)."""
    from mla_convert import evaluate
    from mla_convert.serving.llamacpp import engine_fields, gguf_ints, gguf_tokenizer, score_gguf

    tokenizer, label = gguf_tokenizer(model), str(model)
    context = gguf_ints(model, "{arch}.context_length")[0] or 0
    window, cases = cases_for(tokenizer, label, context)
    chunks = evaluate.eval_windows(evaluate.tokenize(tokenizer, text), window, windows).tolist()
    kind = cache_type or "f16"
    n_ctx = max([window, *(len(c.ids) + NEW_TOKENS for c in cases)])
    scores = score_gguf(model, chunks, [c.ids for c in cases], NEW_TOKENS, n_ctx=n_ctx, cache_type=kind)
    scores.update(engine_fields(scores, kind), context=context, seq_len=window)
    return scores, cases, tokenizer, label


def long_context_eval(engine: str, model: str | None, text: str, window: int | None, windows: int, dtype: str,
                      device: str, cache_type: str | None, lengths: list[int] | None, depths: list[float], trials: int,
                      reference: dict | None = None, seed: int = 0, progress: bool = True) -> tuple[dict, str]:
    """`eval --long-context`: the bucket table over `windows` windows of `window` tokens (default: the model's
    context) and the retrieval table (`lengths` None: DEFAULT_LENGTHS up to the context), in `engine` (transformers
    or llamacpp). -> (the result, the model's label)."""

    def cases_for(tokenizer, label, context):
        nonlocal lengths
        check_context(lengths or [], window, context, label)
        lengths = lengths or [n for n in DEFAULT_LENGTHS if n <= context] or [context]  # the defaults it takes
        size = context if window is None else window
        if reference is not None and reference.get("seq_len") != size:
            raise UserError(f"--reference {reference.get('model')} was measured with windows of "
                            f"{reference.get('seq_len')} tokens, not {size}: measure both with the same --seq-len")
        return size, retrieval_cases(tokenizer, label, lengths, depths, trials, seed)

    if engine == "llamacpp":
        scores, cases, tokenizer, label = in_llamacpp(model, text, window, windows, cache_type, cases_for)
    else:
        scores, cases, tokenizer, label = in_transformers(model, text, window, windows, dtype, device, cache_type,
                                                           cases_for, progress)
    window = scores["seq_len"]
    flat = [x for lp in scores["logprobs"] for x in lp]
    nll = -math.fsum(flat) / len(flat)
    if not math.isfinite(nll):
        raise UserError("the model's logits are NaN or infinite on this text: evaluate with --dtype float32")
    result = {"perplexity": math.exp(nll), "nll": nll, "tokens": len(flat), "windows": len(scores["logprobs"]),
              "seq_len": window, **{k: scores.get(k) for k in ("engine", "cache_type", "kv_cache_bytes_per_token")}}
    if scores.get("kv_cache_log"):
        result["kv_cache_log"] = scores["kv_cache_log"]
    buckets = bucket_table(scores["logprobs"], window, reference)
    if reference is not None and [b["tokens"] for b in reference["long_context"]["buckets"]] != [
            b["tokens"] for b in buckets]:
        raise UserError(f"--reference {reference.get('model')} scored {reference.get('windows')} windows, not "
                        f"{result['windows']}: measure both with the same --data, --windows and tokenizer")
    result["long_context"] = {
        "context": scores["context"], "buckets": buckets, "reference": reference.get("model") if reference else None,
        "retrieval": {**retrieval_table(cases, scores["greedy"], tokenizer), "lengths": lengths, "depths": depths,
                      "trials": trials, "seed": seed, "chat_template": bool(getattr(tokenizer, "chat_template", None))},
    }  # fmt: skip
    return result, label


def render(result: dict) -> str:
    """The bucket table and the retrieval table, as `eval --long-context` prints them."""
    lc = result["long_context"]
    ratio = lc.get("reference") is not None
    lines = [f"perplexity by position ({result['windows']} x {result['seq_len']} tokens; position = tokens of context"
             + (f"; ratio to {lc['reference']})" if ratio else ")"),
             f"  {'positions':<12}{'tokens':>9}{'nll':>9}{'perplexity':>12}" + (f"{'ratio':>9}" if ratio else "")]
    for b in lc["buckets"]:
        lines.append(f"  {short(b['from']) + '-' + short(b['to']):<12}{b['tokens']:>9}{b['nll']:>9.4f}"
                     f"{b['perplexity']:>12.3f}" + (f"{b['ratio']:>9.4f}" if ratio else ""))
    ret = lc["retrieval"]
    lines.append(f"retrieval (pass key found / trials; greedy, {ret['new_tokens']} tokens; "
                 f"{'chat template' if ret['chat_template'] else 'plain prompt'}): {ret['found']}/{ret['total']}")
    lines.append(f"  {'length':<8}" + "".join(f"{f'{d:.0%}':>8}" for d in ret["depths"]))
    for length in ret["lengths"]:
        cells = []
        for depth in ret["depths"]:
            hits = [c["found"] for c in ret["cases"] if c["length"] == length and c["depth"] == depth]
            cells.append(f"{sum(hits)}/{len(hits)}")
        lines.append(f"  {short(length):<8}" + "".join(f"{c:>8}" for c in cells))
    return "\n".join(lines)
