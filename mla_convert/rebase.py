"""`mla-convert rebase`: a written native checkpoint copied with its latent in another basis (`mla_convert.latent_basis`),
fitted on the conversion's own calibration text."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from mla_convert.errors import UserError
from mla_convert.latent_basis import BASES, cache_kept, change_basis


def _calibration_windows(model, folder: Path, spec: str, samples: int, seq_len: int) -> torch.Tensor:
    """Windows of `spec` as a conversion reads them: 'self' is text sampled from the conversion's source (named in
    provenance.json), at the temperature a conversion to this share of the cache uses, from the same cache."""
    from mla_convert import provenance
    from mla_convert.conversion import selftext
    from mla_convert.conversion.calibration import calibration_tokens, check_calib_spec
    from mla_convert.checkpoint import open_source

    check_calib_spec(spec, samples)
    source_name = ((provenance.load(folder) or {}).get("source") or {}).get("model")
    if source_name is None and "self" in spec:
        raise UserError(f"--calib-data {spec} samples text from the source this model was converted from, and "
                        f"{folder} does not name one (provenance.json): pass --calib-data FILE")
    return calibration_tokens(open_source(source_name), spec, samples, seq_len, seed=0,
                              temperature=selftext.calib_temperature(cache_kept(model.config)))


def rebase_checkpoint(folder: str | os.PathLike, out: str | os.PathLike, basis: str = "balanced",
                      calib_data: str = "self", calib_samples: int = 4, calib_seq_len: int = 2048,
                      overwrite: bool = False) -> dict:
    """Write the native MLA checkpoint `folder` to `out` with its latent in `basis` (see the module docstring): the
    same model in 32-bit arithmetic (the largest logit change on a calibration window is measured and recorded), a
    latent that block-quantized caches hold better. -> the step's record."""
    from mla_convert import provenance
    from mla_convert.card import write_model_card
    from mla_convert.evaluate import load_model
    from mla_convert.outputs import check_output, staged_output
    from mla_convert.writes import room_for

    folder = Path(folder).expanduser()
    if basis not in BASES:
        raise UserError(f"--basis must be one of {', '.join(BASES)}, got {basis}")
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    if config.get("model_type") != "mla":
        raise UserError(f"{folder} is not a native MLA checkpoint folder (config.json with model_type mla): pass the "
                        "output of `mla-convert llama|qwen|convert`")
    check_output(Path(out), overwrite, (folder,))
    model, tokenizer, _ = load_model(str(folder))
    if model.config.qk_norm and basis != "native":
        raise UserError("this model normalizes each query head (qk_norm, e.g. Qwen3): a latent basis for it is not "
                        "built yet; serve it with a 16-bit or q8_0 cache")
    windows = _calibration_windows(model, folder, calib_data, calib_samples, calib_seq_len)
    error = change_basis(model, basis, windows)
    dtype = config.get("dtype") or "float32"
    parent = provenance.load(folder)
    record = {"basis": basis, "calib_data": calib_data, "calib_samples": calib_samples, "calib_seq_len": calib_seq_len,
              "max_rel_logit_change": error}
    model = model.to(getattr(torch, dtype))
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with room_for(out, needed, "the re-based copy at"), staged_output(Path(out), overwrite, (folder,)) as stage:
        model.save_pretrained(stage)
        tokenizer.save_pretrained(stage)
        provenance.save(stage, provenance.new(
            "basis", source=(parent or {}).get("source"), method=f"latent basis: {basis}", options=record,
            kv_cache=(parent or {}).get("kv_cache"), measurements={"basis_max_rel_logit_change": error},
            parent=parent))  # fmt: skip
        write_model_card(stage)
    return record
