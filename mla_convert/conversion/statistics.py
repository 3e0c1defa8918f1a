"""Statistics: the calibration windows run through the source one decoder layer at a time (`LayerRunner`), with the
second moments and attention profiles each layer's conversion reads.

Only one decoder layer's weights are in memory at a time; the hidden states of the calibration tokens are carried
from layer to layer ([N, T, D] float32).
"""

from __future__ import annotations

import torch


def second_moment(x: torch.Tensor) -> torch.Tensor:
    """E[x~ x~^T] of the augmented input x~ = [x, 1], float64. x [..., D] -> [D+1, D+1]."""
    x = x.reshape(-1, x.shape[-1]).double()
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    return x.T @ x / x.shape[0]


def attention_window(attn) -> int | None:
    """The window an attention module's queries look back over (None: the whole past): its own `sliding_window`
    where it has one (per layer: Gemma 2, Qwen2, the native model), else its config's (Mistral)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    config = getattr(attn, "config", None)  # None: a module without a transformers config attends to the whole past
    if config is None:
        return None
    return getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None


def layer_mask(attn, seq_len: int, device=None) -> torch.Tensor | None:
    """The mask an attention module needs over `seq_len` positions from 0 to attend causally (within its window):
    None where sdpa's own causal attention is that (no window shorter than the sequence); bool [1, 1, T, T] (True
    where query t sees key j: j <= t and t - j < window) otherwise; additive float (0 or the dtype's minimum) under
    eager attention, whose kernels add the mask and take None for no mask at all."""
    window = attention_window(attn)
    eager = getattr(getattr(attn, "config", None), "_attn_implementation", None) == "eager"
    if not eager and (window is None or window >= seq_len):
        return None
    positions = torch.arange(seq_len, device=device)
    back = positions[:, None] - positions[None, :]  # [T, T]: how far key j lies behind query t
    allowed = (back >= 0) & (back < (window or seq_len))
    if eager:
        return torch.zeros(seq_len, seq_len, device=device).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    return allowed[None, None]


def attention_input(layer, hidden: torch.Tensor) -> torch.Tensor:
    """What a decoder layer's attention reads from the hidden states: after its input norm, or the hidden states
    themselves in a block that normalizes outputs instead (no input_layernorm: OLMo 2)."""
    norm = getattr(layer, "input_layernorm", None)
    return hidden if norm is None else norm(hidden)


# Windows a runner advances through a layer at once (`LayerRunner.batch`): 8 on a GPU; 1 on a CPU, where the
# forward's temporaries for one window (its MLP products: [2048, intermediate] float32) stay small enough for glibc's
# heap to reuse them instead of mapping fresh pages for each chunk. The same hidden states either way, bit for bit:
# docs/decisions.md#the-statistics-pass-on-a-cpu
BATCH = 8
CPU_BATCH = 1


def advance_batch(device) -> int:
    """The runner's batch on `device` (BATCH, or CPU_BATCH on a CPU)."""
    return CPU_BATCH if torch.device(device).type == "cpu" else BATCH


class LayerRunner:
    """Runs calibration tokens through decoder layers one at a time.

    `attention_input(layer_module)` is the input of the layer's attention (after its input norm);
    `advance(layer_module)` replaces the hidden states by the layer's output.
    """

    def __init__(self, config, embed: torch.Tensor, tokens: torch.Tensor, batch: int = BATCH,
                 embed_scale: float | None = None):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.tokens = tokens  # [N, T]
        self.hidden = torch.nn.functional.embedding(tokens, embed).float()  # [N, T, D] (rows first: no float32 table)
        if embed_scale is not None:  # Gemma's scaled embeddings, the scale rounded to the table's dtype as it does
            self.hidden = self.hidden * torch.tensor(embed_scale, dtype=embed.dtype).float()
        self.batch = batch
        from mla_convert.rope import layer_type, per_type_rope, rope_config

        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        kinds = sorted(set(getattr(config, "layer_types", None) or ["full_attention"])) if per_type_rope(config) else []
        # per layer type where the RoPE differs by type (Gemma 3's two bases); else one table, `position_embeddings`
        self.typed = {kind: LlamaRotaryEmbedding(rope_config(config, kind))(self.hidden[:1], positions) for kind in kinds}
        self.layer_types = [layer_type(config, i) for i in range(config.num_hidden_layers)]
        self.position_embeddings = (self.typed["full_attention"] if "full_attention" in self.typed
                                    else LlamaRotaryEmbedding(config)(self.hidden[:1], positions))

    def to(self, device) -> "LayerRunner":
        """Keep the hidden states (and the rotary tables) on `device`: layers moved there run where they are."""
        self.hidden = self.hidden.to(device)
        self.position_embeddings = tuple(t.to(device) for t in self.position_embeddings)
        self.typed = {kind: tuple(t.to(device) for t in pe) for kind, pe in self.typed.items()}
        return self

    def embeddings_at(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [1, T, d_h] of layer `layer`'s RoPE over the calibration positions."""
        return self.typed.get(self.layer_types[layer], self.position_embeddings)

    @torch.no_grad()
    def attention_input(self, layer) -> torch.Tensor:
        return attention_input(layer, self.hidden)  # [N, T, D]

    @torch.no_grad()
    def attention_profile(self, layer, block: int = 128) -> torch.Tensor:
        """How far back each query head of the source layer looks: p [H, T] with p[h, d] the attention weight on the
        key d positions back, averaged over every calibration query (each query's row sums to 1, so p[h] does too).
        float64. Runs the layer's own q/k projections and RoPE on the calibration hidden states."""
        return self.attention_statistics(layer, block)[0]

    @torch.no_grad()
    def attention_statistics(self, layer, block: int = 128, attended_every: int = 0):
        """(profile [H, T] as in `attention_profile`, attended [G, D+1, D+1] or None, keyed [D+1, D+1]).

        keyed: the second moment of the augmented inputs [x_j, 1] with each key position weighted by the attention it
        receives (summed over queries, averaged over heads): E_t sum_j p_tj x~_j x~_j^T. float64.

        attended: with `attended_every` = s > 0, the second moment of the *attended* inputs x~_t = sum_j p_tj [x_j, 1]
        (what a value map is applied to, through attention), averaged over the query heads of each kv group, on every
        s-th block of queries. float64.

        Queries go in blocks of `block` rows against the keys up to the block's last position, the keys in reversed
        order: then "d positions back" is a fixed stride through the block's probabilities (`by_distance`), so no
        [T, T] index tensor and no copy of the probabilities is made, and every buffer stays small."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = layer.self_attn
        window = attention_window(attn)
        heads, groups = attn.config.num_attention_heads, attn.config.num_key_value_heads
        head_dim = attn.head_dim
        cos, sin = self.embeddings_at(attn.layer_idx)
        seq, dim = self.hidden.shape[1:]
        profile = torch.zeros(heads, seq, dtype=torch.float64)
        attended = torch.zeros(groups, dim + 1, dim + 1, dtype=torch.float64) if attended_every else None
        attended_rows = 0
        keyed = torch.zeros(dim + 1, dim + 1, dtype=torch.float64)
        for sample in self.hidden:
            x = attention_input(layer, sample[None])
            received = torch.zeros(seq, dtype=torch.float64)  # attention each key receives, summed over queries/heads
            q, k = attn.q_proj(x), attn.k_proj(x)
            whole = hasattr(attn, "q_norm") and attn.q_norm.weight.numel() == q.shape[-1]
            if whole:  # q/k norms over the whole projection (OLMo 2's)
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.view(1, seq, heads, head_dim), k.view(1, seq, groups, head_dim)
            if hasattr(attn, "q_norm") and not whole:  # per-head q/k norms before RoPE (Qwen3's attention has them)
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)  # [1, H, T, d_h], [1, G, T, d_h]
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            q = q[0] * attn.scaling  # [H, T, d_h]
            k = k[0].repeat_interleave(heads // groups, dim=0)  # [H, T, d_h]
            for index, first in enumerate(range(0, seq, block)):
                rows = min(block, seq - first)
                length = first + rows  # keys 0 .. length-1 are visible to some query of the block
                keys = k[:, :length].flip(1)  # [H, L, d_h]: column c holds key length-1-c
                scores = q[:, first:length] @ keys.transpose(1, 2)  # [H, R, L]
                # query first+r sees key length-1-c iff c >= rows-1-r: only the first `rows` columns hold future keys
                future = torch.ones(rows, rows, dtype=torch.bool).triu(1).flip(1)  # [R, R]: c < rows-1-r
                scores[:, :, :rows].masked_fill_(future, float("-inf"))
                if window is not None:  # query first+r sees key length-1-c only within the window
                    at = torch.arange(length, device=scores.device)
                    back = at[first:, None] - (length - 1 - at)[None, :]
                    scores.masked_fill_(back >= window, float("-inf"))
                probs = scores.softmax(-1)  # [H, R, L]
                profile[:, :length] += by_distance(probs).double()
                received[:length] += probs.sum(dim=(0, 1)).flip(0).double()  # column c is key length-1-c
                if attended is not None and index % attended_every == 0:
                    mixed = probs @ x[0, :length].flip(0)  # [H, R, D]: each query's attended input
                    mixed = torch.cat([mixed, mixed.new_ones(heads, rows, 1)], dim=-1)  # rows of p sum to 1
                    mixed = mixed.view(groups, -1, dim + 1).double()  # [G, (H/G) R, D+1]
                    for group, rows_g in zip(attended, mixed):  # one [D+1, D+1] product at a time (8B: 134 MB)
                        group += rows_g.T @ rows_g
                    attended_rows += rows * heads // groups
            xa = torch.cat([x[0], x.new_ones(seq, 1)], dim=-1).double()  # [T, D+1]
            keyed += (xa * received[:, None]).T @ xa
        profile /= self.hidden.shape[0] * seq
        keyed /= self.hidden.shape[0] * seq * heads  # each query row of each head sums to 1
        if attended is not None:
            attended /= attended_rows  # in place: at 8B shapes a second copy would be 1 GB
        return profile, attended, keyed

    @torch.no_grad()
    def advance(self, layer) -> None:
        """Run `layer` on the hidden states."""
        outs = []
        for chunk in self.hidden.split(self.batch):
            cos, sin = self.embeddings_at(layer.self_attn.layer_idx)
            pe = (cos.expand(chunk.shape[0], -1, -1), sin.expand(chunk.shape[0], -1, -1))
            mask = layer_mask(layer.self_attn, chunk.shape[1], chunk.device)
            out = layer(chunk, attention_mask=mask, position_embeddings=pe, position_ids=None)
            outs.append(out[0] if isinstance(out, tuple) else out)
        self.hidden = torch.cat(outs)


def by_distance(probs: torch.Tensor) -> torch.Tensor:
    """Attention summed by distance over a block of consecutive queries whose keys are in reversed order.

    probs [H, R, L]: row r is the query at position L-R+r, column c the key at position L-1-c (future keys: zero).
    -> [H, L]: entry d sums, over the rows, the weight on the key d positions before the row's query.
    Row r's key d back sits at column d + R-1-r, i.e. at flat offset r*(L-1) + d + R-1 of the row-major [R, L] block:
    a strided view with row stride L-1. Where a row's d runs past its own columns the view reads the next row's
    leading columns, which hold future keys (zero), except the very last column (d = L-1), which only the last row has.
    """
    heads, rows, length = probs.shape
    probs = probs.contiguous()
    view = probs.as_strided((heads, rows, length), (rows * length, length - 1, 1), probs.storage_offset() + rows - 1)
    out = view[:, :, : length - 1].sum(1)  # [H, L-1]
    return torch.cat([out, probs[:, rows - 1, length - 1 :]], dim=1)  # [H, L]; d = L-1: the last row's key 0
