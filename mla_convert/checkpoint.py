"""Checkpoints in and out: the names a library user imports from here.

Reading sources lives in `sources.py` (`open_source`, `Source`, the embedded default), writing and checking output
folders in `outputs.py` (`staged_output`, `ShardedWriter`, `verify_checkpoint`); code inside mla_convert imports those.
"""

from mla_convert.outputs import verify_checkpoint
from mla_convert.sources import Source, default_model_path, open_source

__all__ = ["Source", "default_model_path", "open_source", "verify_checkpoint"]
