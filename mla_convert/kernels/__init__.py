"""Absorbed MLA decode attention: a Triton kernel for CUDA and its torch reference (the oracle).

Contract shared by every entry point (one decode step, one query token per sequence):

    q_latent [B, H, d_c]   query heads with W_uk absorbed (q_nope_h^T W_uk_h)
    q_rope   [B, H, d_r]   rotated rope part of the query (d_r may be 0)
    latent   [B, S, d_c]   cached latent c
    k_rope   [B, S, d_r]   cached, already rotated rope key
    lengths  [B] int       valid cache rows per sequence, 1 <= lengths[b] <= S; rows past it are ignored
                           (0-d, or a stride-0 view: one count for the batch, as a static cache keeps it)
    scale    float         softmax scale
    valid    [B|1, >=S] bool or None: rows a sequence attends to (False: padding); None: every row below its length
    -> [B, H, d_c]         sum_j softmax_j(scale * (q_latent . c_j + q_rope . k_r_j)) c_j, in latent's dtype

The Triton kernel lives in `triton_mla` and is imported only when it runs, so importing this package never
imports triton.
"""

from __future__ import annotations

import importlib.util

import torch


# Looked up once, at import: torch.compile does not trace `find_spec` (a graph break in every decode step, which
# left `generate` over a static cache on CUDA recompiling each layer's attention and then running it eagerly).
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """True when triton is installed (the kernel then runs on CUDA, or on CPU in Triton's interpreter)."""
    return _TRITON_INSTALLED


def mla_decode_reference(q_latent, q_rope, latent, k_rope, lengths, scale, valid=None):
    """One decode step over the latent cache, in plain torch (float32 math, latent's dtype out). See the module doc."""
    seq_len = latent.shape[1]
    scores = torch.einsum("bhc,bsc->bhs", q_latent.float(), latent.float())  # [B, H, S]
    scores = scores + torch.einsum("bhr,bsr->bhs", q_rope.float(), k_rope.float())
    lengths = lengths.to(latent.device).expand(q_latent.shape[0])
    rows = torch.arange(seq_len, device=latent.device)[None, :] < lengths[:, None]  # [B, S]
    valid = rows if valid is None else rows & valid[..., :seq_len].to(latent.device, torch.bool)
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhs,bsc->bhc", torch.softmax(scores, dim=-1), latent.float()).to(latent.dtype)


def mla_decode(q_latent, q_rope, latent, k_rope, lengths, scale, *, valid=None, backend: str = "auto",
               num_splits: int | None = None):
    """One decode step over the latent cache (contract in the module doc).

    backend: "auto" runs the Triton kernel when the inputs are on CUDA and triton is installed, the torch reference
    otherwise; "triton" forces the kernel (on CPU tensors it runs in Triton's interpreter: correct but slow, meant
    for tests); "torch" forces the reference. num_splits: sequence splits of the kernel (None: chosen from the
    shapes and the GPU's SM count); ignored by the reference.
    """
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"backend must be auto, triton or torch, got {backend!r}")
    use_triton = backend == "triton" or (backend == "auto" and latent.is_cuda and triton_available())
    if not use_triton:
        return mla_decode_reference(q_latent, q_rope, latent, k_rope, lengths, scale, valid)
    if num_splits is None and torch.compiler.is_compiling():
        # torch.compile (e.g. `generate` over a static cache on CUDA) sees the kernel as one opaque operator: it
        # neither traces the launch code nor recompiles the kernel (Inductor failed to build it as a user kernel).
        return torch.ops.mla_convert.mla_decode_triton(q_latent, q_rope, latent, k_rope, lengths, scale, valid)
    return _triton_call(q_latent, q_rope, latent, k_rope, lengths, scale, valid, num_splits)


def _triton_call(q_latent, q_rope, latent, k_rope, lengths, scale, valid, num_splits=None):
    from mla_convert.kernels import triton_mla  # the module attribute, looked up per call (tests wrap it)

    return triton_mla.mla_decode_triton(q_latent, q_rope, latent, k_rope, lengths, scale, num_splits=num_splits,
                                        valid=valid)


@torch.library.custom_op(
    "mla_convert::mla_decode_triton", mutates_args=(),
    schema="(Tensor q_latent, Tensor q_rope, Tensor latent, Tensor k_rope, Tensor lengths, float scale, "
           "Tensor? valid) -> Tensor",
)
def _mla_decode_op(q_latent, q_rope, latent, k_rope, lengths, scale, valid):
    return _triton_call(q_latent, q_rope, latent, k_rope, lengths, scale, valid)


@_mla_decode_op.register_fake
def _(q_latent, q_rope, latent, k_rope, lengths, scale, valid):
    return latent.new_empty((q_latent.shape[0], q_latent.shape[1], latent.shape[-1]))


__all__ = ["mla_decode", "mla_decode_reference", "triton_available"]
