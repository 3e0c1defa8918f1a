"""The resume store: each converted layer in its own sealed file, the calibration activations after the last finished
layer, and the fingerprint a run must share with the one that kept them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from mla_convert.outputs import kept_file_intact, seal_kept_file
from mla_convert.sources import AUX_FILES, Source, file_stamp
from mla_convert.writes import save_tensors
from mla_convert.conversion.options import ConvertOptions
from mla_convert.conversion.plan import Plan


def layer_file(i: int) -> str:
    return f"layer-{i:05d}.safetensors"


def write_layer(path: Path, tensors: dict[str, torch.Tensor], rope_pairs: list[int], dtype: torch.dtype,
                record: dict | None = None) -> None:
    """One converted layer's output tensors (as `dtype`, in writing order), its RoPE pairs and what the run recorded
    of it (`record`, JSON: a resumed run's provenance carries it on), renamed into place last."""
    tensors = {n: t.detach().to(dtype).contiguous().clone() for n, t in tensors.items()}  # clone: no shared storage
    meta = {"order": json.dumps(list(tensors)), "rope_pairs": json.dumps([int(p) for p in rope_pairs]),
            "record": json.dumps(record or {})}
    tmp = path.with_name(path.name + ".tmp")
    save_tensors(tensors, tmp, metadata=meta)
    seal_kept_file(tmp, path)


def read_layer(path: Path) -> dict[str, torch.Tensor]:
    """The layer's tensors from `write_layer`'s file, in writing order."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in json.loads(f.metadata()["order"])}


def read_layer_meta(path: Path) -> tuple[list[int], dict]:
    """(the layer's RoPE pairs, what the run that converted it recorded of it: {} in a file without a record) from
    `write_layer`'s file, without reading its tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    return json.loads(meta["rope_pairs"]), json.loads(meta.get("record", "{}"))


ACTIVATIONS_FILE = "activations.safetensors"


def write_activations(folder: Path, layer: int, hidden: torch.Tensor) -> None:
    """The calibration hidden states after `layer` [N, T, D] (float32), replacing the previous layer's: a resumed run
    starts from them instead of running every finished layer again."""
    tmp = folder / (ACTIVATIONS_FILE + ".tmp")
    save_tensors({"hidden": hidden.contiguous()}, tmp, metadata={"after_layer": str(layer)})
    seal_kept_file(tmp, folder / ACTIVATIONS_FILE)


def read_activations(folder: Path) -> tuple[int, torch.Tensor] | None:
    from safetensors import safe_open

    if not kept_file_intact(folder / ACTIVATIONS_FILE):
        return None
    with safe_open(str(folder / ACTIVATIONS_FILE), framework="pt") as f:
        return int(f.metadata()["after_layer"]), f.get_tensor("hidden")


def fingerprint(source: Source, options: ConvertOptions, plan: Plan) -> dict:
    """Everything a converted layer depends on: a run resumes only the work of a run with the same fingerprint."""
    import transformers

    from mla_convert import __version__

    from mla_convert.conversion.calibration import parse_mixture

    calib = [Path(name).expanduser() for name, _ in parse_mixture(options.calib_data)] if options.calib_data else []
    return {
        "mla_convert": __version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),  # the thread count changes the order of float sums, so the bytes
        "source": source.origin,
        "source_files": [file_stamp(p) for p in source.files()],
        # the calibration tokens depend on the tokenizer, the calibration forward on transformers' decoder classes
        "tokenizer_files": [
            file_stamp(source.folder / n) for n in AUX_FILES if source.folder and (source.folder / n).is_file()
        ],
        "transformers": transformers.__version__,
        "calibration_files": [file_stamp(path) for path in calib if path.is_file()],
        "options": dataclasses.asdict(options),
        "plan": {"ranks": plan.kv_lora_rank, "rope_dims": plan.rope_dims, "dtype": plan.dtype},
    }
