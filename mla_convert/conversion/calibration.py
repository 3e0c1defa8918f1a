"""The calibration text: `--calib-data` specs (files, datasets, the source's own text, weighted mixtures) -> token
windows [N, T] (the text sampled from the source is `conversion.selftext`'s), and whether an evaluation text is the
calibration text a model was converted on (`calibration_overlap`)."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mla_convert.data import load_text, tokenize, written_as_path  # one loader and one tokenizer for every text
from mla_convert.errors import UserError
from mla_convert.conversion.selftext import (CALIB_TEMPERATURE, SAMPLE_TOKENS, STYLES, length_args, missing_tokens,
                                             self_tokens)

log = logging.getLogger(__name__)


def parse_mixture(spec: str) -> list[tuple[str, float]]:
    """A calibration spec -> [(name, weight)], name a text spec, "self" or "self-doc": parts joined by commas, each
    `NAME` or `NAME:WEIGHT` (a trailing `:number` is a weight; a datasets name's `:config:split` is not a number).
    Weights are relative."""
    parts = []
    for part in spec.split(","):
        name, weight = part.strip(), 1.0
        head, _, tail = name.rpartition(":")
        if head:
            try:
                weight = float(tail)
                name = head
            except ValueError:  # a datasets name's config or split; after a file path or a style, a bad weight
                # (a datasets name such as `wikitext:CONFIG` stays one where a file named `wikitext` happens to exist)
                if head in STYLES or (written_as_path(head) and Path(head).expanduser().is_file()):
                    raise UserError(f"--calib-data weight of {head} is {tail!r}: weights must be positive numbers "
                                    f"({head}:2, say)") from None
        if not name:
            raise UserError(f"--calib-data {spec!r} has an empty part: write NAME or NAME:WEIGHT, joined by commas")
        if name.split(":")[0] in STYLES and name not in STYLES:
            raise UserError(f"--calib-data part {part.strip()!r}: write {name.split(':')[0]} or "
                            f"{name.split(':')[0]}:WEIGHT (one weight, a positive number)")
        if name.lower() == "none" and len(spec.split(",")) > 1:
            raise UserError("--calib-data none (no calibration text) cannot be mixed with other parts: pass none alone")
        if not (weight > 0 and weight < float("inf")):
            raise UserError(f"--calib-data weight of {name} is {tail}: weights must be positive numbers")
        parts.append((name, weight))
    return parts


def check_calib_spec(spec: str, n_samples: int | None = None) -> list[tuple[str, float]]:
    """Parse a calibration spec and check its files exist (and, given `n_samples`, that every part gets a window),
    reading nothing: before a slow source load."""
    from mla_convert.data import check_text_spec

    parts = parse_mixture(spec)
    for name, _ in parts:
        if name not in STYLES:
            check_text_spec(name)
    if n_samples is not None and n_samples > 0:
        window_counts([w for _, w in parts], n_samples)
    return parts


def window_counts(weights: list[float], n_samples: int) -> list[int]:
    """Share `n_samples` windows by the weights (largest remainder); every part must get at least one."""
    total = sum(weights)
    exact = [n_samples * w / total for w in weights]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: n_samples - sum(counts)]:
        counts[i] += 1
    if min(counts) == 0:
        raise UserError(f"--calib-samples {n_samples} leaves a --calib-data part without a window at these weights: "
                        "raise --calib-samples or that part's weight")
    return counts


def calibration_tokens(source, spec: str, n_samples: int, seq_len: int, seed: int,
                       temperature: float = CALIB_TEMPERATURE, sample_tokens: int = SAMPLE_TOKENS,
                       device: str = "cpu", echo: float = 0.0) -> torch.Tensor:
    """The calibration windows [N, T] of a spec (see `parse_mixture`): random windows of each text, consecutive
    windows of text sampled from the source for `self` (chat answers of `sample_tokens` new tokens at most, joined)
    and `self-doc` (one document a window), sampled at `temperature`, in the weights' proportions, in the order
    given, their last `echo` of tokens repeating an earlier span (`echo_windows`). Text is sampled on `device` (see
    `self_tokens`)."""
    out = []
    for name, count, length in _parts(spec, n_samples, seq_len, sample_tokens):
        if length is not None:
            ids = self_tokens(source, count * seq_len, seed, temperature=temperature, device=device, **length)
            out.append(ids[: count * seq_len].view(count, seq_len))
        else:
            out.append(token_windows(source.tokenizer(), load_text(name), count, seq_len, seed, label=name))
    return echo_windows(torch.cat(out), echo, seed)


def echo_windows(windows: torch.Tensor, share: float, seed: int) -> torch.Tensor:
    """Windows [N, T] whose last round(share * T) tokens (L) repeat the L tokens from a seeded start in [0, T - 2L]
    of the same window, so that the span lies L to T - L tokens back: the source's layers then copy from that far
    (induction), and a conversion calibrated and refined on them must keep doing so. share 0: the windows unchanged."""
    n, t = windows.shape
    length = min(round(share * t), t // 2)  # an odd window's half rounds up: the span and its copy still fit
    if length == 0:
        return windows
    gen = torch.Generator().manual_seed(seed + 1)  # not the windows' own draws (token_windows seeds with `seed`)
    starts = torch.randint(0, t - 2 * length + 1, (n,), generator=gen)
    out = windows.clone()
    for i, start in enumerate(starts.tolist()):
        out[i, t - length:] = windows[i, start:start + length]
    return out


def _parts(spec: str, n_samples: int, seq_len: int, sample_tokens: int):
    """(name, windows, the self text's length arguments or None for a text) of each part of a calibration spec."""
    parts = check_calib_spec(spec, n_samples)
    for (name, _), count in zip(parts, window_counts([w for _, w in parts], n_samples)):
        yield name, count, length_args(name, seq_len, sample_tokens) if name in STYLES else None


def self_tokens_to_sample(source, spec: str, n_samples: int, seq_len: int, seed: int,
                          temperature: float = CALIB_TEMPERATURE, sample_tokens: int = SAMPLE_TOKENS,
                          device: str = "cpu") -> int:
    """The tokens `calibration_tokens` would sample for the same arguments (those its cache lacks), reading nothing
    but the cache."""
    return sum(missing_tokens(source, count * seq_len, seed, temperature=temperature, device=device, **length)
               for _, count, length in _parts(spec, n_samples, seq_len, sample_tokens) if length is not None)


def token_windows(tokenizer, text: str, n_samples: int, seq_len: int, seed: int, label: str = "") -> torch.Tensor:
    """`n_samples` random windows of `seq_len` tokens from the tokenized text (fixed seed; `label` names the text in
    errors). -> [N, T] long."""
    ids = tokenize(tokenizer, text)  # [N]
    available = ids.numel() - seq_len
    if available <= 0:
        raise UserError(f"calibration text {label + ' ' if label else ''}has {ids.numel()} tokens, fewer than "
                        f"--calib-seq-len {seq_len}: pass a longer text or a shorter --calib-seq-len")
    if n_samples * seq_len > ids.numel():
        log.warning("calibration text holds %d tokens; %d x %d windows will overlap", ids.numel(), n_samples, seq_len)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, available + 1, (n_samples,), generator=gen)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


def calibration_overlap(model: str | None, spec: str, text: str) -> str | None:
    """A warning when the evaluation text `spec` (loaded: `text`) is, or shares lines with, the calibration text
    recorded in the model folder's provenance (a perplexity on it flatters the conversion); None otherwise."""
    from mla_convert import data, provenance

    if model is None or not Path(model).is_dir():
        return None
    record = provenance.load(model) or {}
    while record and record.get("kind") != "convert":  # finetune / export: the conversion is further up
        record = record.get("parent") or {}
    spec_calib = (record.get("options") or {}).get("calib_data")
    eval_path = Path(spec).expanduser()
    for calib, _ in parse_mixture(spec_calib) if spec_calib else []:  # each text of a weighted mixture
        calib_path = Path(calib).expanduser()
        if calib == spec or (calib_path.is_file() and eval_path.is_file()
                             and calib_path.resolve() == eval_path.resolve()):  # fmt: skip
            return (f"{spec} is the text {model} was calibrated on: the perplexity flatters the conversion; "
                    "evaluate on held-out text (e.g. wiki.test.raw when calibrating on wiki.valid.tokens)")
        if calib_path.is_file():
            shared = data.overlapping_lines(calib_path.read_text(encoding="utf-8", errors="replace"), text)
            if shared:
                return (f"{spec} shares {shared} lines with the calibration text {calib}: the perplexity flatters "
                        "the conversion; evaluate on held-out text")
    return None
