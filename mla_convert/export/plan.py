"""The export plan: the options, the exported shapes and config, and which biases survive, decided from the native
config and the biases alone before any tensor is written.

`make_export_plan` refuses (or, with `allow_approx`, records as an approximation) what the format cannot hold;
`serving_notes` says what vLLM and SGLang will do with the exported layout; `deepseek_config` writes config.json.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from mla_convert.errors import UserError
from mla_convert.rope_fit import RopeFit, fit_deepseek_rope
from mla_convert.rope import source_frequencies
from mla_convert.serving.llamacpp import LLAMACPP_BLOCK

FORMATS = ("deepseek",)
# transformers builds kv_a_layernorm/q_a_layernorm as DeepseekV3RMSNorm(dim) with its default eps 1e-6; vLLM and
# SGLang pass config.rms_norm_eps. Exporting with rms_norm_eps = 1e-6 makes the three agree.
EXPORT_EPS = 1e-6
VLLM_MLA_HEAD_SIZES = (320, 576)  # kv_lora_rank + qk_rope_head_dim accepted by vLLM's MLA backends
FLASHMLA_LAYOUT = (512, 64)  # (kv_lora_rank, qk_rope_head_dim) of FlashMLA
LLAMACPP_ROW = 64  # values per step of ggml's f16 dot product with AVX-512 (no AVX512-FP16)
PAD_CHOICES = ("none", "vllm", "flashmla", "llamacpp")
DTYPE_CHOICES = ("auto", "float32", "bfloat16")


@dataclass
class ExportOptions:
    """Resolved export options (recorded in provenance.json)."""

    format: str = "deepseek"
    dtype: str = "auto"  # auto: the native checkpoint's dtype (float16 is refused, see out_dtype)
    allow_approx: bool = False  # accept measured approximations (RoPE frequencies, dropped biases)
    drop_biases: bool = False  # drop biases the engines ignore (vLLM/SGLang load no attention bias); needs allow_approx
    keep_biases: bool = False  # keep them although only transformers applies them (vLLM/SGLang skip them silently)
    pad_latent: str = "none"  # none | vllm (320/576) | flashmla (512 + 64) | llamacpp (x64); exact, larger cache
    # (vllm and flashmla also pad the head dims to what vLLM's CUDA MLA prefill takes, serving.layout.PREFILL_HEADS:
    # more prefill compute, the same cache)
    verify: bool = True
    verify_tokens: int = 64
    verify_batch: int = 2
    verify_new_tokens: int = 8
    seed: int = 0


@dataclass
class ExportPlan:
    heads: int
    groups: int
    nope: int  # d_n
    value: int  # d_v
    nope_out: int  # exported qk_nope_head_dim (d_n, or padded for vLLM's CUDA prefill)
    value_out: int  # exported v_head_dim
    rope_dims: int  # native d_r
    rope_dims_out: int  # exported qk_rope_head_dim
    rope_stride: int  # DeepSeek pair index step between native pairs (rope padding)
    rope_theta: float  # exported rope_theta: the kept pairs' geometric base, over the padded width
    kv_lora_rank: list[int]  # native d_c per layer
    kv_lora_rank_out: int  # exported kv_lora_rank (after --pad-latent)
    q_scale: float  # softmax scale folded into the query
    rope_score_scale: float  # the source RoPE type's cos/sin factor, squared (1 for default)
    residual_scale: float  # s = sqrt(EXPORT_EPS / source eps)
    fit: RopeFit
    q_bias: bool  # the query keeps a bias: q_lora path
    k_rope_bias: bool
    o_bias: bool
    q_lora_rank: int | None
    q_lora_mode: str | None  # "input" (q_a = [x; 1]) | "output" (q_b = identity)
    approximations: list[str]
    warnings: list[str]

    @property
    def attention_bias(self) -> bool:
        return self.q_bias or self.k_rope_bias or self.o_bias


def _nonzero(t: torch.Tensor | None) -> bool:
    return t is not None and bool(t.abs().max() > 0)


def out_dtype(options: ExportOptions, config) -> torch.dtype:
    name = options.dtype
    if name == "auto":
        name = str(getattr(config, "dtype", None) or "float32").replace("torch.", "")
    if name == "float16":
        raise UserError(
            "float16 cannot hold the export: the identity kv_a_layernorm needs latent values far below float16's "
            "normal range (~6e-5) and norm weights above its maximum; pass --dtype bfloat16 or --dtype float32"
        )
    if name not in ("float32", "bfloat16"):
        raise UserError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {options.dtype}")
    return getattr(torch, name)


def _pad_layout(options: ExportOptions, kv_lora_rank: int, rope_dims: int) -> tuple[int, int]:
    """(kv_lora_rank, qk_rope_head_dim) after --pad-latent; refuses a padding that cannot be exact."""
    if options.pad_latent == "none":
        return kv_lora_rank, rope_dims
    if options.pad_latent not in PAD_CHOICES:
        raise UserError(f"--pad-latent must be one of {', '.join(PAD_CHOICES)}, got {options.pad_latent}")
    if options.pad_latent == "llamacpp":  # a cached row of whole 64-value steps of ggml's f16 dot product
        step = LLAMACPP_BLOCK if rope_dims % LLAMACPP_BLOCK == 0 else 1  # and a latent of whole quantized blocks
        rank = -(-kv_lora_rank // step) * step
        while (rank + rope_dims) % LLAMACPP_ROW:
            rank += step
        return rank, rope_dims
    rope_dims_out = FLASHMLA_LAYOUT[1]
    if rope_dims > rope_dims_out:
        raise UserError(f"--pad-latent {options.pad_latent} needs qk_rope_head_dim {rope_dims_out}, below this "
                        f"model's {rope_dims}: convert with --rope-dims {rope_dims_out} or less")
    if options.pad_latent == "flashmla" or kv_lora_rank > VLLM_MLA_HEAD_SIZES[0] - rope_dims_out:
        target = FLASHMLA_LAYOUT[0]
    else:
        target = VLLM_MLA_HEAD_SIZES[0] - rope_dims_out
    if kv_lora_rank > target:
        raise UserError(f"kv_lora_rank {kv_lora_rank} is above {target}: no exact padding to a layout vLLM's MLA "
                        "accepts")
    return target, rope_dims_out


def identity_yarn(rope_theta: float, max_positions: int) -> dict:
    """The export's RoPE parameters: DeepSeek-V3's own YaRN type with factor 1, which changes no frequency and no scale
    (interpolated and extrapolated frequencies coincide, mscale 1). Not `default`: with it vLLM's DeepSeek class calls
    its CPU rotary kernel, which rotates only the first query head of MLA's [T, H, d] query (docs/serving.md, route 2);
    with YaRN it rotates in PyTorch."""
    return {"rope_type": "yarn", "rope_theta": rope_theta, "factor": 1.0,
            "original_max_position_embeddings": max_positions, "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0,
            "mscale_all_dim": 1.0}


def _rope_stride(rope_dims: int, rope_dims_out: int) -> int:
    """Where padding puts the kept rope pairs: every `stride`-th pair of the padded key when the kept pair count
    divides the padded one (the padded set then has the kept set's base), else the first ones (stride 1: the
    geometric set goes on past the slowest kept pair). Either way the padded pairs are zero and the kept frequencies
    unchanged: exact for any rope width up to the padded one."""
    return rope_dims_out // rope_dims if (rope_dims_out // 2) % (rope_dims // 2) == 0 else 1


def _pad_heads(options: ExportOptions, nope: int, value: int) -> tuple[int, int]:
    """(qk_nope_head_dim, v_head_dim) after --pad-latent: for vllm and flashmla (the layouts of vLLM's CUDA build) the
    smallest head layout its MLA prefill takes; refused when none holds them."""
    from mla_convert.serving.layout import PREFILL_HEADS, padded_heads

    if options.pad_latent not in ("vllm", "flashmla"):
        return nope, value
    return padded_heads(nope, value, PREFILL_HEADS["cuda"])


def serving_notes(kv_lora_rank: int, rope_dims: int, native_per_token: float, heads: int, nope: int) -> list[str]:
    """Warnings about what vLLM/SGLang will do with a (kv_lora_rank, qk_rope_head_dim) layout."""
    notes = []
    size = kv_lora_rank + rope_dims
    if size not in VLLM_MLA_HEAD_SIZES:
        expanded = 2 * heads * (nope + rope_dims)
        notes.append(
            f"kv_lora_rank + qk_rope_head_dim = {size}: vLLM's MLA backends accept only {VLLM_MLA_HEAD_SIZES} and "
            f"refuse this model; with VLLM_MLA_DISABLE=1 vLLM falls back to per-head K/V ({expanded} values per "
            f"token per layer instead of {size}); re-export with --pad-latent vllm for an exact padded layout"
        )
    if (kv_lora_rank, rope_dims) != FLASHMLA_LAYOUT:
        notes.append(f"FlashMLA needs kv_lora_rank 512 + qk_rope_head_dim 64 (this export: {kv_lora_rank} + "
                     f"{rope_dims}); engines pick another MLA kernel (vLLM: Triton MLA / FlashInfer / "
                     "FlashAttention MLA)")
    if size > native_per_token:
        notes.append(f"the exported cache holds {size} values per token per layer, more than the native "
                     f"model's {native_per_token:g} (padding to one rank for all layers)")
    return notes


def deepseek_layout_notes(config, kv_lora_rank: list[int], rope_dims: int) -> list[str]:
    """serving_notes for the layout a conversion with this per-layer kv_lora_rank will export to (no padding)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    native_per_token = sum(kv_lora_rank) / len(kv_lora_rank) + rope_dims
    return serving_notes(max(kv_lora_rank), rope_dims, native_per_token, heads, head_dim)


def native_config(folder: Path, what: str = "export"):
    """The MLAConfig of the native checkpoint folder `folder`; a UserError (naming `what` needs it) for a config.json
    that cannot be read or is not a native MLA model's."""
    from mla_convert.modeling import MLAConfig

    try:
        model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError) as e:  # ValueError: not JSON or not UTF-8; AttributeError: not an object
        raise UserError(f"cannot read {folder / 'config.json'} ({type(e).__name__}): pass a native MLA checkpoint "
                        "folder whose config.json is intact") from None
    if model_type != "mla":
        raise UserError(f"{what} needs a native MLA checkpoint (model_type mla, made by `mla-convert llama ... -o "
                        f"DIR`), got model_type {model_type}")
    return MLAConfig.from_pretrained(folder)


