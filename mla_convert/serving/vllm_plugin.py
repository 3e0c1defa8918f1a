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


def platform_layouts() -> tuple[tuple[int, int], ...]:
    """The (kv_lora_rank, qk_rope_head_dim) splits the current platform's MLA backends take."""
    from vllm.platforms import current_platform

    from mla_convert.serving.layout import VLLM_LAYOUTS

    return VLLM_LAYOUTS["cpu" if current_platform.is_cpu() else "cuda"]


def layout_for(config):
    """The ServedLayout vLLM runs a native config in on this platform."""
    from mla_convert.serving.layout import served_layout

    return served_layout(list(config.kv_lora_rank), config.qk_rope_head_dim, platform_layouts())


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

    convertors.MODEL_ARCH_CONFIG_CONVERTORS[MODEL_TYPE] = MLAArchConfigConvertor
