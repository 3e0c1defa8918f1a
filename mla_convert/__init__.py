"""mla-convert: turn GQA/MHA Llama, Mistral and Qwen2 checkpoints into Multi-head Latent Attention (MLA) models.

Importing this package registers the native MLA model (`model_type: "mla"`) with the transformers Auto classes, so
`AutoModelForCausalLM.from_pretrained(folder)` loads a converted checkpoint without `trust_remote_code`.
"""

__version__ = "0.1.0"

from mla_convert.modeling import MLAConfig, MLAForCausalLM, MLAModel  # noqa: E402  (registers the Auto classes)

__all__ = ["MLAConfig", "MLAForCausalLM", "MLAModel", "__version__"]
