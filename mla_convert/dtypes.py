"""The dtype names the commands and recipes accept, and bytes per element for any dtype name a record holds."""

from __future__ import annotations

import torch

# --dtype (convert, eval, generate) and the recipes' dtype: name -> torch dtype
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_bytes(name: str) -> int | None:
    """Bytes per element of the torch dtype called `name` ("bfloat16", "torch.float16", "half", ...); None when torch
    has no dtype of that name."""
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


# Models narrower than this compute in float32 even where the CPU has bfloat16 arithmetic: below it the casts cost more
# than the products save (docs/decisions.md#refinement-precision)
BF16_MIN_HIDDEN = 256


def cpu_bf16_native() -> bool:
    """Whether this CPU has bfloat16 arithmetic (AVX512-BF16 or AMX tiles), not an emulation of it."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_prefers_bf16(hidden: int) -> bool:
    """Whether a model of hidden size `hidden` computes faster in bfloat16 than in float32 on this CPU."""
    return cpu_bf16_native() and hidden >= BF16_MIN_HIDDEN


__all__ = ["BF16_MIN_HIDDEN", "DTYPES", "cpu_bf16_native", "cpu_prefers_bf16", "dtype_bytes"]
