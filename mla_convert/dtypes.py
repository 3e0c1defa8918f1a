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


__all__ = ["DTYPES", "dtype_bytes"]
