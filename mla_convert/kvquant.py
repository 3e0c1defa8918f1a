"""Quantized KV caches as the engines store them: ggml's block types (llama.cpp's `--cache-type-k/-v`), bit for bit.

A cached row (one token's key or value of one layer in the source; the latent and rope key `[c, k_r]` in an MLA model)
is cut into blocks of 32 values; each block keeps a float16 scale (and a float16 minimum for the `_1` types) and one
small integer per value. `round_trip(x, kind)` gives exactly what an engine reads back after writing `x`: ggml's
reference rounding (`quantize_row_*_ref` in ggml-quants.c; tests/test_kvquant.py checks it against gguf-py's bit-exact
port, and iq4_nl against llama.cpp's own library), float16 scales rounded to nearest even, arithmetic in float32.

Where the values sit along the row decides which ones share a block, and so the error (not the bytes):
llama.cpp stores a Llama key with each RoPE pair's two dims side by side (the GGUF's permuted q/k rows), so a block
holds 16 whole frequency pairs; transformers' rotate_half layout puts the first halves of all 32 pairs in one block.
And since April 2026 llama.cpp rotates each quantized head by a Hadamard matrix before storing it (`engine_rotation`),
which spreads a head's outlier dims over all its blocks: `read_source_cache_as` simulates a source's cache with both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32


@dataclass(frozen=True)
class CacheType:
    name: str
    bytes_per_block: int  # bytes one block of 32 values takes (float types: 32 values' bytes)
    levels: int  # integer levels per value (0 for float types)
    offset: bool  # "_1" types: a per-block minimum as well as a scale


CACHE_TYPES = {
    "f32": CacheType("f32", 128, 0, False),
    "f16": CacheType("f16", 64, 0, False),
    "bf16": CacheType("bf16", 64, 0, False),
    "q8_0": CacheType("q8_0", 34, 255, False),
    "q5_1": CacheType("q5_1", 24, 32, True),
    "q5_0": CacheType("q5_0", 22, 32, False),
    "q4_1": CacheType("q4_1", 20, 16, True),
    "q4_0": CacheType("q4_0", 18, 16, False),
    "iq4_nl": CacheType("iq4_nl", 18, 16, False),  # 16 fixed non-uniform levels (IQ4_NL_VALUES) times a scale
}
IQ4_NL_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)  # ggml's kvalues_iq4nl


def cache_type(name: str) -> CacheType:
    try:
        return CACHE_TYPES[name]
    except KeyError:
        raise ValueError(f"unknown cache type {name!r}: use one of {', '.join(CACHE_TYPES)}") from None


def row_bytes(values: int, kind: str) -> float:
    """Bytes a cached row of `values` takes in cache type `kind` (ggml pads nothing: a quantized row must be a
    multiple of 32 values, see `check_row`)."""
    return values * cache_type(kind).bytes_per_block / BLOCK


def check_row(values: int, kind: str) -> None:
    if cache_type(kind).levels and values % BLOCK:
        raise ValueError(f"a {kind} cache needs rows of a multiple of {BLOCK} values, not {values}")


def _fp16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float16).to(torch.float32)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / torch.where(d == 0, torch.ones_like(d), d))


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C's roundf: halves away from zero (torch.round rounds them to even)."""
    return torch.sign(x) * torch.floor(x.abs() + 0.5)


FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Blocks:
    """Rows quantized in blocks of 32: the integer per value (`codes`, [..., blocks, 32]; iq4_nl: the index of its
    level), the float16 scale and, for the `_1` types, the float16 minimum (both [..., blocks, 1], float32 holding
    float16 values): what a ggml block stores, unpacked."""

    codes: torch.Tensor
    scale: torch.Tensor
    low: torch.Tensor | None = None


def _symmetric(blocks: torch.Tensor, levels: int) -> Blocks:
    """q4_0 / q5_0: the block's value of largest magnitude (its first, on ties) maps to -levels/2."""
    half = levels // 2
    index = blocks.abs().argmax(dim=-1, keepdim=True)
    d = blocks.gather(-1, index) / -half
    return Blocks(torch.trunc(blocks * _inverse(d) + (half + 0.5)).clamp(0, levels - 1), _fp16(d))


