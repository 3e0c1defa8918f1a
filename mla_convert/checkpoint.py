"""Checkpoints in and out: the names a library user imports from here.

Reading sources lives in `sources.py` (`open_source`, `Source`, the embedded default), writing and checking output
folders in `outputs.py` (`staged_output`, `ShardedWriter`, `verify_checkpoint`); code inside mla_convert imports those.
"""

from mla_convert.outputs import verify_checkpoint
from mla_convert.sources import Source, default_model_path, open_source

# Re-exported until cli.py and conversion/ import them from sources.py and outputs.py.
from mla_convert.outputs import SHARD_BYTES, ShardedWriter, check_output, kept_file_intact, resume_dir, seal_kept_file
from mla_convert.outputs import staged_output
from mla_convert.sources import AUX_FILES, file_stamp

__all__ = [
    "AUX_FILES", "SHARD_BYTES", "ShardedWriter", "Source", "check_output", "default_model_path", "file_stamp",
    "kept_file_intact", "open_source", "resume_dir", "seal_kept_file", "staged_output", "verify_checkpoint",
]  # fmt: skip
