"""Fine-tuning with accelerate: next-token cross-entropy, distillation from the source model, or a mix of the two.

Launch (any number of processes; one process works without the launcher):

    accelerate launch -m mla_convert.finetune --config recipes/smollm2-135m.yaml [key=value ...]
    mla-convert finetune --config recipes/smollm2-135m.yaml [key=value ...] [--num-processes N]

The loss per token is `(1 - kd_weight) * CE(student, next token) + kd_weight * T^2 * KL(teacher_T || student_T)`,
where the teacher (the source model) runs alongside the student on the same batch. Why alongside and not from
precomputed top-k logits: one pass over the data needs exactly one teacher forward per sequence either way, so
precomputing saves no compute, costs storage (k logits + indices per token) and truncates the teacher's
distribution; benchmarks/finetune.md has the measured teacher share of a step.

Output folder layout:

    OUT/metrics.jsonl        one JSON object per line: {"event": "train"|"eval", "step", ...}
    OUT/loss.png             loss and held-out perplexity against steps (written at the end)
    OUT/step_N/              a loadable model folder + trainer/ (optimizer, scheduler, RNG) + trainer_state.json
    OUT/final/               the complete fine-tuned checkpoint (config, safetensors, tokenizer, provenance, card)

A `step_N` folder counts only once its `trainer_state.json` exists (written last), so a run killed while saving
resumes from the checkpoint before. Resuming (`resume: true`, the default) restarts from the latest complete
`step_N` with the same data order: batches are a pure function of (seed, step, micro-step, rank), so a resumed run
gives the losses of an uninterrupted one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import logging
import math
import os
import re
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

from mla_convert.dtypes import DTYPES
from mla_convert.errors import UserError
from mla_convert.selftext import SELF

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
TRAINER_DIR = "trainer"
METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
FINAL_DIR = "final"
# Test hook: exit abruptly (as if killed) right after this optimizer step and its checkpoint, if any.
CRASH_ENV = "MLA_FINETUNE_CRASH_AFTER_STEP"
TRAINABLE = ("attention", "attention+norms", "all")
SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "no", "bf16", "fp16")
# Fields whose change alters which batch a step sees; a resume refuses a checkpoint written with other values.
DATA_ORDER_FIELDS = ("data", "eval_data", "seq_len", "batch_size", "grad_accum", "seed", "eval_windows", "eval_seq_len")


@dataclasses.dataclass
class FinetuneConfig:
    """The settings of one fine-tuning run (the `finetune:` section of a recipe, plus key=value overrides)."""

    model: str  # student: a model folder or hub id that AutoModelForCausalLM loads (native MLA or any causal LM)
    output: str  # run folder (checkpoints, metrics, final/)
    data: str  # training text: local .txt/.jsonl file, datasets name[:config[:split]], or self (sampled from the teacher)
    teacher: str | None = "auto"  # "auto": the source named in the student's provenance; a folder/.gguf/hub id; none
    eval_data: str | None = None  # held-out text; None: the last eval_windows*eval_seq_len tokens of `data`
    seq_len: int = 512  # tokens per packed training sequence
    batch_size: int = 1  # sequences per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int | None = None  # optimizer steps; else derived from max_tokens; else one epoch
    max_tokens: int | None = None  # training-token budget over all processes (rounded down to whole steps)
    lr: float = 1e-4
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio
    warmup: float = 0.05  # warmup steps: a fraction of max_steps when < 1, else a step count
    schedule: str = "cosine"  # cosine | linear | constant (after warmup)
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0  # 0 disables clipping
    train: str = "attention"  # which parameters train: attention | attention+norms | all
    kd_weight: float = 0.0  # 0: LM loss only; 1: distillation only; in between: a mix
    kd_temperature: float = 1.0
    mixed_precision: str = "auto"  # auto (bf16 on CUDA with bf16 support, fp16 on other CUDA, off on CPU) | no | bf16 | fp16
    dtype: str = "float32"  # student weights (the optimizer's master copy)
    teacher_dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    gradient_checkpointing: bool = False
    eval_every: int = 50  # optimizer steps between held-out evaluations (0: only before and after)
    eval_windows: int = 8
    eval_seq_len: int | None = None  # defaults to seq_len
    save_every: int = 100  # optimizer steps between step_N checkpoints (0: none)
    keep_last_n: int = 2  # step_N folders kept (older ones deleted once a newer one is complete); 0 keeps all
    log_every: int = 1
    resume: bool = True  # continue from the latest complete step_N in `output`
    overwrite: bool = False  # delete an existing run folder this trainer wrote (never one holding other files)
    allow_test_split: bool = False  # allow training text whose file name says "test" (a result on it is not one)
    threads: int | None = None  # torch threads per process on CPU; default: cores / local processes
    seed: int = 0

    def __post_init__(self):
        if self.train not in TRAINABLE:
            raise UserError(f"train must be one of {', '.join(TRAINABLE)}, got {self.train!r}")
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.mixed_precision not in PRECISIONS:
            raise UserError(f"mixed_precision must be one of {', '.join(PRECISIONS)}, got {self.mixed_precision!r}")
        if self.dtype not in DTYPES:
            raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.teacher_dtype != "auto" and self.teacher_dtype not in DTYPES:
            raise UserError(f"teacher_dtype must be auto or one of {', '.join(DTYPES)}, got {self.teacher_dtype!r}")
        if not 0.0 <= self.kd_weight <= 1.0:
            raise UserError(f"kd_weight must lie in [0, 1] (0: LM only, 1: distillation only), got {self.kd_weight}")
        if not self.kd_temperature > 0 or not math.isfinite(self.kd_temperature):
            raise UserError(f"kd_temperature must be positive, got {self.kd_temperature}")
        for name in ("seq_len", "batch_size", "grad_accum", "eval_windows", "log_every"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.seq_len < 2:
            raise UserError("seq_len must be at least 2")
        for name in ("eval_every", "save_every", "keep_last_n"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"max_steps must be at least 1, got {self.max_steps}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.threads is not None and self.threads < 1:
            raise UserError(f"threads must be at least 1, got {self.threads}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise UserError(f"lr must be a positive number, got {self.lr}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise UserError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio}")
        for name in ("warmup", "weight_decay", "max_grad_norm"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise UserError(f"{name} must be a number >= 0, got {value}")
        if self.teacher is not None and str(self.teacher).lower() in ("none", "null", ""):
            self.teacher = None
        if self.kd_weight > 0 and self.teacher is None:
            raise UserError("kd_weight > 0 needs a teacher: set teacher=auto or a model folder / .gguf file")
        if self.eval_seq_len is None:
            self.eval_seq_len = self.seq_len

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def typed(cls, section: dict) -> dict:
        """`section` with each value checked against (and where harmless converted to) its field's type: a UserError
        names the setting, so a wrong type never reaches the trainer as a traceback."""
        names = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a text"}
        out = dict(section)
        for f in dataclasses.fields(cls):
            if f.name not in section:
                continue
            value, kinds = section[f.name], str(f.type).replace(" ", "").split("|")
            if value is None:
                if "None" in kinds:
                    continue
                raise UserError(f"{f.name} needs a value ({names[kinds[0]]})")
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if "bool" in kinds and isinstance(value, bool):
                continue
            if "int" in kinds and number and float(value).is_integer():
                out[f.name] = int(value)
            elif "float" in kinds and number:
                out[f.name] = float(value)
            elif "str" in kinds and (isinstance(value, str) or number):
                out[f.name] = str(value)
            else:
                wanted = " or ".join(names[k] for k in kinds if k in names)
                raise UserError(f"{f.name} must be {wanted}, got {value!r}")
        return out


# ------------------------------------------------------------------------------------------------- recipes


# An installed wheel carries recipes/ as data files: <prefix>/share/mla-convert/recipes (pyproject data-files).
INSTALLED_RECIPES = Path("share", "mla-convert", "recipes")


def shipped_recipes_dir(package: Path | None = None) -> Path | None:
    """The folder of shipped recipes: `recipes/` of a source checkout (editable install), else the copy an installed
    wheel puts under its installation prefix (venv, user or system scheme); None when neither exists.
    `package`: the mla_convert folder to start from (default: this one)."""
    import sysconfig

    package = Path(__file__).resolve().parent if package is None else Path(package)
    candidates = [package.parent / "recipes"]
    # site-packages lies below the prefix that holds share/ (lib/pythonX.Y/site-packages, Lib/site-packages)
    candidates += [parent / INSTALLED_RECIPES for parent in package.parents]
    candidates += [Path(sysconfig.get_path("data")) / INSTALLED_RECIPES]
    for folder in candidates:
        if (folder / "smollm2-135m.yaml").is_file():
            return folder
    return None


def _resolve_shipped(spec: str | os.PathLike, subdir: str, kind: str, example: str) -> Path:
    path = Path(spec).expanduser()
    if path.is_file():
        return path
    shipped = shipped_recipes_dir()
    name = str(spec).removesuffix(".yaml")
    if shipped is not None and "/" not in name and (shipped / subdir / f"{name}.yaml").is_file():
        return shipped / subdir / f"{name}.yaml"
    names = sorted(p.stem for p in (shipped / subdir).glob("*.yaml")) if shipped is not None else []
    raise UserError(f"{kind} {spec} not found: pass a YAML file path or a shipped name "
                    f"({', '.join(names) or 'none installed'}; e.g. {example})")


def resolve_recipe_path(spec: str | os.PathLike) -> Path:
    """A recipe file path, or a bare recipe name (e.g. smollm2-135m) looked up in the shipped recipes."""
    return _resolve_shipped(spec, ".", "recipe", "smollm2-135m")


def resolve_accelerate_config(spec: str | os.PathLike) -> Path:
    """An accelerate config file path, or a bare name (ddp, fsdp) looked up in the shipped recipes/accelerate/."""
    return _resolve_shipped(spec, "accelerate", "accelerate config", "fsdp")


def read_recipe(path: str | os.PathLike) -> dict:
    """The recipe as a mapping (sections `convert`, `finetune`, `eval`, ...)."""
    import yaml

    path = resolve_recipe_path(path)
    try:
        recipe = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise UserError(f"{path} is not valid YAML ({str(e).splitlines()[0]}): fix the file") from None
    if not isinstance(recipe, dict):
        raise UserError(f"{path} must hold a mapping with a `finetune:` section")
    return recipe


def parse_overrides(overrides: list[str]) -> dict:
    """`key=value` strings (values parsed as YAML scalars; a `finetune.` prefix is allowed) -> dict."""
    import yaml

    out = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UserError(f"override {item!r} is not key=value (e.g. max_steps=20)")
        key = key.removeprefix("finetune.").replace("-", "_")
        out[key] = yaml.safe_load(value) if value != "" else None
    return out


def load_config(recipe: str | os.PathLike | None, overrides: list[str] | None = None) -> FinetuneConfig:
    """The recipe's `finetune` section (or the whole file if it has none) with overrides applied, validated."""
    section: dict = {}
    if recipe is not None:
        data = read_recipe(recipe)
        section = data.get("finetune", data)
        if not isinstance(section, dict):
            raise UserError(f"{recipe}: the finetune section must be a mapping")
    section = {**section, **parse_overrides(overrides or [])}
    known = set(FinetuneConfig.field_names())
    unknown = sorted(set(section) - known)
    if unknown:
        raise UserError(f"unknown finetune setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    missing = [k for k in ("model", "output", "data") if section.get(k) in (None, "")]
    if missing:
        raise UserError(f"set {', '.join(missing)} in the recipe's finetune section or as key=value")
    return FinetuneConfig(**FinetuneConfig.typed(section))


# ---------------------------------------------------------------------------------------------- data order


class DataOrder:
    """Which packed sequences a (step, micro-step, rank) reads: a pure function of the seed, so resume repeats it.

    Global position p = ((step * grad_accum + micro) * world + rank) * batch + i walks through a fresh seeded
    permutation of all sequences per epoch (epoch = p // N).
    """

    def __init__(self, n_sequences: int, batch_size: int, grad_accum: int, world: int, seed: int):
        self.n, self.batch, self.accum, self.world, self.seed = n_sequences, batch_size, grad_accum, world, seed
        self._perms: dict[int, torch.Tensor] = {}

    def _perm(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perms[epoch] = torch.randperm(self.n, generator=gen)
        return self._perms[epoch]

    def indices(self, step: int, micro: int, rank: int) -> list[int]:
        start = ((step * self.accum + micro) * self.world + rank) * self.batch
        return [int(self._perm(p // self.n)[p % self.n]) for p in range(start, start + self.batch)]


def self_training_tokens(cfg: FinetuneConfig, world: int) -> torch.Tensor:
    """data=self: a token stream sampled from the teacher (the source; mla_convert.selftext, cached), long enough for
    the run's token budget plus the held-out windows when eval_data is unset."""
    from mla_convert.checkpoint import open_source
    from mla_convert.selftext import self_tokens

    spec = teacher_spec(cfg) if cfg.teacher is not None else None
    if spec is None:
        raise UserError("data=self samples the training text from the teacher: set teacher (auto, or the source)")
    if cfg.max_tokens is None and cfg.max_steps is None:
        raise UserError("data=self has no natural length: set max_tokens (or max_steps)")
    per_step = cfg.seq_len * cfg.batch_size * cfg.grad_accum * world
    need = cfg.max_steps * per_step if cfg.max_steps is not None else cfg.max_tokens
    need += 0 if cfg.eval_data is not None else cfg.eval_windows * cfg.eval_seq_len
    return self_tokens(open_source(None if spec == "embedded" else spec), need + cfg.seq_len, cfg.seed)


def prepare_data(cfg: FinetuneConfig, tokenizer, world: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(train sequences [N, seq_len], eval windows [W, eval_seq_len]); never sharing text with each other."""
    from mla_convert import data

    if not cfg.allow_test_split and data.looks_like_test_split(cfg.data):
        raise UserError(f"training text {cfg.data} looks like a test split: train on other text "
                        "(or set allow_test_split=true if it really is not evaluation text)")
    if cfg.data == SELF:
        ids = self_training_tokens(cfg, world)
        text = tokenizer.decode(ids.tolist())
    else:
        text = data.load_text(cfg.data)
        ids = data.tokenize(tokenizer, text, data.TRAIN_CHUNK_LINES)  # [N]
    held = cfg.eval_windows * cfg.eval_seq_len
    if cfg.eval_data is None:
        if ids.numel() < held + cfg.seq_len:
            raise UserError(f"{cfg.data} has {ids.numel()} tokens: too few to hold out {held} for evaluation and "
                            f"train on sequences of {cfg.seq_len}; lower eval_windows or pass eval_data")
        train_ids, eval_ids = ids[:-held], ids[-held:]  # disjoint by construction: the tail is held out
    else:
        if Path(cfg.eval_data).expanduser().resolve() == Path(cfg.data).expanduser().resolve():
            raise UserError("eval_data is the training text: give held-out text, or leave eval_data unset")
        eval_text = data.load_text(cfg.eval_data)
        data.check_disjoint(text, eval_text, cfg.data, cfg.eval_data)
        train_ids, eval_ids = ids, data.tokenize(tokenizer, eval_text, data.TRAIN_CHUNK_LINES)
    train = data.pack(train_ids, cfg.seq_len)
    windows = data.pack(eval_ids, cfg.eval_seq_len)[: cfg.eval_windows]
    return train, windows


# -------------------------------------------------------------------------------------------------- models


def _torch_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def load_student(path: str, dtype: torch.dtype):
    import mla_convert  # noqa: F401  (registers the MLA model with the Auto classes)
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot load the student {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]}): "
                        "pass a model folder (e.g. the output of mla-convert llama)") from None


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
            model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype, trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise UserError(f"cannot load the teacher {spec} ({type(e).__name__}): pass a local folder or .gguf") from None
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


def lr_lambda(cfg: FinetuneConfig, total_steps: int):
    warmup = int(cfg.warmup * total_steps) if cfg.warmup < 1 else int(cfg.warmup)

    def factor(step: int) -> float:  # step = optimizer steps done so far
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.schedule == "constant" or total_steps <= warmup:
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape

    return factor


# ---------------------------------------------------------------------------------------------------- losses


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy. logits [B, T, V], ids [B, T]."""
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """T^2 * mean over tokens of KL(teacher_T || student_T). Both [B, T, V]."""
    s = torch.log_softmax(student_logits.float() / temperature, dim=-1)  # [B, T, V]
    t = torch.log_softmax(teacher_logits.float() / temperature, dim=-1)  # [B, T, V]
    kl = torch.nn.functional.kl_div(s.flatten(0, 1), t.flatten(0, 1), log_target=True, reduction="batchmean")
    return kl * temperature**2


# ---------------------------------------------------------------------------------------------- checkpoints


def complete_checkpoints(out: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete step_N in `out`, oldest first."""
    found = []
    for folder in out.glob("step_*"):
        m = re.fullmatch(r"step_(\d+)", folder.name)
        if m and (folder / STATE_FILE).is_file():
            found.append((int(m.group(1)), folder))
    return sorted(found)


# trainer/ of a step_N checkpoint, written without pickle (accelerate's save_state pickles the scheduler and the RNG
# states, and its load_state unpickles them with weights_only=False: a checkpoint folder could run code on resume):
#   optimizer.safetensors   the optimizer's per-parameter tensors (AdamW moments, steps), from the main process
#   trainer.json            optimizer layout and param groups, scheduler and GradScaler state (plain numbers)
#   rng_<rank>.safetensors  each process's torch (and CUDA) RNG state; python and numpy RNG in its metadata
OPTIMIZER_FILE = "optimizer.safetensors"
TRAINER_JSON = "trainer.json"


def _rng_file(rank: int) -> str:
    return f"rng_{rank}.safetensors"


def optimizer_to_files(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """An optimizer state dict -> (tensors for safetensors, a JSON-able layout that names them)."""
    tensors: dict[str, torch.Tensor] = {}
    state = []
    for key, values in state_dict["state"].items():
        entry = {}
        for name, value in values.items():
            if torch.is_tensor(value):
                tensors[f"{key}/{name}"] = value.detach().cpu().contiguous()
                entry[name] = {"tensor": f"{key}/{name}"}
            else:
                entry[name] = {"value": value}
        state.append({"key": key, "values": entry})
    return tensors, {"state": state, "param_groups": state_dict["param_groups"]}


def optimizer_from_files(tensors: dict[str, torch.Tensor], layout: dict) -> dict:
    """The inverse of `optimizer_to_files` (JSON lists back to the tuples torch's param groups hold)."""
    state = {}
    for item in layout["state"]:
        state[item["key"]] = {name: tensors[v["tensor"]] if "tensor" in v else v["value"]
                              for name, v in item["values"].items()}
    groups = [{k: (tuple(v) if isinstance(v, list) and k != "params" else v) for k, v in g.items()}
              for g in layout["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_trainer_state(folder: Path, optimizer_state: dict | None, scheduler, scaler, rank: int) -> None:
    """Write trainer/ (see OPTIMIZER_FILE): `optimizer_state` and the rest from the main process (rank 0), the RNG
    state from every process."""
    import random

    import numpy as np
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        tensors, layout = optimizer_to_files(optimizer_state)
        save_file(tensors, str(folder / OPTIMIZER_FILE))
        record = {"optimizer": layout, "scheduler": scheduler.state_dict(),
                  "scaler": scaler.state_dict() if scaler is not None else None}
        (folder / TRAINER_JSON).write_text(json.dumps(record) + "\n")
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda_{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    rng["numpy_keys"] = torch.from_numpy(np.asarray(keys, dtype=np.int64))
    meta = {"python": json.dumps(random.getstate()), "numpy": json.dumps([kind, int(pos), int(has_gauss), float(cached)])}
    save_file(rng, str(folder / _rng_file(rank)), metadata=meta)


def load_trainer_state(folder: Path, rank: int) -> tuple[dict, dict, dict | None]:
    """Read trainer/ written by `save_trainer_state` and restore this process's RNG state; returns (optimizer state
    dict, scheduler state, GradScaler state). Nothing is unpickled."""
    import random

    import numpy as np
    from safetensors import safe_open
    from safetensors.torch import load_file

    if not (folder / TRAINER_JSON).is_file():
        pickled = sorted(p.name for p in folder.glob("*") if p.suffix in (".pkl", ".bin", ".pt"))
        why = f" (it holds {', '.join(pickled[:3])}: pickle files, which are not loaded)" if pickled else ""
        raise UserError(f"{folder} has no {TRAINER_JSON}{why}: it was written by an older mla-convert or is "
                        "incomplete; start over with overwrite=true")
    try:
        record = json.loads((folder / TRAINER_JSON).read_text())
        optimizer = optimizer_from_files(load_file(str(folder / OPTIMIZER_FILE)), record["optimizer"])
        with safe_open(str(folder / _rng_file(rank)), framework="pt") as f:
            meta = f.metadata()
            rng = {k: f.get_tensor(k) for k in f.keys()}
        torch.set_rng_state(rng["torch"])
        cuda = [rng[f"cuda_{i}"] for i in range(len(rng)) if f"cuda_{i}" in rng]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])
        python = json.loads(meta["python"])
        random.setstate((python[0], tuple(python[1]), python[2]))
        kind, pos, has_gauss, cached = json.loads(meta["numpy"])
        np.random.set_state((kind, rng["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, cached))
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        raise UserError(f"{folder} is damaged ({type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}): "
                        "resume from an earlier step_N (delete this one) or start over with overwrite=true") from None
    return optimizer, record["scheduler"], record.get("scaler")


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB


def _check_output(cfg: FinetuneConfig, out: Path) -> None:
    """Refuse an output folder that is the current directory (or holds it), or that is, holds or lies inside an input."""
    from mla_convert.checkpoint import check_location

    inputs = [(label, Path(spec)) for label, spec in (("student", cfg.model), ("training text", cfg.data),
                                                       ("eval_data", cfg.eval_data), ("teacher", cfg.teacher))
              if spec not in (None, "auto", "embedded") and Path(spec).expanduser().exists()]
    check_location(out, inputs, "output=runs/NAME")
    if out.exists() and not out.is_dir():
        raise UserError(f"output {out} is an existing file: set output to a folder")
    if out.is_dir() and any(out.iterdir()) and not _is_run_folder(out):
        raise UserError(f"{out} exists and is not a fine-tuning run folder of mla-convert, so it is neither resumed "
                        "nor deleted (not even with overwrite=true): remove it yourself or choose another output")
    foreign = _foreign_entries(out) if out.is_dir() else []
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise UserError(f"{out} holds files the trainer did not write ({shown}), so it is neither resumed nor "
                        "deleted: move them out or choose another output")


def check_output(cfg: FinetuneConfig) -> Path:
    """The run folder, resolved, once it is safe to write (and with overwrite=true, to delete), and the local inputs
    exist: call before launching."""
    from mla_convert import data

    student = Path(cfg.model).expanduser()
    if not student.exists() and (cfg.model.startswith((".", "/", "~")) or cfg.model.count("/") != 1):
        raise UserError(f"the student {cfg.model} does not exist: set model to a converted model folder "
                        "(the output of mla-convert llama) or a hub id like org/name")
    if student.exists() and not (student / "config.json").is_file():
        raise UserError(f"the student {cfg.model} has no config.json: set model to a converted model folder")
    for spec in (cfg.data, cfg.eval_data):
        if spec is not None and spec != SELF:
            data.check_text_spec(spec)
    out = Path(cfg.output).expanduser().resolve()
    _check_output(cfg, out)
    return out


def _foreign_entries(out: Path) -> list[str]:
    """Entries of a run folder that the trainer does not write there (a user's files: never ours to delete)."""
    ours = {METRICS_FILE, PLOT_FILE, FINAL_DIR}
    return sorted(p.name for p in out.iterdir() if p.name not in ours and not re.fullmatch(r"step_\d+", p.name))


def _is_run_folder(out: Path) -> bool:
    """A folder this trainer wrote: a finished run, complete checkpoints, or the metrics of a started run."""
    return ((out / FINAL_DIR / "provenance.json").is_file() or bool(complete_checkpoints(out))
            or (out / METRICS_FILE).is_file())


def _prepare_output(cfg: FinetuneConfig, out: Path, is_main: bool) -> None:
    """Main process only: refuse or clear an output that a resume cannot use. overwrite=true deletes only a run
    folder this trainer wrote, never a foreign one."""
    if not out.exists() or not any(out.iterdir()):
        out.mkdir(parents=True, exist_ok=True)
        return
    _check_output(cfg, out)  # again, right before a delete
    if cfg.overwrite:
        shutil.rmtree(out)
        out.mkdir(parents=True)
    elif (out / FINAL_DIR / "provenance.json").is_file():
        raise UserError(f"{out} holds a finished run ({out / FINAL_DIR}): pass overwrite=true or another output")
    elif not cfg.resume and complete_checkpoints(out):
        raise UserError(f"{out} holds checkpoints: pass resume=true to continue, or overwrite=true to start over")


class Metrics:
    """metrics.jsonl on the main process; a resume drops the lines after the step it restarts from."""

    def __init__(self, path: Path, enabled: bool, resume_step: int):
        self.path, self.enabled = path, enabled
        if enabled:
            kept = []
            if resume_step > 0 and path.is_file():
                kept = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            path.write_text("".join(line + "\n" for line in kept))

    def write(self, **record) -> None:
        if self.enabled:
            with self.path.open("a") as f:
                f.write(json.dumps(record) + "\n")

    def read(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]


def plot(records: list[dict], path: Path) -> None:
    """Training loss (and its CE / KL parts) and held-out perplexity against optimizer steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if r.get("event") == "train"]
    evals = [r for r in records if r.get("event") == "eval"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key in ("loss", "ce", "kl"):
        points = [(r["step"], r[key]) for r in train if r.get(key) is not None]
        if points:
            ax1.plot(*zip(*points), label=key, linewidth=1)
    ax1.set_xlabel("optimizer step")
    ax1.set_ylabel("training loss (nats/token)")
    ax1.legend()
    if evals:
        ax2.plot([r["step"] for r in evals], [r["perplexity"] for r in evals], marker="o")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("held-out perplexity")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -------------------------------------------------------------------------------------------------------- run


def run(cfg: FinetuneConfig) -> Path:
    """Train as configured (in every process of an accelerate launch); returns OUT/final."""
    import mla_convert  # noqa: F401  (registers the MLA model)
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, set_seed
    from transformers import AutoTokenizer

    from mla_convert import evaluate, provenance

    mp = cfg.mixed_precision
    if mp == "auto":
        mp = ("bf16" if torch.cuda.is_bf16_supported() else "fp16") if torch.cuda.is_available() else "no"
    accelerator = Accelerator(mixed_precision=mp)
    device, rank, world = accelerator.device, accelerator.process_index, accelerator.num_processes
    is_main = accelerator.is_main_process
    if device.type == "cpu":
        local = max(1, accelerator.num_processes)  # single-node CPU runs: share the cores
        torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))
    set_seed(cfg.seed)

    out = check_output(cfg)
    if is_main:
        _prepare_output(cfg, out, is_main)
    accelerator.wait_for_everyone()
    checkpoints = complete_checkpoints(out) if cfg.resume else []
    resume_step, resume_dir = checkpoints[-1] if checkpoints else (0, None)
    state: dict = json.loads((resume_dir / STATE_FILE).read_text()) if resume_dir else {}
    if resume_dir:
        changed = [k for k in DATA_ORDER_FIELDS if state["config"].get(k) != getattr(cfg, k)]
        if state.get("world_size") != world:
            changed.append(f"number of processes ({state.get('world_size')} -> {world})")
        if changed:
            raise UserError(f"cannot resume from {resume_dir}: {', '.join(changed)} changed since it was written; "
                            "restore them or pass overwrite=true to start over")
        log.info("resuming from %s", resume_dir)

    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as e:
        raise UserError(f"cannot load the tokenizer of the student {cfg.model} ({type(e).__name__}): pass a model "
                        "folder with its tokenizer (e.g. the output of mla-convert llama)") from None
    train_seqs, eval_windows = prepare_data(cfg, tokenizer, world)  # [N, T], [W, T_eval]
    tokens_per_step = cfg.seq_len * cfg.batch_size * cfg.grad_accum * world
    if cfg.max_steps is not None:
        total_steps = cfg.max_steps
    elif cfg.max_tokens is not None:
        total_steps = cfg.max_tokens // tokens_per_step
        if total_steps < 1:
            raise UserError(f"max_tokens={cfg.max_tokens} is less than one step of {tokens_per_step} tokens")
    else:
        total_steps = max(1, train_seqs.shape[0] // (cfg.batch_size * cfg.grad_accum * world))
    order = DataOrder(train_seqs.shape[0], cfg.batch_size, cfg.grad_accum, world, cfg.seed)

    model = load_student(str(resume_dir) if resume_dir else cfg.model, DTYPES[cfg.dtype])
    trainable = select_trainable(model, cfg.train)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    teacher = None
    if cfg.kd_weight > 0:
        teacher = load_teacher(teacher_spec(cfg), _torch_dtype(cfg.teacher_dtype, device)).to(device)
        t_vocab, s_vocab = teacher.get_output_embeddings().weight.shape[0], model.get_output_embeddings().weight.shape[0]
        if t_vocab != s_vocab:
            raise UserError(f"teacher vocabulary ({t_vocab}) differs from the student's ({s_vocab}): "
                            "distil only from the model the student was converted from")

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg, total_steps))
    model, optimizer = accelerator.prepare(model, optimizer)
    # FSDP replaces the parameters with sharded ones (and points the optimizer at them): clip and checksum those
    params = [p for p in model.parameters() if p.requires_grad]
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if fsdp and cfg.eval_windows % world:
        raise UserError(f"under FSDP every process must run the same forwards: make eval_windows ({cfg.eval_windows}) "
                        f"a multiple of the {world} processes")
    if fsdp:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

    def optimizer_state() -> dict:
        """The optimizer's full state (under FSDP gathered from the shards: a collective, call on every process)."""
        if fsdp:
            full = StateDictOptions(full_state_dict=True, cpu_offload=True)
            return get_optimizer_state_dict(model, optimizer.optimizer, options=full)
        return optimizer.state_dict()

    if resume_dir:
        # The weights come from step_N/ itself (from_pretrained above); optimizer, schedule, RNG from trainer/.
        optim_state, scheduler_state, scaler_state = load_trainer_state(resume_dir / TRAINER_DIR, rank)
        if fsdp:
            set_optimizer_state_dict(model, optimizer.optimizer, optim_state,
                                     options=StateDictOptions(full_state_dict=True))
        else:
            optimizer.load_state_dict(optim_state)
        scheduler.load_state_dict(scheduler_state)
        if scaler_state and accelerator.scaler is not None:
            accelerator.scaler.load_state_dict(scaler_state)

    metrics = Metrics(out / METRICS_FILE, is_main, resume_step)
    log.info("training %s: %d/%d parameters (%s), %d steps of %d tokens, %d process(es), mixed precision %s",
             cfg.model, n_train, sum(p.numel() for p in accelerator.unwrap_model(model).parameters()), cfg.train,
             total_steps, tokens_per_step, world, mp)

    def held_out() -> dict:
        """Perplexity on the held-out windows, split over the processes."""
        model.eval()
        mine = eval_windows[rank::world]  # [W_rank, T_eval]
        nll_sum = torch.zeros(2, dtype=torch.float64, device=device)
        if mine.shape[0]:
            with accelerator.autocast():
                r = evaluate.perplexity(model, mine.reshape(-1), cfg.eval_seq_len, mine.shape[0], progress=False)
            nll_sum += torch.tensor([r["nll"] * r["tokens"], r["tokens"]], dtype=torch.float64, device=device)
        nll_sum = accelerator.reduce(nll_sum, reduction="sum")
        model.train()
        nll = (nll_sum[0] / nll_sum[1]).item()
        return {"perplexity": math.exp(nll), "nll": nll, "eval_tokens": int(nll_sum[1].item())}

    def save_checkpoint(step: int, elapsed: float) -> Path:
        folder = out / f"step_{step}"
        if is_main and folder.exists():
            shutil.rmtree(folder)  # an incomplete leftover of a killed run
        accelerator.wait_for_everyone()
        state_dict = accelerator.get_state_dict(model)  # full state dict on the main process (FSDP gathers)
        if is_main:
            accelerator.unwrap_model(model).save_pretrained(folder, state_dict=state_dict)
            tokenizer.save_pretrained(folder)
        optim_state = optimizer_state() if fsdp or is_main else None  # FSDP: every process joins the gather
        save_trainer_state(folder / TRAINER_DIR, optim_state if is_main else None, scheduler, accelerator.scaler, rank)
        del optim_state
        accelerator.wait_for_everyone()
        if is_main:
            record = {"step": step, "total_steps": total_steps, "tokens": step * tokens_per_step,
                      "elapsed_s": elapsed, "world_size": world, "config": dataclasses.asdict(cfg)}
            (folder / STATE_FILE).write_text(json.dumps(record, indent=1) + "\n")  # last: marks it complete
            if cfg.keep_last_n:  # 0 keeps every checkpoint
                for _, old in complete_checkpoints(out)[: -cfg.keep_last_n]:
                    shutil.rmtree(old, ignore_errors=True)
        accelerator.wait_for_everyone()
        return folder

    before = None
    if resume_step == 0:
        before = held_out()
        metrics.write(event="eval", step=0, tokens=0, **before)
        log.info("step 0: held-out perplexity %.3f", before["perplexity"])
    else:
        evals = [r for r in metrics.read() if r.get("event") == "eval" and r["step"] == 0] if is_main else []
        before = evals[0] if evals else None

    elapsed = float(state.get("elapsed_s", 0.0))
    teacher_s = student_s = 0.0
    crash_after = int(os.environ.get(CRASH_ENV, "0") or 0)
    model.train()
    for step in range(resume_step, total_steps):
        t0 = time.perf_counter()
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, ce, kl over micro-batches
        for micro in range(cfg.grad_accum):
            ids = train_seqs[order.indices(step, micro, rank)].to(device)  # [B, T]
            sync = micro == cfg.grad_accum - 1
            with contextlib.nullcontext() if sync else accelerator.no_sync(model):
                kl = None
                if teacher is not None:
                    t1 = time.perf_counter()
                    with torch.no_grad():
                        teacher_logits = teacher(input_ids=ids, use_cache=False).logits  # [B, T, V]
                    teacher_s += time.perf_counter() - t1
                t1 = time.perf_counter()
                logits = model(input_ids=ids, use_cache=False).logits  # [B, T, V]
                ce = lm_loss(logits, ids)
                loss = ce
                if teacher is not None:
                    kl = kd_loss(logits, teacher_logits, cfg.kd_temperature)
                    loss = (1 - cfg.kd_weight) * ce + cfg.kd_weight * kl
                    del teacher_logits
                accelerator.backward(loss / cfg.grad_accum)
                student_s += time.perf_counter() - t1
            sums += torch.tensor([loss.item(), ce.item(), kl.item() if kl is not None else 0.0],
                                 dtype=torch.float64, device=device)
            del logits, loss
        grad_norm = None
        if cfg.max_grad_norm > 0:
            grad_norm = accelerator.clip_grad_norm_(params, cfg.max_grad_norm)
        lr = scheduler.get_last_lr()[0]
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        local = sums / cfg.grad_accum
        per_rank = accelerator.gather(local.unsqueeze(0)).cpu()  # [world, 3]
        elapsed += time.perf_counter() - t0
        done = step + 1
        if done % cfg.log_every == 0 or done == total_steps:
            mean = per_rank.mean(0)
            metrics.write(event="train", step=done, tokens=done * tokens_per_step, loss=mean[0].item(),
                          ce=mean[1].item(), kl=mean[2].item() if teacher is not None else None, lr=lr,
                          grad_norm=float(grad_norm) if grad_norm is not None else None, elapsed_s=round(elapsed, 3),
                          rank_losses=per_rank[:, 0].tolist())
            log.info("step %d/%d  loss %.4f  ce %.4f  lr %.2e  %.1fs", done, total_steps, mean[0], mean[1], lr, elapsed)
        if cfg.eval_every and done % cfg.eval_every == 0 and done != total_steps:
            r = held_out()
            metrics.write(event="eval", step=done, tokens=done * tokens_per_step, **r)
            log.info("step %d: held-out perplexity %.3f", done, r["perplexity"])
        if cfg.save_every and done % cfg.save_every == 0 and done != total_steps:
            save_checkpoint(done, elapsed)
        if crash_after and done == crash_after:
            accelerator.wait_for_everyone()
            log.warning("%s=%d: exiting as if killed", CRASH_ENV, crash_after)
            os._exit(17)

    after = held_out()
    metrics.write(event="eval", step=total_steps, tokens=total_steps * tokens_per_step, **after)
    log.info("final held-out perplexity %.3f", after["perplexity"])

    # Both ranks must hold the same weights: compare a checksum of the trained parameters.
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in params]  # FSDP2: gather the DTensor shards
    checksum = torch.tensor([sum(p.detach().double().sum().item() for p in full)], dtype=torch.float64, device=device)
    checksums = accelerator.gather(checksum).cpu().tolist()
    peak = accelerator.gather(torch.tensor([_peak_memory_bytes(device)], device=device)).cpu().tolist()
    timing = accelerator.gather(torch.tensor([[teacher_s, student_s]], dtype=torch.float64, device=device)).cpu()  # [world, 2]
    final = out / FINAL_DIR
    state_dict = accelerator.get_state_dict(model)
    if is_main:
        if final.exists():
            shutil.rmtree(final)
        accelerator.unwrap_model(model).save_pretrained(final, state_dict=state_dict)
        tokenizer.save_pretrained(final)
        records = metrics.read()
        plot(records, out / PLOT_FILE)
        shutil.copy(out / PLOT_FILE, final / PLOT_FILE)
        shutil.copy(out / METRICS_FILE, final / METRICS_FILE)
        train_records = [r for r in records if r.get("event") == "train"]
        parent = provenance.load(cfg.model) if Path(cfg.model).is_dir() else None
        measurement = {
            "steps": total_steps,
            "tokens": total_steps * tokens_per_step,
            "processes": world,
            "device": device.type,
            "mixed_precision": mp,
            "seconds": round(elapsed, 1),
            "teacher_forward_seconds_per_process": [round(float(t), 1) for t in timing[:, 0]] if teacher else None,
            "student_seconds_per_process": [round(float(t), 1) for t in timing[:, 1]],
            "peak_memory_bytes_per_process": peak,
            "trainable_parameters": n_train,
            "loss_first": train_records[0]["loss"] if train_records else None,
            "loss_last": train_records[-1]["loss"] if train_records else None,
            "held_out_perplexity_before": before["perplexity"] if before else None,
            "held_out_perplexity_after": after["perplexity"],
            "held_out_protocol": (f"{cfg.eval_windows} x {cfg.eval_seq_len}-token windows of "
                                  f"{cfg.eval_data or 'the held-out tail of ' + cfg.data}"),
            "parameter_checksums_per_process": checksums,
        }
        record = provenance.new(
            "finetune",
            source=(parent or {}).get("source") or {"model": cfg.model},
            method=f"fine-tune ({'distillation' if cfg.kd_weight == 1 else 'LM' if cfg.kd_weight == 0 else 'LM + distillation'}, train={cfg.train})",
            options={**dataclasses.asdict(cfg), "teacher_resolved": teacher_spec(cfg) if teacher else None},
            kv_cache=(parent or {}).get("kv_cache"),
            measurements={"finetune": measurement},
            seed=cfg.seed,
            parent=parent,
        )
        provenance.save(final, record)
        from mla_convert.card import write_model_card

        write_model_card(final)
        if len(set(checksums)) != 1:
            log.error("processes disagree on the trained weights: checksums %s", checksums)
    accelerator.wait_for_everyone()
    # Free the DDP wrapper while every process is still here: its Reducer holds the process group, and when it was
    # freed only on return, after end_training and after a peer had exited, ~ProcessGroupGloo hung (seen in the
    # 2-process test under load: rank 0 idle in the destructor, py-spy).
    del model, optimizer, state_dict
    accelerator.free_memory()
    gc.collect()
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return final


# ------------------------------------------------------------------------------------------------------ entry


def main(argv: list[str] | None = None) -> None:
    """`python -m mla_convert.finetune --config RECIPE [key=value ...]` (usually under `accelerate launch`)."""
    parser = argparse.ArgumentParser(prog="mla_convert.finetune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", "-c", required=True, help="recipe YAML file or shipped recipe name")
    parser.add_argument("-v", "--verbose", action="count", default=1)
    parser.add_argument("-q", "--quiet", action="store_true")
    parser.add_argument("overrides", nargs="*", help="finetune settings as key=value")
    args = parser.parse_args(argv)
    level = logging.WARNING if args.quiet else (logging.INFO if args.verbose <= 1 else logging.DEBUG)
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=level, format=f"[rank {rank}] %(message)s" if os.environ.get("WORLD_SIZE", "1") != "1"
                        else "%(message)s", stream=sys.stderr, force=True)
    for noisy in ("transformers", "accelerate", "datasets", "huggingface_hub", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    if rank != "0":
        logging.getLogger().setLevel(logging.WARNING)
    try:
        final = run(load_config(args.config, args.overrides))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if rank == "0":
        print(f"wrote {final}")


if __name__ == "__main__":
    main()