def _affine(blocks: torch.Tensor, levels: int) -> Blocks:
    """q4_1 / q5_1: the block's minimum and step, both stored in float16."""
    low = blocks.amin(dim=-1, keepdim=True)
    d = (blocks.amax(dim=-1, keepdim=True) - low) / (levels - 1)
    return Blocks(torch.trunc((blocks - low) * _inverse(d) + 0.5).clamp(0, levels - 1), _fp16(d), _fp16(low))


def _q8_0(blocks: torch.Tensor) -> Blocks:
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    return Blocks(_roundf(blocks * _inverse(d)), _fp16(d))


def _iq4_nl(blocks: torch.Tensor) -> Blocks:
    """iq4_nl as a cache stores it (ggml's from_float for the type: quantize_row_iq4_nl_ref, no scale search): each
    value to the nearest of IQ4_NL_VALUES at the scale that sends the block's largest magnitude to -127 (ties to the
    upper level), then the block's float16 scale refitted by least squares weighted by each value's square."""
    values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32)
    index = blocks.abs().argmax(dim=-1, keepdim=True)
    largest = blocks.gather(-1, index)
    scaled = blocks * _inverse(largest / values[0])
    codes = torch.bucketize(scaled, (values[1:] + values[:-1]) / 2, right=True)
    level = values[codes]
    weight = blocks * blocks
    sum_qx, sum_q2 = (weight * level * blocks).sum(-1, keepdim=True), (weight * level * level).sum(-1, keepdim=True)
    d = torch.where(sum_q2 > 0, sum_qx / torch.where(sum_q2 > 0, sum_q2, torch.ones_like(sum_q2)), 0.0)
    empty = largest.abs() < 1e-15  # ggml's GROUP_MAX_EPS: a zero scale
    return Blocks(codes.float(), torch.where(empty, 0.0, _fp16(d)))


def quantize(x: torch.Tensor, kind: str) -> Blocks:
    """Rows `x` [..., n] (n a multiple of 32) in the quantized cache type `kind`, as ggml's reference rounding
    quantizes them (arithmetic in float32)."""
    spec = cache_type(kind)
    if not spec.levels:
        raise ValueError(f"{kind} is a float type: nothing to quantize")
    check_row(x.shape[-1], kind)
    blocks = x.float().reshape(*x.shape[:-1], -1, BLOCK)
    if kind == "q8_0":
        return _q8_0(blocks)
    if kind == "iq4_nl":
        return _iq4_nl(blocks)
    return _affine(blocks, spec.levels) if spec.offset else _symmetric(blocks, spec.levels)


