"""Text generation with a timed decode and the KV cache the model really holds (`mla-convert generate`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers.generation.streamers import BaseStreamer

from mla_convert import evaluate
from mla_convert.errors import UserError
from mla_convert.modeling.compat import output_cache

CACHES = ("dynamic", "static")


class _Clock(BaseStreamer):
    """Time stamps of generate's pushes: the prompt first, then one push per new token."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


@dataclass
class Generation:
    text: str  # the new tokens, decoded
    prompt_tokens: int
    new_tokens: int
    seconds: float  # the whole generate call
    first_token_seconds: float | None  # the prefill (None with fewer than two new tokens)
    decode_rate: float | None  # new tokens per second over the decode steps (None: too few steps to time)
    compiled_first_step: bool  # the first decode step compiled (static cache on CUDA): the rate is from the second on
    bytes_per_token: int | None  # the cache's bytes per token (all layers), as the model holds it
    cached_tokens: int
    cache_bytes: int
    capacity: int | None  # a static cache's rows allocated; None for a dynamic cache


def check_settings(max_new_tokens: int, sample: bool, temperature: float | None, prompt: str, cache: str) -> None:
    """One clear line for settings that cannot run, before any model is read."""
    if max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    if temperature is not None and not sample:
        raise UserError("--temperature applies to sampling only: add --sample (greedy is the default)")
    if temperature is not None and temperature <= 0:
        raise UserError(f"--temperature must be positive, got {temperature} (drop --sample for greedy decoding)")
    if not prompt:
        raise UserError("--prompt is empty: give some text to continue")
    if cache not in CACHES:
        raise UserError(f"--cache must be dynamic or static, got {cache!r}")


def encode_prompt(tokenizer, prompt: str, label: str, chat: bool, device: str) -> torch.Tensor:
    """The prompt's ids [1, P] on `device`; with `chat`, as a user message in the tokenizer's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError(f"the tokenizer of {label} has no chat template: drop --chat")
        from mla_convert.templates import apply_chat_template

        encoded = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}], label,
                                      add_generation_prompt=True, return_tensors="pt", return_dict=True)
    else:
        encoded = tokenizer(prompt, return_tensors="pt")
    ids = encoded["input_ids"].to(device)
    if ids.shape[1] == 0:
        raise UserError("the prompt encodes to no tokens: give some text to continue")
    return ids


def generate(net, tokenizer, ids: torch.Tensor, max_new_tokens: int, sample: bool = False,
             temperature: float | None = None, seed: int = 0, cache: str = "dynamic") -> Generation:
    """Greedy (or sampled) continuation of `ids`, timed per token, with the cache the model held at the end."""
    options = dict(max_new_tokens=max_new_tokens, do_sample=sample, return_dict_in_generate=True)
    if cache == "static":
        options["cache_implementation"] = "static"
    if sample:  # other sampling settings (top_k, top_p) come from the model's generation_config.json
        torch.manual_seed(seed)
        if temperature is not None:
            options["temperature"] = temperature
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    clock = _Clock()
    with torch.inference_mode():
        start = time.perf_counter()
        out = net.generate(ids, attention_mask=torch.ones_like(ids), pad_token_id=pad, streamer=clock, **options)
        if ids.is_cuda:
            torch.cuda.synchronize(ids.device)
        seconds = time.perf_counter() - start
    new = out.sequences[0, ids.shape[1]:]
    held = output_cache(out)
    if cache == "static" and held is not None:  # preallocated: what its buffers hold per row
        per_token = sum(evaluate.tensor_bytes((layer.keys, layer.values)) // layer.keys.shape[-2]
                        for layer in held.layers)
    else:
        per_token = evaluate.kv_cache_bytes_per_token(net)
    # first token = prefill; the rest are decode steps over the cache. A static cache on CUDA compiles at the first
    # decode step: its rate is taken from the second on.
    compiled = cache == "static" and ids.is_cuda
    first = 2 if compiled else 1
    stamps = clock.stamps
    timed = len(stamps) > first + 1
    return Generation(
        text=tokenizer.decode(new, skip_special_tokens=True),
        prompt_tokens=ids.shape[1],
        new_tokens=new.numel(),
        seconds=seconds,
        first_token_seconds=stamps[1] - start if timed else None,
        decode_rate=(len(stamps) - first - 1) / (stamps[-1] - stamps[first]) if timed else None,
        compiled_first_step=compiled,
        bytes_per_token=per_token,
        cached_tokens=int(held.get_seq_length()) if held is not None else 0,  # a static cache counts in a tensor
        cache_bytes=evaluate.cache_bytes(held),
        capacity=held.layers[0].keys.shape[-2] if cache == "static" and held is not None else None,
    )
