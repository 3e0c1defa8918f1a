"""Evaluation: perplexity over fixed non-overlapping windows, and the KV-cache bytes per token a model really stores.

Works on source models (HF folders, GGUF, the embedded default) and converted MLA folders alike.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from safetensors import SafetensorError

from mla_convert.data import tokenize  # noqa: F401  (evaluate.tokenize: the eval CLI and scripts tokenize here)
from mla_convert.dtypes import DTYPES
from mla_convert.errors import UserError

log = logging.getLogger(__name__)

def check_device(device: str) -> str:
    """`device` if this torch can use it (cpu, cuda, cuda:N, mps), else a UserError that names the fix."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {device} is not a device: use cpu, cuda or cuda:N") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"--device {device} but this torch has no CUDA device: use --device cpu")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise UserError(f"--device {device} but only {torch.cuda.device_count()} CUDA device(s) exist: "
                            "use cuda:0 .. cuda:N-1")
    elif parsed.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {device} but MPS is not available: use --device cpu")
    elif parsed.type not in ("cpu", "cuda", "mps"):
        raise UserError(f"--device {device} is not supported: use cpu, cuda or cuda:N")
    return device


RESULTS_BY = "mla-convert eval"  # the "written_by" of an `eval --json` file: what `--overwrite` may replace
RESULTS_KEYS = {"perplexity", "windows", "model", "data", "dtype"}  # what every eval --json file has held


def _is_results_file(path: Path) -> bool:
    """Whether `path` holds a results file that `eval --json` wrote (marked, or from before the mark: eval's keys)."""
    import json

    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and (record.get("written_by") == RESULTS_BY or RESULTS_KEYS <= record.keys())


def check_results_file(path: Path, overwrite: bool) -> None:
    """Refuse, before any work, a `--json` path that cannot be written or that holds what `eval` must not replace: a
    folder, a path under a file, an existing file (without `overwrite`, or one that eval did not write)."""
    import tempfile

    from mla_convert.outputs import check_location, nearest_existing

    if path.is_dir():
        raise UserError(f"--json {path} is a folder: give a file name, e.g. {path / 'eval.json'}")
    parent = nearest_existing(check_location(path, [], "--json out/eval.json").parent)  # a folder: checked there
    try:  # a folder that takes no files (read-only, /proc) fails now, not after the evaluation
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise UserError(f"--json {path}: cannot write in {parent} ({e.strerror or type(e).__name__}): choose "
                        "another path") from None
    if path.exists():
        if not overwrite:
            raise UserError(f"--json {path} already exists: pass --overwrite to replace it, or choose another file")
        if not _is_results_file(path):
            raise UserError(f"--json {path} is not a results file that mla-convert eval wrote, so --overwrite will "
                            "not replace it: choose another file")


def write_results_file(path: Path, result: dict, overwrite: bool) -> None:
    """`result` as JSON at `path`, written whole or not at all; the path is checked again (`check_results_file`)
    right before it is replaced: a file put there during the evaluation is refused too."""
    import json
    import os
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise UserError(f"--json {path}: cannot write there ({e.strerror or type(e).__name__})") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps({**result, "written_by": RESULTS_BY}, indent=2) + "\n")
        check_results_file(path, overwrite)
        os.replace(tmp, path)
    except OSError as e:
        raise UserError(f"--json {path}: cannot write there ({e.strerror or type(e).__name__})") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cannot_load(path: Path, e: Exception, gguf: bool) -> UserError:
    first = (str(e).splitlines() or [""])[0][:200]
    return UserError(f"cannot load {path} ({type(e).__name__}: {first}): re-copy or re-create the "
                     f"{'file' if gguf else 'folder'}")