def dequantize(q: Blocks, kind: str) -> torch.Tensor:
    """The values blocks `q` of cache type `kind` read back as, float32 [..., n]."""
    spec = cache_type(kind)
    if kind == "iq4_nl":
        values = torch.tensor(IQ4_NL_VALUES, dtype=torch.float32, device=q.codes.device)
        out = torch.where(q.scale == 0, 0.0, values[q.codes.long()] * q.scale)
    elif kind == "q8_0":
        out = q.codes * q.scale
    elif spec.offset:
        out = q.codes * q.scale + q.low
    else:
        out = (q.codes - spec.levels // 2) * q.scale
    return out.reshape(*out.shape[:-2], -1)


def round_trip(x: torch.Tensor, kind: str) -> torch.Tensor:
    """What a cache of type `kind` gives back for rows `x` [..., n] (blocks along the last dim), in x's dtype. Where
    x needs a gradient (training), the rounding passes it straight through: the forward values are the type's (to the
    last bit of x's dtype's addition), the backward is the identity, so the layers that write the cache learn what its
    rounding costs instead of a zero gradient through the rounded codes."""
    if kind == "f32":
        return x
    if not cache_type(kind).levels:
        return x.to(FLOAT_DTYPES[kind]).to(x.dtype)
    out = dequantize(quantize(x.detach(), kind), kind).to(x.dtype)
    return x + (out - x).detach() if x.requires_grad and torch.is_grad_enabled() else out


def _bytes(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype` as its bytes along the last dim, little-endian as ggml writes them (torch's view gives the
    machine's order: every platform torch ships for is little-endian)."""
    return x.to(dtype).contiguous().view(torch.uint8)


def pack(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Rows `x` [..., n] as cache type `kind` holds them in memory: ggml's block structs byte for byte (q8_0: scale,
    32 int8; q4_0 / iq4_nl: scale, 16 bytes of two 4-bit codes, value j in the low and j+16 in the high nibble; q4_1:
    scale, minimum, codes; q5_0 / q5_1: scale, (minimum,) the 32 fifth bits as a little-endian uint32, then the low 4
    bits as q4_0's), uint8 [..., n / 32 * bytes_per_block]; a float type: its values' own bytes."""
    spec = cache_type(kind)
    if not spec.levels:
        return _bytes(x, FLOAT_DTYPES[kind])
    q = quantize(x, kind)
    codes = q.codes.to(torch.int64)
    parts = [_bytes(q.scale, torch.float16)] + ([_bytes(q.low, torch.float16)] if q.low is not None else [])
    if kind == "q8_0":
        parts.append(codes.to(torch.int8).view(torch.uint8))
    else:
        if spec.levels == 32:  # the fifth bits, bit j of a little-endian uint32 for value j
            high = ((codes >> 4) & 1) << torch.arange(32, device=codes.device)
            word = high.sum(-1, keepdim=True)
            parts.append(((word >> torch.arange(0, 32, 8, device=codes.device)) & 255).to(torch.uint8))
        parts.append(((codes[..., :16] & 15) | ((codes[..., 16:] & 15) << 4)).to(torch.uint8))
    return torch.cat(parts, dim=-1).reshape(*x.shape[:-1], -1)


def unpack(data: torch.Tensor, kind: str) -> torch.Tensor:
    """`pack`'s bytes [..., bytes] of cache type `kind` read back, float32 [..., n] (exactly `round_trip`'s values)."""
    spec = cache_type(kind)
    if not spec.levels:
        return data.contiguous().view(FLOAT_DTYPES[kind]).float()
    blocks = data.reshape(*data.shape[:-1], -1, spec.bytes_per_block)

    def half(at: int) -> torch.Tensor:
        return blocks[..., at : at + 2].contiguous().view(torch.float16).float()

    scale, at = half(0), 2
    low = None
    if spec.offset:
        low, at = half(2), 4
    if kind == "q8_0":
        codes = blocks[..., at:].contiguous().view(torch.int8).float()
    else:
        qs = blocks[..., -16:].to(torch.int64)
        codes = torch.cat((qs & 15, qs >> 4), dim=-1)
        if spec.levels == 32:
            word = (blocks[..., at : at + 4].to(torch.int64) << torch.arange(0, 32, 8, device=data.device)).sum(-1)
            codes = codes | (((word.unsqueeze(-1) >> torch.arange(32, device=data.device)) & 1) << 4)
        codes = codes.float()
    return dequantize(Blocks(codes, scale, low), kind)


def interleaved_order(head_dim: int) -> torch.Tensor:
    """rotate_half dims in llama.cpp's order: [0, h, 1, h+1, ...] (h = head_dim / 2), each RoPE pair side by side."""
    half = head_dim // 2
    return torch.stack((torch.arange(half), torch.arange(half) + half), dim=1).reshape(-1)


def latent_padding(d_c: int, d_r: int, kind: str) -> int:
    """Zeros a row [c, k_r] needs after the latent to be whole blocks of `kind` (0 for float types): an engine takes
    no quantized row of another width, so a converted layer whose d_c + d_r is not a multiple of 32 is served with
    its latent zero-padded (exact: the zeros read back as zeros and meet zero weights)."""
    return (-(d_c + d_r)) % BLOCK if cache_type(kind).levels else 0


def latent_row_bytes(d_c: int, d_r: int, kind: str) -> float:
    """Bytes of one layer's cached row [c, k_r] in `kind`, padded to whole blocks (`latent_padding`)."""
    return row_bytes(d_c + d_r + latent_padding(d_c, d_r, kind), kind)


def round_trip_latent(latent: torch.Tensor, k_rope: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """An MLA cache row [c, k_r] through cache type `kind` (blocks run across the joint row, as llama.cpp caches it;
    a row that is not whole blocks is zero-padded after the latent, see `latent_padding`)."""
    d_c, pad = latent.shape[-1], latent_padding(latent.shape[-1], k_rope.shape[-1], kind)
    parts = (latent, latent.new_zeros(*latent.shape[:-1], pad), k_rope) if pad else (latent, k_rope)
    row = round_trip(torch.cat(parts, dim=-1), kind)
    return row[..., :d_c], row[..., d_c + pad :]


def hadamard(n: int, device=None) -> torch.Tensor:
    """The orthonormal Sylvester-Walsh-Hadamard matrix of size n (a power of two): [[H, H], [H, -H]] / sqrt(n),
    symmetric, its own inverse (ggml_gen_hadamard's)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard matrix needs a power-of-two size, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / n**0.5).to(device)


def rotate_rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x [..., m] with each run of n values along the last dim multiplied by the Hadamard matrix of size n (m a
    multiple of n): llama.cpp's rotation of rows before a quantized cache stores them (`ggml_mul_mat_aux`)."""
    h = hadamard(n, x.device).to(x.dtype)
    return (x.reshape(*x.shape[:-1], -1, n) @ h).reshape(x.shape)


def engine_rotation(width: int, key: bool) -> int:
    """The Hadamard size llama.cpp rotates a cached head of `width` values by before quantizing it (0: none): keys
    by the largest power of two dividing the head, values by 64, only where the head is a multiple of 64
    (llama_kv_cache's attn_rot_k / attn_rot_v, on by default since April 2026; LLAMA_ATTN_ROT_DISABLE=1 turns it off)."""
    if width % 64:
        return 0
    if not key:
        return 64
    n = 64
    while width % (2 * n) == 0:
        n *= 2
    return n


def _round_trip_heads(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Keys or values [B, G, S, d] through a cache type whose rows hold every kv head of a token ([S, G*d], as
    llama.cpp's cache rows: a block may span heads where d is not a multiple of 32)."""
    rows = x.transpose(1, 2).reshape(x.shape[0], x.shape[2], -1)
    return round_trip(rows, kind).view(x.shape[0], x.shape[2], x.shape[1], -1).transpose(1, 2)


SOURCE_ATTENTION = "mla_convert_cache_types"  # the attention that reads a source's keys and values as a cache type


def _source_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' sdpa attention over keys and values read back as llama.cpp stores them in the cache types of
    `module.config.source_cache_types`: each head in the GGUF's order (RoPE pairs side by side), rotated by a
    Hadamard matrix where llama.cpp rotates (`engine_rotation`), then block-quantized; the query rotated alike and
    rounded as its CPU flash attention takes it (to q8_0 blocks against a quantized key, to float16 against a
    float16 one); the output rotated back."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    k_kind, v_kind, rotation = module.config.source_cache_types
    head = key.shape[-1]
    order = interleaved_order(head).to(key.device)
    back = torch.argsort(order)
    query, key = query[..., order], key[..., order]
    k_rot = engine_rotation(head, True) if rotation and cache_type(k_kind).levels else 0
    v_rot = engine_rotation(value.shape[-1], False) if rotation and cache_type(v_kind).levels else 0
    if k_rot:
        query, key = rotate_rows(query, k_rot), rotate_rows(key, k_rot)
    q_kind = "q8_0" if cache_type(k_kind).levels else "f16" if k_kind != "f32" else "f32"
    if q_kind != "q8_0" or head % BLOCK == 0:  # (llama.cpp takes no quantized key whose head is not whole blocks)
        query = round_trip(query, q_kind)
    key = _round_trip_heads(key, k_kind)
    if k_rot:  # scores are what they would be rotated; unrotating lets sdpa's rotate_half query meet its key
        query, key = rotate_rows(query, k_rot), rotate_rows(key, k_rot)
    query, key = query[..., back], key[..., back]
    value = _round_trip_heads(rotate_rows(value, v_rot) if v_rot else value, v_kind)
    out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if v_rot:  # out [B, T, H, d_v]: back from the rotated value space
        out = rotate_rows(out, v_rot)
    return out, weights


def read_source_cache_as(model, k_kind: str, v_kind: str | None = None, rotation: bool = True) -> None:
    """Make a source model (transformers' own attention classes) attend over keys and values as llama.cpp's cache
    types `k_kind` / `v_kind` store them, with its Hadamard rotation of quantized heads (`rotation`; False: as
    llama.cpp before April 2026 or with LLAMA_ATTN_ROT_DISABLE=1). One forward over a window writes every row and
    reads it back, as llama.cpp scores perplexity. Undo with `model.set_attn_implementation("sdpa")`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    v_kind = v_kind or k_kind
    cache_type(k_kind), cache_type(v_kind)
    AttentionInterface.register(SOURCE_ATTENTION, _source_attention)
    AttentionMaskInterface.register(SOURCE_ATTENTION, sdpa_mask)
    model.config.source_cache_types = (k_kind, v_kind, rotation)
    model.set_attn_implementation(SOURCE_ATTENTION)