def _check_options(options: ExportOptions) -> None:
    if options.format not in FORMATS:
        raise UserError(f"--format must be one of {', '.join(FORMATS)}, got {options.format}")
    if options.drop_biases and options.keep_biases:
        raise UserError("--keep-biases and --drop-biases contradict each other: pass one of them")
    if options.drop_biases and not options.allow_approx:
        raise UserError("--drop-biases changes the model: pass --allow-approx with it (the error is measured)")
    if options.allow_approx and not options.verify:
        raise UserError("--allow-approx exports are always measured: drop --no-verify")


def make_export_plan(config, layer_biases: list[dict], options: ExportOptions) -> ExportPlan:
    """Decide the exported shapes, the RoPE mapping and which biases survive, from the config and the biases alone."""
    _check_options(options)
    if getattr(config, "model_type", None) != "mla":
        raise UserError(f"export needs a native MLA checkpoint (model_type mla, made by `mla-convert llama ... -o DIR`), "
                        f"got model_type {getattr(config, 'model_type', None)}")
    if getattr(config, "mlp_bias", False):
        raise UserError("the MLP has biases, which DeepSeek-V3's dense MLP cannot hold: this model is not exportable")
    from mla_convert.serving.layout import check_servable

    check_servable(config, "DeepSeek-V3's MLA")
    heads, groups = config.num_attention_heads, config.num_key_value_heads
    rope_dims, nope, value = config.qk_rope_head_dim, config.qk_nope_head_dim, config.v_head_dim
    if rope_dims == 0:
        raise UserError("this model has no RoPE dims (qk_rope_head_dim 0); DeepSeek engines need a rope key: "
                        "convert with --rope-dims 8 or more")
    approximations, warnings = [], []
    inv_freq, attention_scaling = source_frequencies(config)
    rope_type = (config.rope_parameters or {}).get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        warnings.append(f"rope_type {rope_type} changes frequencies with the sequence length; the export uses the "
                        "frequencies at load time (exact up to the original context length only)")
    fit = fit_deepseek_rope(inv_freq, config.rope_pairs)
    if not fit.exact:
        message = (f"RoPE: {fit.problems[0] if fit.problems else 'not geometric'} (max frequency change "
                   f"{fit.max_freq_rel_error:.3g} with base {fit.base:.6g})")
        if not options.allow_approx:
            raise UserError(
                f"not exportable exactly: {message}. Convert with --rope-strategy high or uniform and --rope-merge "
                "(see mla_convert.rope_fit.deepseek_compatible_rope_pairs), or pass --allow-approx to export the "
                "nearest geometric frequencies with the logit error measured"
            )
        approximations.append(message)
    kv_lora_rank = config.kv_lora_ranks
    (kv_lora_rank_out, rope_dims_out), (nope_out, value_out) = (_pad_layout(options, max(kv_lora_rank), rope_dims),
                                                                _pad_heads(options, nope, value))
    stride = _rope_stride(rope_dims, rope_dims_out)
    has = {key: any(_nonzero(b.get(key)) for b in layer_biases) for key in ("q", "k_rope", "o")}
    if any(has.values()):
        names = [n for n, v in (("query", has["q"]), ("rope key", has["k_rope"]), ("output/value", has["o"])) if v]
        if options.drop_biases:
            approximations.append(f"dropped the {', '.join(names)} biases (what vLLM and SGLang compute anyway)")
            has = dict.fromkeys(has, False)
        elif not options.keep_biases:
            raise UserError(
                f"this model has {', '.join(names)} biases, which vLLM's and SGLang's DeepSeek classes drop silently: "
                "serve the native checkpoint through the vLLM plugin instead (exact, docs/serving.md), or pass "
                "--keep-biases (for transformers only) or --drop-biases --allow-approx (the error is measured)"
            )
        else:
            warnings.append(
                f"this export keeps {', '.join(names)} biases (attention_bias: true): transformers loads them, but "
                "vLLM and SGLang build DeepSeek attention without biases and skip them silently; see "
                "export_max_rel_logit_error_without_biases, or re-export with --drop-biases --allow-approx"
            )
    q_lora_rank = q_lora_mode = None
    if has["q"]:
        hidden, q_rows = config.hidden_size, heads * (nope_out + rope_dims_out)
        q_lora_mode = "input" if hidden + 1 <= q_rows else "output"
        q_lora_rank = hidden + 1 if q_lora_mode == "input" else q_rows
    native_per_token = sum(kv_lora_rank) / len(kv_lora_rank) + rope_dims
    warnings += serving_notes(kv_lora_rank_out, rope_dims_out, native_per_token, heads, nope)
    if config.hidden_act != "silu":
        warnings.append(f"hidden_act {config.hidden_act}: vLLM's DeepSeek MLP supports only silu")
    return ExportPlan(
        heads=heads, groups=groups, nope=nope, value=value, nope_out=nope_out, value_out=value_out,
        rope_dims=rope_dims, rope_dims_out=rope_dims_out, rope_stride=stride,
        rope_theta=fit.base ** (rope_dims_out / (stride * rope_dims)),
        kv_lora_rank=kv_lora_rank, kv_lora_rank_out=kv_lora_rank_out,
        q_scale=config.softmax_scale * math.sqrt(nope_out + rope_dims_out),
        rope_score_scale=attention_scaling**2,
        residual_scale=math.sqrt(EXPORT_EPS / config.rms_norm_eps),
        fit=fit, q_bias=has["q"], k_rope_bias=has["k_rope"], o_bias=has["o"],
        q_lora_rank=q_lora_rank, q_lora_mode=q_lora_mode, approximations=approximations, warnings=warnings,
    )  # fmt: skip


