"""The native MLA model; importing this module registers it with the transformers Auto classes."""

from mla_convert.modeling.configuration_mla import MLAConfig
from mla_convert.modeling.modeling_mla import MLAForCausalLM, MLAModel, MLAPreTrainedModel

__all__ = ["MLAConfig", "MLAForCausalLM", "MLAModel", "MLAPreTrainedModel"]