def _mismatched(folder: Path, kwargs: dict) -> UserError:
    """The one line for a folder whose tensors do not have the shapes its config.json gives (transformers names them
    only in its log): loaded once more, leniently, to learn which."""
    from transformers import AutoModelForCausalLM

    try:
        _, info = AutoModelForCausalLM.from_pretrained(folder, ignore_mismatched_sizes=True, output_loading_info=True,
                                                       **kwargs)
        wrong = sorted(info.get("mismatched_keys") or [])
    except Exception:  # the lenient load fails too: the folder is named without the tensor
        wrong = []
    what = "a tensor does not have the shape config.json gives"
    if wrong:
        name, found, wanted = wrong[0]
        more = f" (and {len(wrong) - 1} more)" if len(wrong) > 1 else ""
        what = f"tensor {name} has shape {list(found)}, config.json gives {list(wanted)}{more}"
    return UserError(f"cannot load {folder}: {what}: the weights and config.json do not belong together; re-copy or "
                     "re-create the folder")


def check_generation_config(net, label: str) -> None:
    """Refuse, in one line, sampling settings of a model's generation_config.json that generate would trip over."""
    config = getattr(net, "generation_config", None)
    if config is None:
        return

    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    rules = {
        "temperature": (lambda v: number(v) and v > 0, "a positive number"),
        "top_k": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0, "a whole number >= 0"),
        "top_p": (lambda v: number(v) and 0 < v <= 1, "a number in (0, 1]"),
        "min_p": (lambda v: number(v) and 0 <= v <= 1, "a number in [0, 1]"),
        "typical_p": (lambda v: number(v) and 0 < v <= 1, "a number in (0, 1]"),
        "repetition_penalty": (lambda v: number(v) and v > 0, "a positive number"),
        "max_length": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number >= 1"),
        "num_beams": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1, "a whole number >= 1"),
    }
    for key, (ok, wanted) in rules.items():
        value = getattr(config, key, None)
        if value is not None and not ok(value):
            raise UserError(f"{key} in the generation_config.json of {label} must be {wanted}, got {value!r:.60}: "
                            "fix or remove it")
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(config, key, None)
        values = value if isinstance(value, list) else [value]
        if value is not None and not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise UserError(f"{key} in the generation_config.json of {label} must be a token id (or a list of "
                            f"them), got {value!r:.60}: fix or remove it")


def check_loadable_folder(folder: Path) -> None:
    """Refuse, in one line, a model folder that transformers would load through pickle or custom code: weights only
    as pytorch_model.bin / *.pt, an index naming shards outside the folder, or a config asking for custom code."""
    import json

    from mla_convert.sources import INDEX_NAME, read_weight_map, safetensors_files

    if (folder / INDEX_NAME).is_file():
        shards = sorted(set(read_weight_map(folder / INDEX_NAME).values()))
        odd = [name for name in shards if not (folder / name).is_file()]
        if odd:
            raise UserError(f"shard {odd[0]} named in {folder / INDEX_NAME} is missing or not a regular file (a pipe "
                            "or a device?): re-download the checkpoint")
    elif not safetensors_files(folder):
        pickles = sorted(p.name for p in (*folder.glob("*.bin"), *folder.glob("*.pt"), *folder.glob("*.pth")))
        hint = f" (found {pickles[0]}: pickle files are never loaded, they can run code)" if pickles else ""
        raise UserError(f"{folder} has no *.safetensors weights{hint}: convert the weights to safetensors")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (ValueError, RecursionError) as e:
        raise UserError(f"cannot read {folder / 'config.json'} ({type(e).__name__}): fix the file") from None
    if isinstance(config, dict) and config.get("auto_map") and config.get("model_type") not in _KNOWN_MODEL_TYPES:
        raise UserError(f"{folder / 'config.json'} asks for custom code (auto_map, model_type "
                        f"{config.get('model_type')!r}); custom code from a checkpoint is never run: use a model "
                        "transformers supports")


# the model types load_model reads with stock (or mla_convert's registered) classes
_KNOWN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "olmo2", "gemma", "gemma2", "deepseek_v3", "mla")


