"""Calibration: text -> token batches, and per-layer statistics gathered while running the source one layer at a time.

Only one decoder layer's weights are in memory at a time; the hidden states of the calibration tokens are carried
from layer to layer ([N, T, D] float32).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mla_convert.errors import UserError

log = logging.getLogger(__name__)


def load_text(spec: str) -> str:
    """A local text file (.txt/.raw/.tokens), a jsonl file with a "text" field, or `datasets` name[:config[:split]]."""
    path = Path(spec).expanduser()
    if path.is_file():
        if path.suffix == ".jsonl":
            import json

            return "\n\n".join(json.loads(line).get("text", "") for line in path.read_text().splitlines() if line.strip())
        return path.read_text(encoding="utf-8", errors="replace")
    if path.suffix or spec.startswith((".", "/", "~")):
        raise UserError(f"calibration/eval text {spec} does not exist")
    parts = spec.split(":")
    name, config, split = parts[0], (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else None)
    try:
        import datasets

        ds = datasets.load_dataset(name, config, split=split or "validation")
    except Exception as e:  # offline, unknown name, ...
        raise UserError(f"cannot load dataset {spec} ({type(e).__name__}); pass a local text file instead") from None
    return "\n\n".join(ds["text"])


def token_windows(tokenizer, text: str, n_samples: int, seq_len: int, seed: int) -> torch.Tensor:
    """`n_samples` random windows of `seq_len` tokens from the tokenized text (fixed seed). -> [N, T] long."""
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    available = ids.numel() - seq_len
    if available <= 0:
        raise UserError(f"calibration text has {ids.numel()} tokens, fewer than --calib-seq-len {seq_len}")
    if n_samples * seq_len > ids.numel():
        log.warning("calibration text holds %d tokens; %d x %d windows will overlap", ids.numel(), n_samples, seq_len)
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, available + 1, (n_samples,), generator=gen)
    return torch.stack([ids[s : s + seq_len] for s in starts.tolist()])


def second_moment(x: torch.Tensor) -> torch.Tensor:
    """E[x~ x~^T] of the augmented input x~ = [x, 1], float64. x [..., D] -> [D+1, D+1]."""
    x = x.reshape(-1, x.shape[-1]).double()
    x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], dim=1)
    return x.T @ x / x.shape[0]


class LayerRunner:
    """Runs calibration tokens through decoder layers one at a time.

    `attention_input(layer_module)` is the input of the layer's attention (after its input norm);
    `advance(layer_module)` replaces the hidden states by the layer's output.
    """

    def __init__(self, config, embed: torch.Tensor, tokens: torch.Tensor, batch: int = 8):
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        self.hidden = torch.nn.functional.embedding(tokens, embed.float())  # [N, T, D]
        self.batch = batch
        rotary = LlamaRotaryEmbedding(config)
        positions = torch.arange(tokens.shape[1]).unsqueeze(0)
        self.position_embeddings = rotary(self.hidden[:1], positions)

    @torch.no_grad()
    def attention_input(self, layer) -> torch.Tensor:
        return layer.input_layernorm(self.hidden)  # [N, T, D]

    @torch.no_grad()
    def attention_profile(self, layer) -> torch.Tensor:
        """How far back each query head of the source layer looks: p [H, T] with p[h, d] the attention weight on the
        key d positions back, averaged over every calibration query (each query's row sums to 1, so p[h] does too).
        float64. Runs the layer's own q/k projections and RoPE on the calibration hidden states."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        attn = layer.self_attn
        heads, groups = attn.config.num_attention_heads, attn.config.num_key_value_heads
        head_dim = attn.head_dim
        cos, sin = self.position_embeddings
        seq = self.hidden.shape[1]
        causal = torch.ones(seq, seq, dtype=torch.bool).tril()
        # back[t, d] = t - d: the key d positions before query t (clamped; those rows carry zero probability)
        back = (torch.arange(seq)[:, None] - torch.arange(seq)[None, :]).clamp_min(0)
        valid = causal  # t - d >= 0 exactly where d <= t
        profile = torch.zeros(heads, seq, dtype=torch.float64)
        step = max(1, int(self.batch * (512 / seq) ** 2))  # [B, H, T, T] scores: bound them like B=batch at T=512
        for chunk in self.hidden.split(step):
            x = layer.input_layernorm(chunk)
            q = attn.q_proj(x).view(chunk.shape[0], seq, heads, head_dim).transpose(1, 2)  # [B, H, T, d_h]
            k = attn.k_proj(x).view(chunk.shape[0], seq, groups, head_dim).transpose(1, 2)  # [B, G, T, d_h]
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k = k.repeat_interleave(heads // groups, dim=1)  # [B, H, T, d_h]
            scores = (q @ k.transpose(-1, -2)) * attn.scaling  # [B, H, T, T]
            probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)  # [B, H, T(query), T(key)]
            by_distance = probs.gather(-1, back.expand_as(probs)) * valid  # [B, H, T(query), T(distance)]
            profile += by_distance.sum(dim=(0, 2)).double()
        return profile / (self.hidden.shape[0] * seq)

    @torch.no_grad()
    def advance(self, layer) -> None:
        outs = []
        for chunk in self.hidden.split(self.batch):
            cos, sin = self.position_embeddings
            pe = (cos.expand(chunk.shape[0], -1, -1), sin.expand(chunk.shape[0], -1, -1))
            out = layer(chunk, attention_mask=None, position_embeddings=pe, position_ids=None)
            outs.append(out[0] if isinstance(out, tuple) else out)
        self.hidden = torch.cat(outs)
