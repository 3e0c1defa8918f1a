"""The native MLA model as a vLLM model: Llama blocks whose attention is vLLM's own MLA attention.

Imported by vLLM only (registered lazily by mla_convert.serving.vllm_plugin). Each layer's attention tensors are
mapped into the served layout by mla_convert.serving.layout (exact: tests/test_serving.py), then vLLM's
`MultiHeadLatentAttentionWrapper` runs them: it caches the latent and the rotated rope key in its paged cache, expands
K/V for prefill and absorbs `kv_b_proj` into the query and output for decode, with the platform's MLA kernels. What
the DeepSeek classes cannot hold is ours here: no norm on the latent, the layer's own RoPE frequencies (any source
frequency indices, repeats included, after the source's RoPE scaling), biases, the source's softmax scale.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.mla import MLAModules, MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaMLP
from vllm.sequence import IntermediateTensors

from mla_convert.serving.layout import ServedLayout, served_config, served_layer
from mla_convert.serving.vllm_plugin import cpu_attention_backend, layout_for

_ATTENTION_KEY = re.compile(r"model\.layers\.(\d+)\.self_attn\.(.+)$")


class PairRotaryEmbedding(nn.Module):
    """RoPE on the served rope dims (rotate_half layout), pair j at the source frequency `inv_freq[j]`.

    Called by vLLM's MLA wrapper as (positions [T], q_pe [T, H, d_r'], k_pe [T, 1, d_r']) -> rotated (q_pe, k_pe).
    cos/sin are computed as transformers' LlamaRotaryEmbedding computes them (float32 product of position and
    inverse frequency, times the RoPE type's attention factor, cast to the activations' dtype).
    """

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, d_r'/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, d_r']
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    @staticmethod
    def _rotate(x, cos, sin):
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class NormedQuery(nn.Module):
    """The query of a `--qk-norm calibrated` (Qwen3) checkpoint, as vLLM's MLA wrapper calls a q projection
    (hidden [T, D] -> ([T, H*(d_n+d_r')], None)): the source's q_proj, its per-head RMS norm, then each head's own map
    to its nope and rope parts (q_head_proj [H*(d_n+d_r'), d_h], used per head). The wrapper applies RoPE after it,
    as the source does after its norm. Heads split over tensor-parallel ranks with both projections' rows."""

    def __init__(self, hidden: int, heads: int, head_dim: int, d_q: int, eps: float, bias: bool, quant, prefix: str):
        super().__init__()
        self.q_proj = ColumnParallelLinear(hidden, heads * head_dim, bias=bias, quant_config=quant,
                                           prefix=f"{prefix}.q_proj")
        self.q_norm = RMSNorm(head_dim, eps=eps)
        # A plain parameter, not a vLLM linear layer: it is used per head (an einsum), and vLLM's CPU linears repack
        # their weights for their own GEMM. Each rank keeps its heads' rows.
        tp, rank = get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()
        rows = heads // tp * d_q
        self.q_head_proj = nn.Module()
        self.q_head_proj.weight = nn.Parameter(torch.empty(rows, head_dim), requires_grad=False)
        self.q_head_proj.weight.weight_loader = lambda param, loaded: param.data.copy_(loaded.narrow(0, rank * rows,
                                                                                                     rows))
        self.head_dim, self.d_q = head_dim, d_q

    def forward(self, hidden_states: torch.Tensor):
        q, _ = self.q_proj(hidden_states)  # [T, H_rank*d_h]
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape[0], -1, self.head_dim)  # [T, H_rank, d_h]
        head_map = self.q_head_proj.weight.view(-1, self.d_q, self.head_dim)  # [H_rank, d_n+d_r', d_h]
        return torch.einsum("thd,hed->the", q, head_map.to(q.dtype)).reshape(q.shape[0], -1), None


class MLAServedAttention(nn.Module):
    def __init__(self, config, served, layer: int, inv_freq, attention_scaling, vllm_config: VllmConfig, prefix: str):
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        heads = served.num_attention_heads
        if heads % tp:
            raise ValueError(f"{heads} attention heads do not split over tensor parallel size {tp}")
        d_n, d_r, d_v = served.qk_nope_head_dim, served.qk_rope_head_dim, served.v_head_dim
        d_c = served.kv_lora_ranks[layer]
        hidden = config.hidden_size
        quant = vllm_config.quant_config
        if getattr(served, "qk_norm", None):  # "calibrated" (check_servable refuses "exact")
            query = NormedQuery(hidden, heads, served.head_dim, d_n + d_r, served.rms_norm_eps,
                                served.attention_bias, quant, prefix)
            self.q_proj, self.q_norm, self.q_head_proj = query.q_proj, query.q_norm, query.q_head_proj
        else:
            query = self.q_proj = ColumnParallelLinear(hidden, heads * (d_n + d_r), bias=served.attention_bias,
                                                       quant_config=quant, prefix=f"{prefix}.q_proj")
        self.kv_a_proj = ReplicatedLinear(hidden, d_c + d_r, bias=served.attention_bias, quant_config=quant,
                                          prefix=f"{prefix}.kv_a_proj")
        self.kv_b_proj = ColumnParallelLinear(d_c, heads * (d_n + d_v), bias=False, quant_config=quant,
                                              prefix=f"{prefix}.kv_b_proj")
        self.o_proj = RowParallelLinear(heads * d_v, hidden, bias=served.o_proj_bias, quant_config=quant,
                                        prefix=f"{prefix}.o_proj")
        pairs = torch.tensor(served.rope_pairs[layer], dtype=torch.long)
        self.rotary_emb = PairRotaryEmbedding(inv_freq[pairs], attention_scaling)
        modules = MLAModules(
            kv_a_layernorm=nn.Identity(),  # the native latent has no norm
            kv_b_proj=self.kv_b_proj,
            rotary_emb=self.rotary_emb,
            o_proj=self.o_proj,
            fused_qkv_a_proj=None,
            kv_a_proj_with_mqa=self.kv_a_proj,
            q_a_layernorm=None,
            q_b_proj=None,
            q_proj=query,
            indexer=None,
            is_sparse=False,
            topk_indices_buffer=None,
        )
        self.mla_attn = MultiHeadLatentAttentionWrapper(
            hidden, heads // tp, served.softmax_scale, d_n, d_r, d_v, None, d_c, modules,
            vllm_config.cache_config, quant, prefix,
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.mla_attn(positions, hidden_states)


class MLAServedDecoderLayer(nn.Module):
    def __init__(self, config, served, layer, inv_freq, attention_scaling, vllm_config, prefix):
        super().__init__()
        self.self_attn = MLAServedAttention(config, served, layer, inv_freq, attention_scaling, vllm_config,
                                            f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            quant_config=vllm_config.quant_config, bias=getattr(config, "mlp_bias", False),
                            prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class MLAServedModel(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        config = vllm_config.model_config.hf_config
        if not vllm_config.model_config.use_mla:  # e.g. VLLM_MLA_DISABLE=1: vLLM would plan a per-head K/V cache
            raise ValueError("mla-convert's native MLA model runs only on vLLM's MLA attention: unset VLLM_MLA_DISABLE")
        self.layout: ServedLayout = layout_for(config)
        dtype = str(vllm_config.model_config.dtype).replace("torch.", "")
        chosen = vllm_config.attention_config.backend
        if cpu_attention_backend(config, dtype) and getattr(chosen, "name", None) != "CPU_MLA":
            raise ValueError(f"on this CPU vLLM runs MLA models in its AMX MLA backend, which cannot run this checkpoint "
                             f"in {dtype} (it needs bfloat16 or float16 and a nope head dim that is a multiple of 32): "
                             "serve it with --attention-backend CPU_MLA")
        served = type(config).from_dict({**config.to_dict(), **served_config(config, self.layout)})
        if self.layout.nope_dims is not None:  # padded heads (GPU): vLLM's MLA prefill picks its kernel from them
            text_config = vllm_config.model_config.hf_text_config
            text_config.qk_nope_head_dim, text_config.v_head_dim = served.qk_nope_head_dim, served.v_head_dim
        rotary = LlamaRotaryEmbedding(config)  # the source's frequencies, after its RoPE scaling
        inv_freq, scaling = rotary.inv_freq.float(), float(rotary.attention_scaling)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([
            MLAServedDecoderLayer(config, served, i, inv_freq, scaling, vllm_config, f"{prefix}.layers.{i}")
            for i in range(config.num_hidden_layers)
        ])  # fmt: skip
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class MLAForCausalLM(nn.Module):
    """vLLM model class for `architectures: ["MLAForCausalLM"]` (native mla_convert checkpoints)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = copy.deepcopy(config)  # the checkpoint's dims, for load_weights (MLAServedModel may pad vLLM's)
        self.model = MLAServedModel(vllm_config=vllm_config, prefix="model")
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config,
                                      prefix="lm_head")
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(self, input_ids, positions, intermediate_tensors: IntermediateTensors | None = None,
                inputs_embeds=None) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def _attention_names(self, layer: int) -> set[str]:
        c = self.config
        names = {f"{p}.weight" for p in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj")}
        if getattr(c, "qk_norm", None):
            names |= {"q_norm.weight", "q_head_proj.weight"}
        if c.attention_bias:
            names |= {"q_proj.bias", "kv_a_proj.bias", "kv_b_proj.bias"}
        if c.o_proj_bias:
            names.add("o_proj.bias")
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Native checkpoint tensors in; each layer's attention is held until complete, mapped, then loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending: dict[int, dict[str, torch.Tensor]] = {}

        def put(name: str, tensor: torch.Tensor, *args) -> None:
            param = params[name]
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, *args)
            loaded.add(name)

        for name, tensor in weights:
            match = _ATTENTION_KEY.match(name)
            if match:
                layer = int(match[1])
                pending.setdefault(layer, {})[match[2]] = tensor
                if set(pending[layer]) >= self._attention_names(layer):
                    prefix = f"model.layers.{layer}.self_attn."
                    for key, t in served_layer(pending.pop(layer), self.config, layer, self.model.layout).items():
                        put(prefix + key, t)
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            for shard, part in enumerate(("gate_proj", "up_proj")):
                if f".mlp.{part}." in name:
                    put(name.replace(part, "gate_up_proj"), tensor, shard)
                    break
            else:
                put(name, tensor)
        if pending:
            missing = {layer: sorted(self._attention_names(layer) - set(t)) for layer, t in pending.items()}
            raise ValueError(f"incomplete attention tensors in the checkpoint: {missing}")
        if self.config.tie_word_embeddings:
            loaded.add("lm_head.weight")
        return loaded