def load_model(spec: str | None, dtype: str = "float32", device: str = "cpu"):
    """(model, tokenizer, label) for MODEL: None (embedded default), a .gguf file, or a model folder.

    Folders load with AutoModelForCausalLM (mla_convert registers the MLA model); never with trust_remote_code.
    """
    import mla_convert  # noqa: F401  (registers the MLA model with the Auto classes)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mla_convert.sources import default_model_path

    if dtype not in DTYPES:
        raise UserError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    check_device(device)
    path = default_model_path() if spec is None else Path(spec).expanduser()
    if not path.exists():
        raise UserError(f"{path} does not exist: pass a model folder or a .gguf file")
    kwargs = {"dtype": DTYPES[dtype], "trust_remote_code": False}
    if path.suffix == ".gguf":
        folder, kwargs["gguf_file"] = path.parent, path.name
    else:
        folder = path
        if not (folder / "config.json").is_file():
            raise UserError(f"{folder} has no config.json: pass a model folder or a .gguf file")
        check_loadable_folder(folder)
        kwargs["use_safetensors"] = True  # never torch.load: a pickle can run code
    # the folder's own damage is the user's to fix; a GGUF or tokenizer file is parsed by code that raises many types
    gguf = "gguf_file" in kwargs
    broken = Exception if gguf else (OSError, ValueError, KeyError, SafetensorError)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    except broken as e:
        raise _cannot_load(path, e, gguf) from None
    except RuntimeError as e:  # transformers refuses a tensor whose shape is not the config's
        if "ignore_mismatched_sizes" not in str(e):
            raise
        raise _mismatched(folder, kwargs) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=False,
                                                  **({"gguf_file": kwargs["gguf_file"]} if gguf else {}))
    except Exception as e:
        raise _cannot_load(path, e, gguf) from None
    check_weights_finite(model, str(path))
    # the embedded default by its package's name, not by where this machine installed it (results files travel)
    label = f"{path.parent.name}/{path.name}" if spec is None else str(path)
    return model.to(device).eval(), tokenizer, label


def check_weights_finite(model, where: str) -> None:
    """Refuse a loaded model with a NaN or infinite weight: its logits would be NaN and its perplexity print as nan."""
    from mla_convert.validate import check_finite_tensors

    check_finite_tensors(model.state_dict().items(), where, "the checkpoint is damaged; convert (or fine-tune) it "
                         "again, or use a healthy copy")


def eval_windows(ids: torch.Tensor, seq_len: int, windows: int) -> torch.Tensor:
    """The first `windows` non-overlapping windows of `seq_len` tokens of `ids` [N] -> [W, seq_len] (fewer, with a
    warning, when the text is shorter); the evaluation protocol of every engine (`mla-convert eval --engine`)."""
    if seq_len < 2:
        raise UserError("--seq-len must be at least 2")
    if windows < 1:
        raise UserError(f"--windows must be at least 1, got {windows}")
    available = ids.numel() // seq_len
    if available == 0:
        raise UserError(f"the text has {ids.numel()} tokens, fewer than one window of --seq-len {seq_len}")
    if windows > available:
        log.warning("the text holds %d windows of %d tokens; evaluating %d, not %d", available, seq_len, available, windows)
        windows = available
    return ids[: windows * seq_len].view(windows, seq_len)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int = 2048, windows: int = 16, progress: bool = True) -> dict:
    """Perplexity over the first `windows` non-overlapping windows of `seq_len` tokens of `ids` [N].

    Each window is scored on its own (no context carried across windows): nll averaged over windows*(seq_len-1)
    predicted tokens. Returns {"perplexity", "nll", "tokens", "windows", "seq_len"}.
    """
    from tqdm.auto import tqdm

    chunks = eval_windows(ids, seq_len, windows)  # [W, T]
    windows = chunks.shape[0]
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for w in tqdm(range(windows), desc="eval windows", disable=not progress, unit="window"):
        chunk = chunks[w : w + 1].to(device)
        logits = model(input_ids=chunk, use_cache=False).logits[0, :-1].float()  # [T-1, V]
        total += torch.nn.functional.cross_entropy(logits, chunk[0, 1:], reduction="sum").item()
        count += seq_len - 1
    nll = total / count
    if not math.isfinite(nll):  # the weights are finite (load_model checks them): the activations overflowed
        raise UserError("the model's logits are NaN or infinite on this text, although its weights are finite: the "
                        "activations overflow in this dtype; evaluate with --dtype float32")
    return {"perplexity": math.exp(nll), "nll": nll, "tokens": count, "windows": windows, "seq_len": seq_len}


