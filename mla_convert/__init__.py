"""mla-convert: turn GQA/MHA Llama, Mistral and Qwen2 checkpoints into Multi-head Latent Attention (MLA) models.

Importing this package registers the native MLA model (`model_type: "mla"`) with the transformers Auto classes, so
`AutoModelForCausalLM.from_pretrained(folder)` loads a converted checkpoint without `trust_remote_code`.

Imported before torch (as the `mla-convert` command is), it also turns on torch's transparent-huge-page allocation
(`THP_MEM_ALLOC_ENABLE=1`) unless the environment sets that variable: torch reads it once, at its own import. Blocks of
2 MB and more are then backed by 2 MB pages where the kernel allows it (`transparent_hugepage` `madvise` or `always`),
so a freshly allocated block faults in up to 512 times fewer pages: the conversion's statistics pass frees and
allocates blocks of hundreds of megabytes for every layer (docs/decisions.md, "The statistics pass's page faults").
`THP_MEM_ALLOC_ENABLE=0` turns it off. The refinement workers inherit the variable.
"""

import os
import sys

if "torch" not in sys.modules:
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"

from mla_convert.modeling import MLAConfig, MLAForCausalLM, MLAModel  # noqa: E402  (registers the Auto classes)

__all__ = ["MLAConfig", "MLAForCausalLM", "MLAModel", "__version__"]
