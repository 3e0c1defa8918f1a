"""Batched sampling from a transformers causal LM, a token a step for every sequence at once (the self text's sampler,
`mla_convert.conversion.selftext`).

`width` slots each hold one sequence at its own position in a preallocated key/value cache (`SlotCache`). Every step
feeds one token per slot: the next token of its prompt while the prompt lasts (the prompt is read a token a step, so
that every slot steps alike), else the token sampled at the last step. A prompt's keys and values, once a slot has
read them, are kept (`_PromptStore`): a later request copies into its slot those of the longest prefix it shares with
a kept prompt and reads only the rest (a chat self text's prompts share their template's system turn, and each
prompt comes back). A slot whose sequence ends (its EOS, or its
`new_tokens`) takes the next request at once, so that no step computes for a finished sequence; only when no request
is left (or a token budget is spent) does the batch shrink to the slots still running.

Sampling is plain temperature sampling, the distribution softmax(logits / temperature) over the whole vocabulary (no
top-k or top-p), drawn by inverting its cumulative sum at a uniform number. Each request carries its own seed: the
uniforms of its answer come from a generator seeded with it alone, so a sequence's text does not depend on the other
sequences of its batch, nor on the device (the uniforms are drawn on the CPU), beyond the rounding of the arithmetic.
Temperature 0 takes the most likely token (greedy).

Attention runs through `decode_attention` (registered with transformers as `DECODE_ATTENTION` for the sampler's
steps): one query a sequence, each kv head's query group as the rows of two batched products, where torch's CPU
scaled-dot-product kernel with a mask costs several times more at these shapes (benchmarks/convert/README.md#the-self-
texts-sampler).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch


@dataclass
class Request:
    """One sequence to sample: `prompt` ids, then at most `new_tokens` sampled ones (ending after `eos` when it is
    sampled, unless `suppress_eos`: then exactly `new_tokens`), with the uniforms of generator seed `seed`."""

    prompt: list[int]
    new_tokens: int
    seed: int
    suppress_eos: bool = False


@dataclass
class _Slot:
    request: Request
    uniforms: torch.Tensor  # [new_tokens] float64
    order: int  # its place among the requests
    tokens: list[int] = field(default_factory=list)  # the prompt, then the sampled tokens


class SlotCache:
    """Keys and values of each slot's sequence at its own positions, [slots, kv heads, length, head dim] a layer,
    allocated at the first write (the heads and dims are the attention's own). `positions` [slots] is where this
    step's keys go; attention reads the first `span` positions (the mask hides the rest): the whole buffer once the
    furthest slot is past its middle, where copying a part of it to multiply costs more than the masked positions."""

    def __init__(self, layers: int, slots: int, length: int):
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.length, self.rows = length, torch.arange(slots)
        self.positions = torch.zeros(slots, dtype=torch.long)
        self.span, self.index = 1, None

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        if self.keys[layer_idx] is None:
            b, h, _, d = key_states.shape
            self.keys[layer_idx] = key_states.new_zeros(b, h, self.length, d)
            self.values[layer_idx] = value_states.new_zeros(b, h, self.length, value_states.shape[-1])
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.index is None or self.index[0].device != keys.device:  # this step's (rows, positions) there
            self.index = (self.rows.to(keys.device), self.positions.to(keys.device))
        rows, positions = self.index
        keys[rows, :, positions] = key_states[:, :, 0]
        values[rows, :, positions] = value_states[:, :, 0]
        return keys[:, :, : self.span], values[:, :, : self.span]

    def read(self, slot: int, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of slot `slot`'s keys and values at positions 0..n-1, [kv heads, n, head dim] a layer."""
        return [(k[slot, :, :n].clone(), v[slot, :, :n].clone()) for k, v in zip(self.keys, self.values)]

    def write(self, slot: int, kept: list[tuple[torch.Tensor, torch.Tensor]], n: int) -> None:
        """Slot `slot` holds the first `n` positions of `kept` (as `read` gives them)."""
        for layer, (key, value) in enumerate(kept):
            self.keys[layer][slot, :, :n] = key[:, :n]
            self.values[layer][slot, :, :n] = value[:, :n]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only the slots `rows` (in that order)."""
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                if t is not None:
                    store[i] = t.index_select(0, rows.to(t.device))
        self.rows, self.positions = torch.arange(len(rows)), self.positions[rows]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.span


class _PromptStore:
    """The keys and values of prompts the slots have read (each but its last token, which a slot feeds at its first
    sampling step), the oldest dropped once they hold more than `limit` bytes."""

    def __init__(self, limit: int = 256 << 20):
        self.kept: dict[tuple[int, ...], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.limit, self.bytes = limit, 0

    def match(self, prompt: list[int]) -> tuple[int, list | None]:
        """(n, kept): the longest prefix of `prompt` but its last token a kept prompt starts with, and that prompt's
        keys and values ((0, None) when none shares its first token)."""
        best, found = 0, None
        for ids, kv in self.kept.items():
            n, top = 0, min(len(ids), len(prompt) - 1)
            while n < top and ids[n] == prompt[n]:
                n += 1
            if n > best:
                best, found = n, kv
        return best, found

    def add(self, ids: tuple[int, ...], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.kept[ids] = kv
        self.bytes += sum(k.nbytes + v.nbytes for k, v in kv)
        while self.bytes > self.limit and len(self.kept) > 1:
            old = self.kept.pop(next(iter(self.kept)))
            self.bytes -= sum(k.nbytes + v.nbytes for k, v in old)


DECODE_ATTENTION = "mla_convert_decode"


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                     softcap: float | None = None, **kwargs):
    """transformers' attention function contract (query [B, H, Q, D], keys and values [B, KV, S, D] with H a multiple
    of KV, an additive mask [B, 1, Q, S]) -> ([B, Q, H, Dv], None): eager attention's arithmetic (scores scaled,
    soft-capped, masked, softmax) with each kv head's H / KV query heads as the rows of one product instead of copies
    of its keys, and the scores in float32 from the products on (eager attention scales and caps them in the model's
    dtype). Attention sinks and position biases, which no family `_decoding` switches has, are refused."""
    if any(kwargs.get(k) is not None for k in ("s_aux", "sinks", "position_bias")):
        raise NotImplementedError("decode_attention has no attention sinks or position bias")
    b, h, q, _ = query.shape
    kv, span = key.shape[1], key.shape[2]
    if key.dtype != torch.float32 and not key.is_contiguous():
        key = key.contiguous()  # a low-precision product on a strided slice is slower than a copy and a product
    scores = torch.matmul(query.reshape(b, kv, h // kv * q, -1), key.transpose(-1, -2)).float()
    scores = scores * (query.shape[-1] ** -0.5 if scaling is None else scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(b, h, q, span)
    if attention_mask is not None:
        scores = scores + attention_mask[..., :span]
    probs = scores.softmax(-1).to(value.dtype).view(b, kv, h // kv * q, span)
    return torch.matmul(probs, value).view(b, h, q, -1).transpose(1, 2), None


@contextmanager
def _decoding(model):
    """`model` attending through `decode_attention` while in the block (with eager attention's additive masks where
    the model makes its own), set back after; a model of a type the converter does not read (`families`) keeps its
    own attention."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, eager_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from mla_convert.families import SUPPORTED_TYPES

    own = model.config._attn_implementation
    if own == DECODE_ATTENTION or getattr(model.config, "model_type", None) not in SUPPORTED_TYPES:
        yield
        return
    ALL_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(DECODE_ATTENTION, eager_mask)
    model.set_attn_implementation(DECODE_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(own)


def choose(logits: torch.Tensor, temperature: float, uniforms: torch.Tensor) -> torch.Tensor:
    """The token of each row [B] of `logits` [B, V]: the first where the cumulative sum of exp((logits - max) /
    temperature), softmax(logits / temperature) before its normalization, exceeds `uniforms` [B] (in [0, 1)) of its
    total; the most likely one at temperature 0."""
    if temperature == 0:
        return logits.argmax(-1)
    weights = logits.float().sub(logits.amax(-1, keepdim=True)).div_(temperature).exp_()
    cdf = weights.cumsum_(-1)
    threshold = (uniforms.to(cdf.device, torch.float32) * cdf[:, -1]).unsqueeze(1)
    return torch.searchsorted(cdf, threshold, right=True).squeeze(1).clamp_(max=logits.shape[-1] - 1)

def layer_windows(config) -> dict[str, int | None] | int | None:
    """How far back each kind of attention layer looks (None: the whole past): {layer type: window} for a config with
    `layer_types` (its models take a mask per type), else its one sliding window or None."""
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    types = getattr(config, "layer_types", None)
    if types:
        return {t: (window if "sliding" in t else None) for t in set(types)}
    return window


def _mask(positions: torch.Tensor, span: int, window: int | None, dtype, device) -> torch.Tensor:
    """Additive mask [B, 1, 1, span]: 0 where a slot at `positions` sees a cached position (at or before its own,
    within `window`), the dtype's minimum elsewhere."""
    cols = torch.arange(span)
    back = positions[:, None] - cols[None, :]
    seen = (back >= 0) & (back < (window or span + 1))
    mask = torch.zeros(seen.shape, dtype=dtype).masked_fill_(~seen, torch.finfo(dtype).min)
    return mask[:, None, None, :].to(device)


def sample(model, requests: Iterable[Request], width: int, temperature: float, eos: int | None, length: int,
           pad: int = 0, budget: int | None = None) -> Iterator[list[int]]:
    """Sample `requests` on `model` (its device and dtype) in `width` slots of `length` positions (at least the
    longest request's prompt and new tokens); yield each sequence (its prompt, then the sampled tokens, up to and with
    its EOS) in the requests' order. With `budget`, a request starts only while the finished sequences and the most
    the running ones can reach hold fewer than `budget` tokens: the samples end soon after they hold `budget`."""
    requests = iter(requests)
    config = model.config
    windows = layer_windows(config)
    dtype, device = model.dtype, model.device
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    slots: list[_Slot | None] = [None] * width
    pending = _Pending()
    cache = SlotCache(config.num_hidden_layers, width, length)
    tokens = torch.full((width,), pad, dtype=torch.long)
    store = _PromptStore()
    order = 0

    def start(i: int) -> None:
        nonlocal order
        slots[i] = None
        request = next(requests, None) if budget is None or pending.total + _running(slots) < budget else None
        if request is None:
            return
        if len(request.prompt) + request.new_tokens > length or not request.prompt:
            raise ValueError(f"a request of {len(request.prompt)} + {request.new_tokens} tokens does not fit "
                             f"{length} positions, or has no prompt")
        gen = torch.Generator().manual_seed(request.seed)
        copied, kept = store.match(request.prompt)
        if copied:
            cache.write(i, kept, copied)
        slots[i] = _Slot(request, torch.rand(request.new_tokens, generator=gen, dtype=torch.float64), order,
                         list(request.prompt[: copied + 1]))
        order += 1
        tokens[i], cache.positions[i] = request.prompt[copied], copied

    for i in range(width):
        start(i)
    def advance(picked: list[int]) -> None:
        """Each running slot takes its next token (its prompt's, else the picked one); a finished one the next
        request."""
        for i, slot in enumerate(slots):
            if slot is None:
                continue
            n = len(slot.tokens)
            forced = n < len(slot.request.prompt)
            if forced and n == len(slot.request.prompt) - 1 and tuple(slot.tokens) not in store.kept:
                store.add(tuple(slot.tokens), cache.read(i, n))  # the prompt but its last token, read
            token = slot.request.prompt[n] if forced else picked[i]
            slot.tokens.append(token)
            answered = len(slot.tokens) - len(slot.request.prompt)
            if not forced and (answered >= slot.request.new_tokens or (
                    token == eos and not slot.request.suppress_eos)):
                pending.add(slot.order, slot.tokens)
                start(i)
            else:
                tokens[i], cache.positions[i] = token, n

    with _decoding(model):  # the caller's model attends as before once its samples end or are dropped
        while any(s is not None for s in slots):
            # inference mode only around the arithmetic, never across a yield: a mode entered here would stay on in
            # the caller between samples (and be set again there when the generator is closed), which a training
            # loop that reads the samples as they come (selftext.Stream) cannot have
            with torch.inference_mode():
                step = _forward(model, cache, tokens, windows, dtype, device, cache_arg)
                uniforms = torch.tensor([_uniform(s) for s in slots], dtype=torch.float64)
                if eos is not None and any(s is not None and s.request.suppress_eos for s in slots):
                    suppress = torch.tensor([s is not None and s.request.suppress_eos for s in slots])
                    step[suppress.to(step.device), eos] = torch.finfo(step.dtype).min
                advance(choose(step, temperature, uniforms).tolist())
                ready = list(pending.ready())
                slots, tokens = _shrink(slots, tokens, cache)
            yield from ready


class _Pending:
    """Finished sequences held until the ones before them (in request order) finish."""

    def __init__(self):
        self.done: dict[int, list[int]] = {}
        self.next, self.total = 0, 0

    def add(self, order: int, tokens: list[int]) -> None:
        self.done[order] = tokens
        self.total += len(tokens)

    def ready(self) -> Iterator[list[int]]:
        while self.next in self.done:
            yield self.done.pop(self.next)
            self.next += 1


def _running(slots) -> int:
    """The most tokens the running sequences can end with."""
    return sum(len(s.request.prompt) + s.request.new_tokens for s in slots if s is not None)


def _uniform(slot: _Slot | None) -> float:
    """The uniform a slot samples its next token at (any number while it still reads its prompt, or is idle)."""
    if slot is None:
        return 0.5
    answered = len(slot.tokens) - len(slot.request.prompt)
    return float(slot.uniforms[answered]) if 0 <= answered < len(slot.uniforms) else 0.5


def _forward(model, cache: SlotCache, tokens, windows, dtype, device, cache_arg) -> torch.Tensor:
    """One step: each slot's token at its position -> the next-token logits [B, V] (float32)."""
    positions = cache.positions
    furthest = int(positions.max()) + 1
    cache.span, cache.index = (furthest if 2 * furthest <= cache.length else cache.length), None
    if isinstance(windows, dict):
        mask = {kind: _mask(positions, cache.span, w, dtype, device) for kind, w in windows.items()}
    else:
        mask = _mask(positions, cache.span, windows, dtype, device)
    out = model(input_ids=tokens[:, None].to(device), position_ids=positions[:, None].to(device), attention_mask=mask,
                use_cache=True, **{cache_arg: cache})
    return out.logits[:, -1].float()


def _shrink(slots, tokens, cache: SlotCache):
    """Once at most half the slots run (no request left to start), keep only the running ones."""
    live = [i for i, s in enumerate(slots) if s is not None]
    if not live or len(live) > len(slots) // 2:
        return slots, tokens
    rows = torch.tensor(live)
    cache.keep(rows)
    return [slots[i] for i in live], tokens[rows]