@torch.no_grad()
def kv_cache_bytes_per_token(model, tokens: int = 8) -> int:
    """Bytes the model's KV cache really holds per token (all layers), measured on a short forward."""
    from mla_convert.modeling.compat import output_cache

    device = next(model.parameters()).device
    ids = torch.full((1, tokens), 1, dtype=torch.long, device=device)
    cache = output_cache(model(input_ids=ids, use_cache=True))
    return cache_bytes(cache) // tokens


def read_cache_as_served(model, kind: str | None) -> tuple[str | None, float | None]:
    """`use_cache_type` for `--cache-type` where given, else for the type a converted model's config says its latent
    is served in (`latent_cache_type`, written by a conversion with --cache-type or --kv-bytes). -> (the type, its bytes
    per token), (None, None) where neither names one (the model's own dtype)."""
    kind = kind if kind is not None else getattr(model.config, "latent_cache_type", None)
    return kind, (use_cache_type(model, kind) if kind is not None else None)


def holds_cache_type(model) -> bool:
    """Whether `model`'s dynamic cache really holds its rows in the cache type it reads them as: a converted model's
    latent cache type does (`TypedLatentLayer`: ggml's block bytes); a source's quantized cache is simulated (the
    values it reads back, in the model's dtype)."""
    from mla_convert.modeling.latent_cache import held_type

    return model.config.model_type == "mla" and held_type(model.config) is not None


def use_cache_type(model, kind: str) -> float:
    """Make `model` read its KV cache as llama.cpp's cache type `kind` stores it (mla_convert.kvquant): a converted
    model's cached row [latent, rope key], a source's keys and values (with llama.cpp's Hadamard rotation). -> the
    bytes per token (all layers) that cache type stores. A row the type cannot hold is a UserError."""
    from mla_convert import kvquant

    config = model.config
    if kind not in kvquant.CACHE_TYPES:
        raise UserError(f"--cache-type must be one of {', '.join(kvquant.CACHE_TYPES)}, got {kind}")
    if config.model_type == "mla":
        padded = [r for r in config.kv_lora_ranks if kvquant.latent_padding(r, config.qk_rope_head_dim, kind)]
        if padded:
            log.warning("%d layers cache rows that are not whole %s blocks: their latent is zero-padded (exact), and "
                        "the bytes count the padding", len(padded), kind)
        config.latent_cache_type = None if kind == "f32" else kind
        return sum(kvquant.latent_row_bytes(r, config.qk_rope_head_dim, kind) for r in config.kv_lora_ranks)
    if getattr(config, "num_key_value_heads", None) is None or getattr(config, "head_dim", None) is None:
        raise UserError(f"--cache-type needs a Llama-style source (num_key_value_heads, head_dim); "
                        f"{config.model_type} has none: drop --cache-type")
    row = 2 * config.num_key_value_heads * config.head_dim
    if kvquant.cache_type(kind).levels and config.head_dim % kvquant.BLOCK:
        raise UserError(f"--cache-type {kind} needs heads of a multiple of {kvquant.BLOCK} values, not "
                        f"{config.head_dim}: use f16")
    kvquant.read_source_cache_as(model, kind)
    return config.num_hidden_layers * kvquant.row_bytes(row, kind)


def cache_bytes(cache) -> int:
    """Bytes the key and value tensors of a transformers cache hold, all layers (0 for no cache)."""
    return tensor_bytes(t for layer in getattr(cache, "layers", []) for t in (layer.keys, layer.values))


def tensor_bytes(tensors) -> int:
    """Bytes the tensors hold (None entries skipped): the one count behind every measured KV-cache figure."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
