"""Run by vLLM's Python (scripts/install-vllm.sh): which head layouts vLLM's CUDA build would refuse, decided by vLLM's
own selection code for a Hopper GPU (compute capability 9.0). The CPU wheel ships the same Python as the CUDA build
but not its compiled kernels, so a kernel's availability is set aside and only its shape rules are kept.

    python vllm_cuda_paths.py '[[kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim, v_head_dim], ...]'

prints one JSON entry per layout: {"decode_head_size_refused": [backend names], "prefill": [FLASH_ATTN's reasons]}.
"""

from __future__ import annotations

import json
import sys
import types

import torch

# The CUDA platform module imports the CUDA build's operator library and fa_utils names that the CPU wheel lacks;
# neither is called by the selection code below.
sys.modules.setdefault("vllm._C_stable_libtorch", types.ModuleType("vllm._C_stable_libtorch"))
import vllm.v1.attention.backends.fa_utils as fa_utils  # noqa: E402

fa_utils.__dict__.setdefault("compile_flash_attn_varlen_func_from_specs", None)

from vllm.platforms.cuda import CudaPlatform  # noqa: E402
from vllm.platforms.interface import DeviceCapability  # noqa: E402
from vllm.v1.attention.backends.mla.prefill.base import MLADimensions  # noqa: E402
from vllm.v1.attention.backends.mla.prefill.registry import MLAPrefillBackendEnum  # noqa: E402
from vllm.v1.attention.backends.mla.prefill.selector import MLAPrefillSelectorConfig  # noqa: E402
from vllm.v1.attention.selector import AttentionSelectorConfig  # noqa: E402

HOPPER = DeviceCapability(9, 0)
UNAVAILABLE = "required dependencies not available"  # the kernel is not compiled into the CPU wheel


def check(kv_lora_rank: int, rope: int, nope: int, value: int) -> dict:
    selector = AttentionSelectorConfig(head_size=kv_lora_rank + rope, dtype=torch.bfloat16, kv_cache_dtype="auto",
                                       block_size=None, use_mla=True)
    _, invalid = CudaPlatform.get_valid_backends(HOPPER, selector)
    refused = sorted(backend.name for backend, (_, reasons) in invalid.items() if "head_size not supported" in reasons)
    # Hopper's only MLA prefill backend (vllm.platforms.interface.Platform.get_mla_prefill_backend_cls)
    dims = MLADimensions(qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=value)
    prefill = MLAPrefillBackendEnum.FLASH_ATTN.get_class().validate_configuration(
        HOPPER, MLAPrefillSelectorConfig(dtype=torch.bfloat16, mla_dimensions=dims))
    return {"decode_head_size_refused": refused, "prefill": [r for r in prefill if r != UNAVAILABLE]}


if __name__ == "__main__":
    print(json.dumps([check(*layout) for layout in json.loads(sys.argv[1])]))
