"""The cache's name in transformers' model API.

transformers 5.24 renamed the `past_key_values` argument and output field to `cache` (generation passes `cache=`,
gradient checkpointing drops only `cache`, outputs carry `.cache`); earlier 5.x releases use `past_key_values`. Our
modeling code speaks whichever the installed release does, and accepts either name from callers: on a release that
names it `cache`, the old name is renamed with transformers' own deprecation warning (`renamed_cache_kwarg`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from transformers.masking_utils import create_causal_mask

CACHE_KWARG = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
OLD_CACHE_KWARG = "past_key_values"


def renamed_cache_kwarg(func):
    """Where the installed release names the cache `cache`, a call passing `past_key_values` warns (transformers'
    `deprecate_kwarg`, as its own models do) and passes it on as `cache`; elsewhere `func` unchanged. Two different
    caches at once are refused under either release."""
    if CACHE_KWARG != "cache":
        return func
    from transformers.utils.deprecation import deprecate_kwarg

    renamed = deprecate_kwarg(OLD_CACHE_KWARG, "5.40.0", new_name="cache")(func)

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        old, new = kwargs.get(OLD_CACHE_KWARG), kwargs.get("cache")
        if old is not None and new is not None and old is not new:
            raise ValueError("pass the cache once: `cache` or `past_key_values`, not both")
        if old is not None and old is new:
            kwargs.pop(OLD_CACHE_KWARG)
        return renamed(*args, **kwargs)

    return wrapper


def take_cache(cache: Any, kwargs: dict) -> Any:
    """The cache passed under either name: `cache` (the argument) or `past_key_values` (popped from kwargs)."""
    old = kwargs.pop(OLD_CACHE_KWARG, None)
    if old is not None and cache is not None and old is not cache:
        raise ValueError("pass the cache once: `cache` or `past_key_values`, not both")
    return cache if cache is not None else old


def cache_kwargs(cache: Any) -> dict:
    """Keyword arguments passing `cache` to a transformers model or layer under the installed release's name."""
    return {CACHE_KWARG: cache}


def output_cache(output: Any) -> Any:
    """The cache a transformers model output carries, whichever release made it."""
    return getattr(output, CACHE_KWARG)