def deepseek_config(config, plan: ExportPlan, dtype: torch.dtype) -> dict:
    """config.json of the export: a dense DeepSeek-V3 (every layer below first_k_dense_replace)."""
    from transformers import DeepseekV3Config

    layers = config.num_hidden_layers
    ds = DeepseekV3Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        moe_intermediate_size=config.intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=plan.heads,
        num_key_value_heads=plan.heads,  # kv_b_proj makes per-head K/V: the format's grouping must be 1
        # Dense only: n_routed_experts must be an int (transformers rejects null, vLLM's loader adds to it).
        n_shared_experts=1, n_routed_experts=1, num_experts_per_tok=1, n_group=1, topk_group=1,
        first_k_dense_replace=layers,
        routed_scaling_factor=1.0,  # vLLM divides fp16 hidden states by it: 1.0 keeps the norms' eps unchanged
        kv_lora_rank=plan.kv_lora_rank_out,
        q_lora_rank=plan.q_lora_rank,
        qk_rope_head_dim=plan.rope_dims_out,
        qk_nope_head_dim=plan.nope_out,
        v_head_dim=plan.value_out,
        hidden_act=config.hidden_act,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=EXPORT_EPS,
        rope_parameters=identity_yarn(plan.rope_theta, config.max_position_embeddings),
        rope_interleave=True,
        attention_bias=plan.attention_bias,
        attention_dropout=0.0,
        tie_word_embeddings=False,  # vLLM's DeepSeek ignores tying: lm_head is always written
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        num_nextn_predict_layers=0,
        initializer_range=config.initializer_range,
    )  # fmt: skip
    out = ds.to_dict()
    # Without it vLLM resolves the base DeepseekV3Model and serves an embedding model (LLM.generate refuses it).
    out["architectures"] = ["DeepseekV3ForCausalLM"]
    out["dtype"] = str(dtype).replace("torch.", "")
    # Engines pinned to transformers 4 read these top-level keys (rope_parameters is transformers 5).
    out["rope_theta"] = plan.rope_theta
    out["rope_scaling"] = {"type": "yarn", **{k: v for k, v in out["rope_parameters"].items() if k != "rope_theta"}}
    out.pop("transformers_version", None)
    return out
