"""`provenance.json`: what produced an output folder, so cards, pushes and later steps can say exactly what was done.

Layout (keys may be absent when unknown):

    {
      "kind": "convert" | "finetune" | "export",
      "mla_convert_version": "0.1.0",
      "created": "2026-11-22T09:00:00+00:00",
      "command": "mla-convert llama ... (the argv as run)",
      "source": {"model": path or hub id, "revision": str | None, "family": "llama", "model_type": "llama",
                 "license": str | None, "base_model": hub id for the card | None},
      "method": short name of the conversion method (e.g. "activation-aware joint SVD"),
      "options": {resolved options of this step},
      "kv_cache": {"elements_per_token_per_layer_before": int, "elements_per_token_per_layer_after": int | float,
                   "bytes_per_token_before": int, "bytes_per_token_after": int, "ratio": float, "dtype": "bfloat16"},
      "measurements": {"perplexity": {"source": float, "converted": float, "finetuned": float, "protocol": str},
                       "export_max_rel_logit_error": float, ...},
      "versions": {"torch": ..., "transformers": ..., ...},
      "seed": int,
      "parent": the provenance of the folder this step started from (finetune/export), or None
    }
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import sys
from importlib import metadata
from pathlib import Path

FILENAME = "provenance.json"


def versions() -> dict[str, str]:
    out = {"python": sys.version.split()[0]}
    for dist in ("mla-convert", "torch", "transformers", "safetensors", "accelerate", "huggingface_hub"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def new(kind: str, **fields) -> dict:
    """A provenance record for a step of `kind`, stamped with time, command line and versions."""
    from mla_convert import __version__

    record = {
        "kind": kind,
        "mla_convert_version": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([os.path.basename(sys.argv[0])] + sys.argv[1:]),  # quoted: pastes back into a shell
        "versions": versions(),
    }
    record.update(fields)
    return record


def load(folder: str | os.PathLike) -> dict | None:
    path = Path(folder) / FILENAME
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        from mla_convert.errors import UserError

        raise UserError(f"{path} is unreadable ({type(e).__name__}): re-run the step that wrote {Path(folder)}") from None
    if not isinstance(record, dict):
        return None
    _check_types(record, path)
    return record


# The fields of a record that code reads, with the type each must have where present (None allowed but for kind).
_FIELD_TYPES = {"kind": str, "mla_convert_version": str, "created": str, "command": str, "measurements": dict,
                "options": dict, "source": dict, "kv_cache": dict, "plan": dict, "parent": dict, "export": dict,
                "versions": dict}


def _check_types(record: dict, path: Path, depth: int = 0) -> None:
    """Refuse (one line) a record whose known fields, or its parents' (the chain of steps), have another type."""
    from mla_convert.errors import UserError

    for key, kind in _FIELD_TYPES.items():
        value = record.get(key)
        if (value is None and key != "kind" and key in record) or key not in record:
            continue
        if not isinstance(value, kind):
            where = "parent's " * depth
            raise UserError(f"{path} has a {where}{key} of type {type(value).__name__}, not {kind.__name__}: restore "
                            f"the file or re-run the step that wrote {path.parent}")
    measurements = record.get("measurements") or {}
    for key in ("perplexity", "finetune"):
        if measurements.get(key) is not None and not isinstance(measurements[key], dict):
            raise UserError(f"{path} has measurements.{key} of type {type(measurements[key]).__name__}, not dict: "
                            f"restore the file or re-run the step that wrote {path.parent}")
    if isinstance(record.get("parent"), dict) and depth < 32:
        _check_types(record["parent"], path, depth + 1)


def save(folder: str | os.PathLike, record: dict) -> None:
    from mla_convert.writes import write_text_whole

    write_text_whole(Path(folder) / FILENAME, json.dumps(record, indent=2, sort_keys=False, default=str) + "\n")


def add_measurements(folder: str | os.PathLike, **measurements) -> dict | None:
    """Merge measured numbers into the folder's provenance (nested dicts merged one level deep)."""
    record = load(folder)
    if record is None:
        return None
    current = record.setdefault("measurements", {})
    for key, value in measurements.items():
        if isinstance(value, dict) and isinstance(current.get(key), dict):
            current[key].update(value)
        else:
            current[key] = value
    save(folder, record)
    return record
