"""Student and teacher models, which parameters train, and the learning-rate schedule."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from mla_convert.dtypes import DTYPES
from mla_convert.errors import UserError
from mla_convert.training.recipe import FinetuneConfig


def torch_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_student(path: str, dtype: torch.dtype):
    import mla_convert  # noqa: F401  (registers the MLA model with the Auto classes)
    from transformers import AutoModelForCausalLM

    from mla_convert.evaluate import check_loadable_folder

    if Path(path).is_dir():
        check_loadable_folder(Path(path))  # no pickle, no custom code, no shard outside the folder
    try:  # use_safetensors: never torch.load
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False, use_safetensors=True)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot load the student {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}): "
                        "pass a model folder (e.g. the output of mla-convert llama)") from None
    from mla_convert.evaluate import check_weights_finite

    check_weights_finite(model, path)  # before any step: a NaN weight makes every loss NaN
    return model


def teacher_spec(cfg: FinetuneConfig) -> str | None:
    """The teacher to load: `teacher` as given, or for "auto" the source recorded in the student's provenance."""
    from mla_convert import provenance

    if cfg.teacher != "auto":
        return cfg.teacher
    record = provenance.load(cfg.model) if Path(cfg.model).is_dir() else None
    source = (record or {}).get("source") or {}
    if not source.get("model"):
        raise UserError(f"teacher=auto needs {cfg.model}/provenance.json naming the source model: "
                        "set teacher to the source folder or .gguf file")
    return source["model"]


def load_teacher(spec: str, dtype: torch.dtype):
    """The teacher model (eval mode, no grads) from a folder, a .gguf file, "embedded", or a hub id."""
    from mla_convert import evaluate

    path = Path(spec).expanduser()
    if spec == "embedded" or path.exists():
        name = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]
        model, _, _ = evaluate.load_model(None if spec == "embedded" else str(path), dtype=name)
    else:
        from transformers import AutoModelForCausalLM

        try:
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, trust_remote_code=False,
                                                         use_safetensors=True)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load the teacher {spec} ({type(e).__name__}): pass a local folder or .gguf") from None
        evaluate.check_weights_finite(model, spec)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def select_trainable(model, which: str) -> list[str]:
    """Freeze everything but the chosen parameters; returns the names that train."""
    names = []
    for name, param in model.named_parameters():
        module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]  # "model.layers.0.input_layernorm.weight" -> "input_layernorm"
        attention = ".self_attn." in name
        train = which == "all" or attention or (which == "attention+norms" and "norm" in module)
        param.requires_grad_(train)
        if train:
            names.append(name)
    if not names:
        raise UserError(f"train={which} selects no parameters of this model: use train=all")
    return names


def lr_lambda(cfg: FinetuneConfig, total_steps: int, time_spent=lambda: 0.0):
    """The learning-rate factor of an optimizer step. time_spent() -> the share of the time budget used so far (0 without
    one). Warmup and decay each follow the step share or the time share, whichever is further along: a run bounded by
    time warms up over the same share of its time as of its steps, and ends its decay when the time is spent."""
    warmup = int(cfg.warmup * total_steps) if cfg.warmup < 1 else int(cfg.warmup)
    warmup_share = min(1.0, warmup / total_steps) if total_steps else 0.0

    def factor(step: int) -> float:  # step = optimizer steps done so far
        spent = time_spent()
        if step < warmup and spent < warmup_share:
            return max((step + 1) / (warmup + 1), spent / warmup_share)
        if cfg.schedule == "constant" or total_steps <= warmup:
            return 1.0
        by_time = (spent - warmup_share) / (1 - warmup_share)
        progress = min(1.0, max((step - warmup) / max(1, total_steps - warmup), by_time, 0.0))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return factor
