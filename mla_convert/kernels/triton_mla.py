"""Triton kernel for absorbed MLA decode: one query token per sequence against the latent cache.

Every query head reads the same cached rows (`c` [S, d_c] and `k_r` [S, d_r]), so this is multi-query attention
with key `[c, k_r]` (head dim d_c + d_r) and value `c` (d_c). The work is split in two launches (split-KV, as in
flash-decoding):

1. `_split_kernel`, grid (B, head blocks, splits): each program loads BLOCK_H query heads once, walks its slice of
   the sequence in BLOCK_N rows, and keeps an online softmax (running max `m`, running sum `l`, accumulator
   `acc` [BLOCK_H, d_c]). Each cached row is read once per head block, whatever the number of heads. It writes the
   normalized partial output and its log-sum-exp (base 2).
2. `_merge_kernel`, grid (B, H): merges the splits of one head with their log-sum-exps, a [BLOCK_S, d_c] tile of
   partial outputs a load (a split at a time would serialize one dependent load per split). Skipped when there is
   one split (the first launch then writes the output directly).

Rows at or past `lengths[b]` are never read. A split that starts past the end writes lse = -inf and drops out of the
merge. Scores are taken in base 2 (`scale * log2(e)` folded in), as exp2 is the cheap instruction.

This module imports triton at import time; `mla_convert.kernels` imports it lazily, only when the kernel runs.
With TRITON_INTERPRET=1 in the environment *before triton is first imported* the kernels run in Triton's CPU
interpreter on CPU tensors (slow, for tests only). Triton fixes the mode at import (the `tl` library functions are
decorated then), so one process cannot mix interpreted and compiled kernels.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton import knobs

from mla_convert.errors import UserError

LOG2E = 1.4426950408889634


@triton.jit
def _split_kernel(
    QL, QR, C, KR, LEN, VALID, O, LSE,  # pointers
    stride_qlb, stride_qlh, stride_qrb, stride_qrh,
    stride_cb, stride_cs, stride_krb, stride_krs, stride_len, stride_vb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    H, D_C, D_R, split_len, scale_log2,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    HAS_ROPE: tl.constexpr, HAS_VALID: tl.constexpr, IEEE: tl.constexpr,
):
    b = tl.program_id(0)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    length = tl.load(LEN + b * stride_len)  # stride 0: one length for the whole batch (a static cache's counter)
    start = sp * split_len
    end = tl.minimum(start + split_len, length)

    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    mask_h = offs_h < H
    mask_c = offs_c < D_C
    mask_r = offs_r < D_R

    q = tl.load(QL + b * stride_qlb + offs_h[:, None] * stride_qlh + offs_c[None, :],
                mask=mask_h[:, None] & mask_c[None, :], other=0.0).to(C.dtype.element_ty)  # [BLOCK_H, BLOCK_C]
    if HAS_ROPE:
        qr = tl.load(QR + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_r[None, :],
                     mask=mask_h[:, None] & mask_r[None, :], other=0.0).to(KR.dtype.element_ty)  # [BLOCK_H, BLOCK_R]

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        if HAS_VALID:  # padding: rows inside the length that a sequence must not attend to
            mask_n &= tl.load(VALID + b * stride_vb + offs_n, mask=mask_n, other=0) != 0
        c = tl.load(C + b * stride_cb + offs_n[:, None] * stride_cs + offs_c[None, :],
                    mask=mask_n[:, None] & mask_c[None, :], other=0.0)  # [BLOCK_N, BLOCK_C]
        if IEEE:
            s = tl.dot(q, tl.trans(c), input_precision="ieee")  # [BLOCK_H, BLOCK_N]
        else:
            s = tl.dot(q, tl.trans(c))
        if HAS_ROPE:
            kr = tl.load(KR + b * stride_krb + offs_n[:, None] * stride_krs + offs_r[None, :],
                         mask=mask_n[:, None] & mask_r[None, :], other=0.0)  # [BLOCK_N, BLOCK_R]
            if IEEE:
                s += tl.dot(qr, tl.trans(kr), input_precision="ieee")
            else:
                s += tl.dot(qr, tl.trans(kr))
        s = tl.where(mask_n[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # -inf only while every row so far was masked (padding): subtract 0 then, so exp2 gives 0, not nan.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_sub)
        p = tl.exp2(s - m_sub[:, None])  # [BLOCK_H, BLOCK_N]
        l = l * alpha + tl.sum(p, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(c.dtype), c)
        m = m_new

    nonempty = l > 0.0
    out = acc / tl.where(nonempty, l, 1.0)[:, None]
    tl.store(O + b * stride_ob + offs_h[:, None] * stride_oh + sp * stride_os + offs_c[None, :], out,
             mask=mask_h[:, None] & mask_c[None, :])
    lse = tl.where(nonempty, m + tl.log2(tl.where(nonempty, l, 1.0)), float("-inf"))
    tl.store(LSE + b * stride_lb + offs_h * stride_lh + sp, lse, mask=mask_h)


@triton.jit
def _merge_kernel(
    O_PART, LSE, OUT,
    stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
    D_C, num_splits,
    BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, BLOCK_C)
    mask_c = offs_c < D_C
    lse_ptr = LSE + b * stride_lb + h * stride_lh
    part_ptr = O_PART + b * stride_pb + h * stride_ph
    # Pass 1: the largest log-sum-exp, BLOCK_S splits a load. Finite: split 0 always holds row 0.
    m_vec = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        lse = tl.load(lse_ptr + s0 + offs_s, mask=s0 + offs_s < num_splits, other=float("-inf"))  # [BLOCK_S]
        m_vec = tl.maximum(m_vec, lse)
    m = tl.max(m_vec, axis=0)
    # Pass 2: weighted sum of the partial outputs, a [BLOCK_S, BLOCK_C] tile a load (empty splits weigh 0).
    acc = tl.zeros([BLOCK_S, BLOCK_C], dtype=tl.float32)
    w_sum = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        mask_s = s0 + offs_s < num_splits
        w = tl.exp2(tl.load(lse_ptr + s0 + offs_s, mask=mask_s, other=float("-inf")) - m)  # [BLOCK_S]
        part = tl.load(part_ptr + (s0 + offs_s)[:, None] * stride_ps + offs_c[None, :],
                       mask=mask_s[:, None] & mask_c[None, :], other=0.0)  # [BLOCK_S, BLOCK_C]
        acc += w[:, None] * part
        w_sum += w
    out = tl.sum(acc, axis=0) / tl.sum(w_sum, axis=0)  # [BLOCK_C]
    tl.store(OUT + b * stride_ob + h * stride_oh + offs_c, out, mask=mask_c)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@functools.lru_cache(maxsize=1024)
def launch_config(batch: int, heads: int, seq_len: int, d_c: int, d_r: int, sm_count: int,
                  num_splits: int | None = None, *, block_n: int | None = None, programs_per_sm: int = 2,
                  min_split_rows: int = 256, max_split_rows: int | None = 2048, max_splits: int = 64,
                  num_warps: int = 4, num_stages: int | None = None) -> dict:
    """Block sizes, the sequence split and the launch options for one call (a pure function of the shapes and the
    tuning knobs, so tests can check it).

    BLOCK_H heads share one read of each cached row; the accumulator is BLOCK_H x d_c floats per program, so wide
    latents get fewer heads and shorter row blocks (register budget). Splits are added until the grid holds about
    `programs_per_sm` programs per SM, but never so many that a split gets fewer than `min_split_rows` rows (merge
    overhead would dominate), nor more than `max_splits`; where the batch alone fills the GPU, splits are still added
    until none holds more than `max_split_rows` rows (None: no such floor), as shorter splits balance the programs
    across SMs better. `block_n` overrides the row block (a power of two >= 16).
    tl.dot wants every dimension >= 16, hence the floors.

    Cached (decode calls it with the same shapes every step, and its host time counts): callers must not modify the
    returned dict.

    Defaults: 128-row blocks and 3 stages for latents up to 64 wide; a 256-wide tile (d_c 129-256) takes 32 rows and 3
    stages, the shared memory of the 128-wide default; wider latents keep 2 stages; `max_split_rows` 2048. Chosen by
    launch sweeps on a GPU (`benchmarks/decode/run.py --kernel-sweep`): docs/decisions.md#decode-kernel-launch-defaults.
    """
    block_c = max(16, _next_pow2(d_c))
    block_r = max(16, _next_pow2(d_r)) if d_r else 16
    max_h = 64 if block_c <= 128 else (32 if block_c <= 256 else 16)
    block_h = min(max(16, _next_pow2(heads)), max_h)
    if block_n is None:
        block_n = 128 if block_c <= 64 else (64 if block_c <= 128 else (32 if block_c <= 512 else 16))
    if num_stages is None:
        num_stages = 3 if block_c <= 256 else 2
    head_blocks = triton.cdiv(heads, block_h)
    if num_splits is None:
        wanted = triton.cdiv(programs_per_sm * sm_count, batch * head_blocks)
        if max_split_rows:
            wanted = max(wanted, triton.cdiv(seq_len, max_split_rows))
        num_splits = max(1, min(wanted, triton.cdiv(seq_len, min_split_rows), max_splits))
    num_splits = max(1, min(num_splits, triton.cdiv(seq_len, block_n)))
    split_len = triton.cdiv(triton.cdiv(seq_len, num_splits), block_n) * block_n
    num_splits = triton.cdiv(seq_len, split_len)  # rounding the split length up may leave fewer splits
    return dict(BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_C=block_c, BLOCK_R=block_r, head_blocks=head_blocks,
                num_splits=num_splits, split_len=split_len, num_warps=num_warps, num_stages=num_stages)


def mla_decode_triton(q_latent, q_rope, latent, k_rope, lengths, scale, num_splits: int | None = None,
                      tune: dict | None = None, *, valid=None):
    """Same contract as `mla_convert.kernels.mla_decode_reference` (with `valid`); `num_splits` overrides the split
    heuristic and `tune` passes keyword knobs to `launch_config` (block_n, programs_per_sm, min_split_rows,
    max_split_rows, max_splits, num_warps, num_stages; for benchmarks).

    Inputs may be strided views as long as the last dim is contiguous; `lengths` may be any integer dtype, a
    stride-0 view (one count for the batch, e.g. a static cache's counter expanded) or 0-d; `valid` [B|1, >=S] bool
    may have batch stride 0. Nothing is copied to or from the host and nothing waits on the device, so the call can be
    captured in a CUDA graph: the grid depends only on the shapes (S is the cache's capacity; splits past a
    sequence's length exit at once). CUDA tensors run compiled; CPU tensors (or TRITON_INTERPRET=1) run in the
    interpreter.
    """
    bsz, heads, d_c = q_latent.shape
    seq_len, d_r = latent.shape[1], k_rope.shape[-1]
    device = latent.device
    interpret = bool(knobs.runtime.interpret)
    if device.type != "cuda" and not interpret:
        raise UserError("the Triton MLA decode kernel needs CUDA tensors (or TRITON_INTERPRET=1 set before triton is "
                        "imported, to run it on CPU in the interpreter); use backend='torch' on this device")
    q_latent, q_rope, latent, k_rope = (t if t.stride(-1) == 1 else t.contiguous()
                                        for t in (q_latent, q_rope, latent, k_rope))
    if lengths.device != device or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        lengths = lengths.to(device=device, dtype=torch.int32)
    if lengths.dim() == 0:
        lengths = lengths.expand(bsz)
    if valid is not None:
        valid = valid.to(device=device, dtype=torch.bool) if valid.device != device or valid.dtype != torch.bool \
            else valid
        if valid.stride(-1) != 1:
            valid = valid.contiguous()
        valid = valid.expand(bsz, valid.shape[-1]).view(torch.uint8)  # [B, >=S], batch stride 0 where broadcast
    out = torch.empty((bsz, heads, d_c), dtype=latent.dtype, device=device)
    if bsz == 0 or heads == 0:
        return out
    if seq_len == 0:
        return out.fill_(float("nan"))  # the reference's softmax over nothing
    sms = 1 if interpret else _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    cfg = launch_config(bsz, heads, seq_len, d_c, d_r, sms, num_splits, **(tune or {}))
    splits = cfg["num_splits"]
    if splits == 1:
        o_part = out.unsqueeze(2)  # [B, H, 1, d_c]: the first launch writes the result directly
    else:
        o_part = torch.empty((bsz, heads, splits, d_c), dtype=torch.float32, device=device)
    lse = torch.empty((bsz, heads, splits), dtype=torch.float32, device=device)
    has_rope = d_r > 0
    if not has_rope:
        k_rope = latent  # never read; any valid pointer
        q_rope = q_latent
    _split_kernel[(bsz, cfg["head_blocks"], splits)](
        q_latent, q_rope, latent, k_rope, lengths, lengths if valid is None else valid, o_part, lse,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        latent.stride(0), latent.stride(1), k_rope.stride(0), k_rope.stride(1),
        lengths.stride(0), 0 if valid is None else valid.stride(0),
        o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
        heads, d_c, d_r, cfg["split_len"], float(scale) * LOG2E,
        BLOCK_H=cfg["BLOCK_H"], BLOCK_N=cfg["BLOCK_N"], BLOCK_C=cfg["BLOCK_C"], BLOCK_R=cfg["BLOCK_R"],
        HAS_ROPE=has_rope, HAS_VALID=valid is not None, IEEE=latent.dtype == torch.float32,
        **({} if interpret else {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}),
    )
    if splits > 1:
        _merge_kernel[(bsz, heads)](
            o_part, lse, out,
            o_part.stride(0), o_part.stride(1), o_part.stride(2), lse.stride(0), lse.stride(1),
            out.stride(0), out.stride(1),
            d_c, splits,
            BLOCK_C=cfg["BLOCK_C"], BLOCK_S=max(2, min(_next_pow2(splits), 4096 // cfg["BLOCK_C"])),
            **({} if interpret else {"num_warps": 4}),
        )
    return out


__all__ = ["launch_config", "mla_decode_triton"]
