"""Export a native MLA checkpoint to the stock DeepSeek-V3 format (transformers `DeepseekV3ForCausalLM`, vLLM, SGLang).

Native layer (see mla_convert/modeling) -> DeepSeek-V3 layer, one tensor at a time:

    q_proj [H*(d_n+d_r), D]      -> q_proj [H*(d_n+d_r'), D]: softmax scale folded in, rope rows interleaved and
                                    reordered onto one geometric frequency set; or, when the query has a bias,
                                    q_a_proj (+bias) -> q_a_layernorm (identity) -> q_b_proj
    kv_a_proj [d_c+d_r, D]       -> kv_a_proj_with_mqa [d_c'+d_r', D]: latent rows times a tiny power of two `a`
                                    (so that kv_a_layernorm, which the format always applies, is linear), rope rows
                                    interleaved and reordered like the query's
    (none)                       -> kv_a_layernorm.weight = sqrt(eps)/a: the norm is the identity up to a bounded
                                    relative error (see `identity_norm_scale`)
    kv_b_proj [G*(d_n+d_v), d_c] -> kv_b_proj [H*(d_n+d_v), d_c']: kv groups repeated per query head
    o_proj [D, H*d_v]            -> o_proj, with the value bias (and the latent bias's value part) folded into its bias

Facts of the stock format this relies on are proven by tests/test_export.py against the installed transformers:
`kv_a_layernorm` and `q_a_layernorm` are built with eps 1e-6 whatever `rms_norm_eps` says (vLLM and SGLang use
`rms_norm_eps`), so the export sets `rms_norm_eps` = 1e-6 and rescales the residual stream by
sqrt(1e-6 / source eps), which makes every decoder RMSNorm compute exactly what the source's did;
`num_key_value_heads` must equal the number of heads; `n_routed_experts` must be an int (dense-only models set
`first_k_dense_replace = num_hidden_layers`); with `rope_interleave` the rope dims pair as (2m, 2m+1) with frequency
`rope_theta^(-2m/d_r)`; the attention scale is `(d_n + d_r)^-0.5` (the export's YaRN of factor 1: no mscale).

What the format cannot express is either re-expressed exactly, approximated only with `allow_approx` (and then always
measured), or refused with the conversion options that produce an exportable model.

Rooms: plan.py (options, exported shapes, config, serving notes: `make_export_plan`), layer.py (tensor mapping and the
identity norm), verify.py (the stock check in a subprocess), driver.py (`export`), gguf.py (llama.cpp's deepseek2
file). The RoPE fit they share with the conversion's `--target deepseek` is `mla_convert.rope_fit`, a room below
both. export/ imports nothing of conversion/: it reads finished native checkpoints.
"""

from mla_convert.export.driver import LAYER_ATTENTION, export, report_export
from mla_convert.export.layer import NORM_TOLERANCE, export_layer, identity_norm_scale
from mla_convert.export.plan import (
    DTYPE_CHOICES,
    EXPORT_EPS,
    FLASHMLA_LAYOUT,
    FORMATS,
    PAD_CHOICES,
    VLLM_MLA_HEAD_SIZES,
    ExportOptions,
    ExportPlan,
    deepseek_config,
    deepseek_layout_notes,
    make_export_plan,
    native_config,
    serving_notes,
)
from mla_convert.export.verify import relative_error, verify_export
from mla_convert.rope_fit import (
    FREQ_TOLERANCE,
    RopeFit,
    check_exportable,
    deepseek_compatible_rope_pairs,
    fit_deepseek_rope,
)

__all__ = [
    "DTYPE_CHOICES", "EXPORT_EPS", "FLASHMLA_LAYOUT", "FORMATS", "FREQ_TOLERANCE", "LAYER_ATTENTION", "NORM_TOLERANCE",
    "PAD_CHOICES", "VLLM_MLA_HEAD_SIZES", "ExportOptions", "ExportPlan", "RopeFit", "check_exportable",
    "deepseek_compatible_rope_pairs", "deepseek_config", "deepseek_layout_notes", "export", "export_layer",
    "fit_deepseek_rope", "identity_norm_scale", "make_export_plan", "native_config", "relative_error", "report_export",
    "serving_notes", "verify_export",
]  # fmt: skip
