"""vLLM plugin (entry point `vllm.general_plugins: mla_convert`): serve native MLA checkpoints in vLLM.

vLLM loads every plugin of that group in each of its processes before it reads a model's config. `register` then

- registers `MLAConfig` with transformers' AutoConfig (model_type `mla`), as `import mla_convert` does;
- registers the architecture `MLAForCausalLM` (the one native checkpoints name) with vLLM's ModelRegistry, lazily,
  as mla_convert.serving.vllm_model:MLAForCausalLM;
- tells vLLM's config reader that `mla` is an MLA model whose cache row is the served layout's
  `kv_lora_rank + qk_rope_head_dim` (one latent kv head), so vLLM allocates the latent cache and picks an MLA backend.

Nothing here runs unless vLLM imports it; mla_convert itself never imports vLLM.
"""

from __future__ import annotations

ARCHITECTURE = "MLAForCausalLM"
MODEL_TYPE = "mla"


def platform() -> str:
    """The key of the current platform in serving.layout's tables: cpu or cuda."""
    from vllm.platforms import current_platform

    return "cpu" if current_platform.is_cpu() else "cuda"


def layout_for(config):
    """The ServedLayout vLLM runs a native config in on this platform."""
    from mla_convert.serving.layout import PREFILL_HEADS, VLLM_LAYOUTS, check_servable, served_layout

    check_servable(config, "vLLM's MLA kernels", query_norm=True)
    return served_layout(config.kv_lora_ranks, config.qk_rope_head_dim, VLLM_LAYOUTS[platform()],
                         (config.qk_nope_head_dim, config.v_head_dim), PREFILL_HEADS[platform()])


def cpu_attention_backend(config, dtype: str) -> str | None:
    """On a CPU with AMX tiles, "CPU_MLA" when vLLM's AMX MLA backend (its choice there) cannot run `config` (a
    native `mla` config or a DeepSeek-V3 export) in `dtype`; None where vLLM's own choice runs it."""
    import torch
    from vllm.platforms import current_platform

    from mla_convert.serving.layout import amx_mla_runs

    if not current_platform.is_cpu() or not torch.cpu._is_amx_tile_supported():
        return None
    if getattr(config, "model_type", None) == MODEL_TYPE:
        layout = layout_for(config)
        kv_lora_rank, rope_dims = layout.kv_lora_rank, layout.rope_dims
    else:
        kv_lora_rank, rope_dims = config.kv_lora_rank, config.qk_rope_head_dim
    runs = amx_mla_runs(kv_lora_rank, rope_dims, config.qk_nope_head_dim, dtype)
    return None if runs else "CPU_MLA"


def register() -> None:
    import mla_convert.modeling  # noqa: F401  (AutoConfig learns model_type "mla")
    from vllm import ModelRegistry
    from vllm.transformers_utils import model_arch_config_convertor as convertors

    ModelRegistry.register_model(ARCHITECTURE, "mla_convert.serving.vllm_model:MLAForCausalLM")

    class MLAArchConfigConvertor(convertors.ModelArchConfigConvertorBase):
        """vLLM's view of a native config: an MLA model with one latent kv head of the served layout's size."""

        def is_deepseek_mla(self) -> bool:
            return True

        def get_head_size(self) -> int:
            return layout_for(self.hf_text_config).elements_per_token_per_layer

        def get_total_num_kv_heads(self) -> int:
            return 1

        def get_per_layer_hf_configs(self):
            return None  # per-layer ranks are served padded to one layout: vLLM sees one cache row for every layer

    convertors.MODEL_ARCH_CONFIG_CONVERTORS[MODEL_TYPE] = MLAArchConfigConvertor
    _fix_cpu_rotary_3d()


def _fix_cpu_rotary_3d() -> None:
    """Workaround for vLLM's CPU rotary kernel, which rotates only the first head of a [T, H, d] query.

    `RotaryEmbedding.forward_cpu` is exact on the flattened [T, H*d] layout, and vLLM's MLA wrapper passes it
    [T, H, d_r] queries (docs/decisions.md#vllms-cpu-backends; tests/test_serving.py::test_vllm_cpu_rotary_workaround
    fails once the kernel is fixed). The wrapper below flattens 3-D inputs before the kernel and writes the result
    back in place (the kernel's contract). Our own served model does not need it (mla_convert.serving.vllm_model
    rotates in torch). It can go when the CPU kernel takes [T, H, d] inputs like the CUDA one does.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.forward_cpu
    if getattr(kernel, "_mla_convert_flattens", False):
        return

    def forward_cpu(self, positions, query, key=None):
        flat_q = query.reshape(query.shape[0], -1) if query.dim() == 3 else query
        flat_k = key.reshape(key.shape[0], -1) if key is not None and key.dim() == 3 else key
        kernel(self, positions, flat_q, flat_k)
        if flat_q.data_ptr() != query.data_ptr():
            query.copy_(flat_q.view_as(query))
        if key is not None and flat_k.data_ptr() != key.data_ptr():
            key.copy_(flat_k.view_as(key))
        return query, key

    forward_cpu._mla_convert_flattens = True
    RotaryEmbedding.forward_cpu = forward_cpu
