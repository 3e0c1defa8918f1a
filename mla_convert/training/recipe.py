"""The fine-tuning recipe: the FinetuneConfig dataclass, its validation, YAML loading and key=value overrides,
and finding the shipped recipes."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

from mla_convert.dtypes import DTYPES
from mla_convert.errors import UserError


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
DATA_ORDER_FIELDS = ("data", "eval_data", "seq_len", "batch_size", "grad_accum", "seed", "eval_windows", "eval_seq_len",
                     "data_tokens", "sample_batch")  # sample_batch: data=self's text is keyed by it
# A number YAML 1.1 (PyYAML) reads as text: `3e-4` (no dot in the mantissa), `1e3`; typed() reads it as the number.
_NUMBER_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


@dataclasses.dataclass
class FinetuneConfig:
    """The settings of one fine-tuning run (the `finetune:` section of a recipe, plus key=value overrides)."""

    model: str  # student: a model folder or hub id that AutoModelForCausalLM loads (native MLA or any causal LM)
    output: str  # run folder (checkpoints, metrics, final/)
    # training text: local .txt/.jsonl file, datasets name[:config[:split]], self (chat answers sampled from the
    # teacher) or self-doc (one document sampled from the teacher per seq_len window)
    data: str
    teacher: str | None = "auto"  # "auto": the source named in the student's provenance; a folder/.gguf/hub id; none
    eval_data: str | None = None  # held-out text; None: the last eval_windows*eval_seq_len tokens of `data`
    seq_len: int = 512  # tokens per packed training sequence
    batch_size: int = 1  # sequences per micro-batch per process
    grad_accum: int = 1  # micro-batches per optimizer step
    max_steps: int | None = None  # optimizer steps; else derived from max_tokens; else one epoch
    max_tokens: int | None = None  # training-token budget over all processes (rounded down to whole steps)
    max_seconds: float | None = None  # training-time budget (the steps, not setup or evaluation): the run stops once
    # it is spent, and the schedule follows whichever of the step and time budgets is nearer its end
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
    keep_best: bool = False  # final/ holds the weights of the best held-out evaluation seen since the run (re)started
    save_every: int = 100  # optimizer steps between step_N checkpoints (0: none)
    keep_last_n: int = 2  # step_N folders kept (older ones deleted once a newer one is complete); 0 keeps all
    log_every: int = 1
    resume: bool = True  # continue from the latest complete step_N in `output`
    overwrite: bool = False  # delete an existing run folder this trainer wrote (never one holding other files)
    allow_test_split: bool = False  # allow training text whose file name says "test" (a result on it is not one)
    threads: int | None = None  # torch threads per process on CPU; default: cores / local processes
    data_tokens: int | None = None  # data=self: a pool of this many tokens sampled first and read again epoch after
    # epoch; unset (default): fresh text sampled as the steps read it, never read twice (max_seconds alone bounds it)
    sample_batch: int | None = None  # data=self: sequences sampled at once (default 64 on CPU, 256 on CUDA)
    report_data: str | None = None  # comma-separated texts also scored at every evaluation (reported, never trained on)
    report_windows: int = 16  # windows of report_seq_len tokens scored per report text
    report_seq_len: int = 2048
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
        for name in ("seq_len", "batch_size", "grad_accum", "eval_windows", "log_every", "report_windows"):
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
        if self.max_seconds is not None and not (math.isfinite(self.max_seconds) and self.max_seconds > 0):
            raise UserError(f"max_seconds must be a positive number of seconds, got {self.max_seconds}")
        cores = os.cpu_count() or 1
        if self.threads is not None and not 1 <= self.threads <= cores:
            raise UserError(f"threads must lie between 1 and this machine's {cores} cores, got {self.threads}")
        if not 0 <= self.seed < 2**32:
            raise UserError(f"seed must lie between 0 and 2**32 - 1, got {self.seed}")
        if self.eval_seq_len is not None and self.eval_seq_len < 2:
            raise UserError(f"eval_seq_len must be at least 2, got {self.eval_seq_len}")
        if self.data_tokens is not None and self.data_tokens < self.seq_len:
            raise UserError(f"data_tokens must be at least one sequence of seq_len={self.seq_len} tokens, "
                            f"got {self.data_tokens}")
        if self.sample_batch is not None and self.sample_batch < 1:
            raise UserError(f"sample_batch must be at least 1, got {self.sample_batch}")
        if self.report_seq_len < 2:
            raise UserError(f"report_seq_len must be at least 2, got {self.report_seq_len}")
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
            if f.name == "mixed_precision" and value is False:  # YAML reads the choice `no` (and off, false) as False
                value = "no"
            if (isinstance(value, str) and "str" not in kinds and {"int", "float"} & set(kinds)
                    and _NUMBER_TEXT.fullmatch(value.strip())):
                value = float(value)
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
                shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
                raise UserError(f"{f.name} must be {wanted}, got {shown}")
        return out


# An installed wheel carries recipes/ as data files: <prefix>/share/mla-convert/recipes (pyproject data-files).
INSTALLED_RECIPES = Path("share", "mla-convert", "recipes")


def shipped_recipes_dir(package: Path | None = None) -> Path | None:
    """The folder of shipped recipes: `recipes/` of a source checkout (editable install), else the copy an installed
    wheel puts under its installation prefix (venv, user or system scheme); None when neither exists.
    `package`: the mla_convert folder to start from (default: this one)."""
    import sysconfig

    package = Path(__file__).resolve().parent.parent if package is None else Path(package)
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


def _recipe_loader():
    import yaml

    class RecipeLoader(yaml.SafeLoader):
        """safe_load without aliases: a recipe never needs them, and nested ones expand exponentially (a 20-line
        "billion laughs" recipe would take gigabytes)."""

        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed in a recipe: write "
                                                  "the value out", mark)
            return super().compose_node(parent, index)

    return RecipeLoader


class _LazyLoader:  # yaml is imported when a recipe is read, not when this module is
    def __call__(self, stream):
        return _recipe_loader()(stream)


_RecipeLoader = _LazyLoader()


def read_recipe(path: str | os.PathLike) -> dict:
    """The recipe as a mapping (sections `convert`, `finetune`, `eval`, ...)."""
    import yaml

    path = resolve_recipe_path(path)
    try:
        recipe = yaml.load(path.read_text(encoding="utf-8"), Loader=_RecipeLoader)
    except OSError as e:
        raise UserError(f"cannot read {path} ({e.strerror or type(e).__name__}): check the file") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:  # ValueError: not UTF-8
        first = (str(e).splitlines() or [type(e).__name__])[0][:200]
        raise UserError(f"{path} is not valid UTF-8 YAML ({first}): fix the file") from None
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
        try:
            out[key] = yaml.safe_load(value) if value != "" else None
        except yaml.YAMLError as e:
            raise UserError(f"override {item!r}: the value is not a YAML scalar ({str(e).splitlines()[0]}): give a "
                            "number, true/false or quoted text") from None
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
