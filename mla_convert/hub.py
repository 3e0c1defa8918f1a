"""Model cards and pushing output folders to the Hugging Face Hub.

Three entry points:

- `write_model_card(folder)` renders README.md from the folder's `provenance.json` (convert, finetune or export, with
  the `parent` chain of earlier steps). Everything mla-convert generates sits between two HTML comment markers; a re-run
  replaces that block only, so text a user wrote above or below it survives, and so do front-matter keys we do not own.
- `verify_checkpoint(folder)` checks that a folder is a complete checkpoint (config, safetensors index and every shard it
  lists, readable shard headers, tokenizer, provenance) and raises `UserError` naming everything that is missing.
- `push(folder, repo_id, ...)` verifies the folder, refreshes the card with the repo id, creates the repo if needed and
  uploads the folder with `HfApi.upload_folder`. With `hf_xet` installed (the default) huggingface_hub streams the
  upload in batches and a re-run resumes it (committed files are skipped, uploaded chunks deduplicated); without it,
  LFS objects already on the Hub are skipped on a re-run. Every network or Hub failure becomes one `UserError` line.

The token comes from the `token` argument, else `HF_TOKEN`, else the stored login (`hf auth login`); it is passed to
huggingface_hub and never logged or put into a message. The endpoint is huggingface_hub's (`HF_ENDPOINT`), which is
how the tests point pushes at a local stand-in (tests/hub_standin.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import struct
from pathlib import Path

from mla_convert import provenance
from mla_convert.errors import UserError

log = logging.getLogger(__name__)

CARD_FILENAME = "README.md"
BEGIN_MARKER = "<!-- mla-convert:begin (generated from provenance.json; edits inside this block are replaced) -->"
END_MARKER = "<!-- mla-convert:end -->"
_BLOCK_RE = re.compile(r"<!-- mla-convert:begin[^>]*-->.*?<!-- mla-convert:end -->", re.S)

CARD_TAGS = ("mla", "mla-convert")
# Never uploaded: git and cache folders (huggingface_hub keeps its upload state in .cache/huggingface/), temporary
# files of an interrupted write.
IGNORE_PATTERNS = [".git", ".git/*", "**/.git/**", ".cache/*", "**/.cache/**", "*.tmp", "*.partial", "**/__pycache__/*"]
# Remote files that a push deletes when the folder no longer has them: stale shards of an earlier, differently
# sharded upload would otherwise stay in the repo next to the new index.
STALE_WEIGHT_PATTERNS = ["model*.safetensors", "model.safetensors.index.json"]
TOKENIZER_VOCAB_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
_SHARD_RE = re.compile(r"^model-\d+-of-\d+\.safetensors$")
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_STEP_TITLES = {"convert": "Conversion", "finetune": "Fine-tuning", "export": "Export"}
_NO_TOKEN = "no Hugging Face token found: run `hf auth login` or set HF_TOKEN to a token with write access"


# ----------------------------------------------------------------------------------------------------------- card


def _chain(record: dict) -> list[dict]:
    """The provenance records from the first step (the conversion) to `record`, root first."""
    steps = []
    seen = 0
    while isinstance(record, dict):
        steps.append(record)
        record = record.get("parent")
        seen += 1
        if seen > 64:  # a cycle cannot come out of json, but a hand-edited file could nest absurdly deep
            break
    return steps[::-1]


def _root_source(steps: list[dict]) -> dict:
    for step in steps:
        if isinstance(step.get("source"), dict):
            return step["source"]
    return {}


def _base_model(source: dict) -> str | None:
    """A Hub id for the card's `base_model`, or None when the source was a local folder or file."""
    for value in (source.get("base_model"), source.get("model")):
        if isinstance(value, str) and _HUB_ID_RE.match(value) and not Path(value).exists():
            return value
    return None


def _nearest(steps: list[dict], key: str) -> dict | None:
    """The value of `key` in the newest step that has it."""
    for step in reversed(steps):
        if isinstance(step.get(key), dict) and step[key]:
            return step[key]
    return None


def _measurements(steps: list[dict]) -> dict:
    """Measurements of all steps merged, newer steps winning; perplexity dicts are merged key by key."""
    merged: dict = {}
    for step in steps:
        for key, value in (step.get("measurements") or {}).items():
            if isinstance(value, dict) and isinstance(merged.get(key), dict):
                merged[key] = {**merged[key], **value}
            else:
                merged[key] = value
    return merged


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        if len(value) > 12:
            return "[" + ", ".join(_fmt(v) for v in value[:6]) + f", ... ({len(value)} values)]"
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, dict):
        return json.dumps(value, default=str)
    return str(value)


def _cell(value) -> str:
    return _fmt(value).replace("|", "\\|").replace("\n", " ")


def _read_config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _settings_section(steps: list[dict]) -> list[str]:
    lines = ["### Settings", ""]
    for step in steps:
        kind = step.get("kind", "?")
        lines.append(f"**{_STEP_TITLES.get(kind, kind)}**" + (f": {step['method']}" if step.get("method") else ""))
        lines.append("")
        plan = step.get("plan")
        if isinstance(plan, dict) and plan.get("ranks"):
            ranks = plan["ranks"]
            low, high = min(ranks), max(ranks)
            rank_text = str(low) if low == high else f"{low}..{high} (mean {sum(ranks) / len(ranks):.1f})"
            lines.append(f"Latent dims per layer (d_c): {rank_text}; shared RoPE key dims (d_r): "
                         f"{_fmt(plan.get('rope_dim'))}.")
            lines.append("")
        options = step.get("options")
        if isinstance(options, dict) and options:
            lines += ["| option | value |", "|---|---|"]
            lines += [f"| `{key}` | {_cell(value)} |" for key, value in options.items()]
            lines.append("")
        if step.get("seed") is not None and not (isinstance(options, dict) and "seed" in options):
            lines += [f"Seed: {step['seed']}.", ""]
    return lines


def _kv_section(kv: dict | None) -> list[str]:
    if not kv:
        return []
    before, after = kv.get("bytes_per_token_before"), kv.get("bytes_per_token_after")
    dtype = kv.get("dtype", "?")
    lines = ["### KV cache", "", f"| | elements per token per layer | bytes per token (all layers, {dtype}) |",
             "|---|---|---|",
             f"| source | {_cell(kv.get('elements_per_token_per_layer_before'))} | {_cell(before)} |",
             f"| this model | {_cell(kv.get('elements_per_token_per_layer_after'))} | {_cell(after)} |", ""]
    ratio = after / before if isinstance(before, (int, float)) and isinstance(after, (int, float)) and before else None
    ratio = ratio if ratio is not None else kv.get("ratio")
    if isinstance(ratio, (int, float)) and ratio > 0:
        lines += [f"Ratio after/before: {ratio:.4f} (the cache is {ratio:.1%} of the source's, "
                  f"{1 / ratio:.2f}x smaller).", ""]
    return lines


def _quality_section(measurements: dict) -> list[str]:
    if not measurements:
        return []
    lines = ["### Measured quality", ""]
    ppl = measurements.get("perplexity")
    if isinstance(ppl, dict):
        rows = [(label, ppl.get(key)) for key, label in
                (("source", "source model"), ("converted", "converted (no training)"), ("finetuned", "fine-tuned"))]
        rows = [(label, value) for label, value in rows if value is not None]
        if rows:
            lines += ["| model | perplexity |", "|---|---|"]
            lines += [f"| {label} | {_cell(value)} |" for label, value in rows]
            lines.append("")
            if ppl.get("protocol"):
                lines += [f"Perplexity protocol: {ppl['protocol']}.", ""]
    others = {k: v for k, v in measurements.items() if k != "perplexity"}
    if others:
        lines += [f"- `{key}`: {_cell(value)}" for key, value in others.items()]
        lines.append("")
    return lines if len(lines) > 2 else []


def _usage_section(kind: str, ref: str, config: dict) -> list[str]:
    if kind == "export":
        arch = (config.get("architectures") or ["DeepseekV3ForCausalLM"])[0]
        return [
            "### How to load", "",
            f"Stock format (`model_type: {config.get('model_type', 'deepseek_v3')}`, `{arch}`): no extra package, no "
            "`trust_remote_code`.", "",
            "```python",
            "from transformers import AutoModelForCausalLM, AutoTokenizer",
            "",
            f'model = AutoModelForCausalLM.from_pretrained("{ref}", dtype="auto")',
            f'tokenizer = AutoTokenizer.from_pretrained("{ref}")',
            "```", "",
            "Serve it with vLLM's MLA kernels:", "",
            "```bash",
            f"vllm serve {ref}",
            "```", "",
        ]
    return [
        "### How to load", "",
        "Native MLA format (`model_type: mla`): needs the `mla-convert` package; importing it registers the model "
        "with the transformers Auto classes (no `trust_remote_code`).", "",
        "```python",
        "import mla_convert  # registers model_type \"mla\"",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        f'model = AutoModelForCausalLM.from_pretrained("{ref}", dtype="auto")',
        f'tokenizer = AutoTokenizer.from_pretrained("{ref}")',
        "```", "",
        "The KV cache holds the latent and the shared RoPE key per layer and token; decoding uses absorbed weights.",
        "For engines with MLA kernels (vLLM, SGLang), export it with `mla-convert export` to the stock DeepSeek-V3 "
        "format.", "",
    ]


def _versions_section(steps: list[dict]) -> list[str]:
    lines = ["### Framework versions", ""]
    for step in steps:
        versions = dict(step.get("versions") or {})
        if step.get("mla_convert_version") and "mla-convert" not in versions:
            versions["mla-convert"] = step["mla_convert_version"]
        if versions:
            text = ", ".join(f"{name} {ver}" for name, ver in versions.items())
            lines.append(f"- {_STEP_TITLES.get(step.get('kind'), step.get('kind'))}: {text}")
    lines.append("")
    return lines if len(lines) > 3 else []


def _commands_section(steps: list[dict]) -> list[str]:
    commands = [(step.get("kind", "?"), step.get("created"), step.get("command")) for step in steps]
    commands = [c for c in commands if c[2]]
    if not commands:
        return []
    lines = ["### Reproduce", "", "The exact commands that produced this folder, in order:", "", "```bash"]
    for kind, created, command in commands:
        lines.append(f"# {kind}" + (f" ({created})" if created else ""))
        lines.append(command)
    lines += ["```", ""]
    return lines


def _render_block(folder: Path, record: dict, repo_id: str | None) -> str:
    steps = _chain(record)
    kind = record.get("kind", "convert")
    source = _root_source(steps)
    base = _base_model(source)
    source_name = base or source.get("model") or "the source model"
    source_link = f"[`{base}`](https://huggingface.co/{base})" if base else f"`{source_name}`"
    family = source.get("family") or source.get("model_type")
    version = record.get("mla_convert_version", "?")
    chain_text = " -> ".join(_STEP_TITLES.get(s.get("kind"), str(s.get("kind"))).lower() for s in steps)
    intro = (f"This model is {source_link}{f' ({family})' if family else ''} with its attention converted to "
             f"Multi-head Latent Attention (MLA) by mla-convert {version}. Steps: {chain_text}.")
    if kind == "export":
        intro += " This folder is the export to the stock DeepSeek-V3 format."
    ref = repo_id or str(folder)
    lines = [BEGIN_MARKER, "", "## About this model", "", intro, ""]
    lines += _settings_section(steps)
    lines += _kv_section(_nearest(steps, "kv_cache"))
    lines += _quality_section(_measurements(steps))
    lines += _usage_section(kind, ref, _read_config(folder))
    lines += _versions_section(steps)
    lines += _commands_section(steps)
    lines.append(END_MARKER)
    return "\n".join(lines)


def render_model_card(folder: str | os.PathLike, repo_id: str | None = None) -> str:
    """The README.md that `write_model_card` would write (the folder is not touched).

    `repo_id` is used in the loading examples; without it they name the folder path.
    """
    from huggingface_hub import ModelCard

    folder = Path(folder)
    record = provenance.load(folder)
    if record is None:
        raise UserError(f"{folder} has no {provenance.FILENAME}: point at a folder written by mla-convert "
                        "(convert, finetune or export)")
    steps = _chain(record)
    source = _root_source(steps)
    path = folder / CARD_FILENAME
    existing = path.read_text(encoding="utf-8") if path.is_file() else ""
    try:
        card = ModelCard(existing or "---\nlibrary_name: transformers\n---\n")
    except ValueError as e:
        raise UserError(f"{path} has front matter that is not valid YAML ({e}): fix it or delete the file") from None

    data = card.data
    base = _base_model(source)
    if base:
        data.base_model = base
    data.library_name = "transformers"
    data.pipeline_tag = data.pipeline_tag or "text-generation"
    tags = list(data.tags or [])
    data.tags = tags + [t for t in CARD_TAGS if t not in tags]
    if source.get("license") and not data.license:
        data.license = source["license"]

    block = _render_block(folder, record, repo_id)
    text = card.text
    if _BLOCK_RE.search(text):
        text = _BLOCK_RE.sub(lambda _: block, text, count=1)
    elif text.strip():
        text = text.rstrip() + "\n\n" + block + "\n"
    else:
        title = (repo_id or folder.resolve().name).split("/")[-1]
        text = f"\n# {title}\n\n{block}\n"
    card.text = text
    return card.content


def write_model_card(folder: str | os.PathLike, repo_id: str | None = None) -> Path:
    """Write or update `folder/README.md` from `folder/provenance.json`; returns the card's path.

    Front matter: `base_model` (when the source is a Hub id), `library_name: transformers`,
    `pipeline_tag: text-generation` (unless set), tags `mla` and `mla-convert` added to existing ones, the source's
    license (unless set). Body: everything generated lies between `BEGIN_MARKER` and `END_MARKER`; an existing card
    keeps all text outside that block (a card without the block gets it appended). Raises `UserError` when the folder
    has no provenance or the existing card's front matter is not valid YAML.
    """
    folder = Path(folder)
    content = render_model_card(folder, repo_id)
    path = folder / CARD_FILENAME
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(content, encoding="utf-8")
    os.replace(tmp, path)
    log.info("wrote model card %s", path)
    return path


# ----------------------------------------------------------------------------------------------------------- verify


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
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            broken.append("model.safetensors.index.json (no weight_map)")
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


# ----------------------------------------------------------------------------------------------------------- push


@dataclasses.dataclass
class PushResult:
    repo_id: str
    files: list[tuple[str, int]]  # (path in repo, bytes), sorted
    dry_run: bool
    revision: str
    private: bool
    created: bool | None = None  # None: not known (dry run)
    commit_oid: str | None = None
    commit_url: str | None = None

    @property
    def total_bytes(self) -> int:
        return sum(size for _, size in self.files)


def upload_files(folder: str | os.PathLike) -> list[tuple[str, int]]:
    """The files a push uploads: (path relative to the folder, bytes), with the same filters as the upload."""
    from huggingface_hub.utils import filter_repo_objects

    folder = Path(folder).resolve()
    paths = {p.relative_to(folder).as_posix(): p for p in sorted(folder.glob("**/*")) if p.is_file()}
    kept = filter_repo_objects(paths.keys(), ignore_patterns=IGNORE_PATTERNS)
    return [(rel, paths[rel].stat().st_size) for rel in kept]


def _hub_message(err) -> str:
    """The server's own words from an HfHubHTTPError, one line."""
    server = getattr(err, "server_message", None)
    text = server or str(err)
    return " ".join(text.split())[:300]


def _translate(err: Exception, repo_id: str, endpoint: str, what: str) -> UserError:
    """One clear line for a failure talking to the Hub (never containing the token)."""
    from huggingface_hub.errors import (
        HfHubHTTPError,
        HFValidationError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(err, HFValidationError):
        return UserError(f"invalid repo id {repo_id!r}: use NAMESPACE/NAME, e.g. my-user/my-model-mla")
    if isinstance(err, OfflineModeIsEnabled):
        return UserError("HF_HUB_OFFLINE is set: unset it to push to the Hub")
    if isinstance(err, HfHubHTTPError):
        status = err.response.status_code if err.response is not None else None
        if status == 401:
            return UserError(f"the Hub at {endpoint} rejected the token (401 Unauthorized) while {what}: run "
                             "`hf auth login` or set HF_TOKEN to a valid token with write access")
        if status == 403:
            return UserError(f"no write access to {repo_id} (403 Forbidden) while {what}: check the namespace and "
                             "that the token has write permission")
        if isinstance(err, RevisionNotFoundError):
            return UserError(f"revision not found in {repo_id} while {what}: check --revision")
        if isinstance(err, RepositoryNotFoundError):
            return UserError(f"repository {repo_id} not found while {what} (or the token cannot see it)")
        return UserError(f"the Hub answered {status} while {what}: {_hub_message(err)}; re-run the same command to "
                         "resume the upload")
    return UserError(f"cannot reach the Hub at {endpoint} while {what} ({err.__class__.__name__}): check the network "
                     "connection or HF_ENDPOINT, then re-run the same command to resume")


def _network_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx", "requests"):  # whichever HTTP client this huggingface_hub version uses
        try:
            mod = __import__(module)
        except ImportError:
            continue
        for name in ("TransportError", "ConnectionError", "Timeout"):
            cls = getattr(mod, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                errors.append(cls)
    return tuple(errors)


def push(
    folder: str | os.PathLike,
    repo_id: str,
    private: bool = False,
    revision: str | None = None,
    commit_message: str | None = None,
    dry_run: bool = False,
    token: str | None = None,
) -> PushResult:
    """Upload a verified output folder to the Hub model repo `repo_id`; returns what was (or would be) uploaded.

    Order: verify the folder (`UserError` if incomplete) -> list the files -> (dry run: stop; nothing written, no
    network, no token needed) -> token (argument, HF_TOKEN, stored login; `UserError` if none) -> refresh the model
    card with `repo_id` -> create the repo (`private` applies only to a new repo; an existing one is updated) ->
    create branch `revision` if it is not main -> upload the folder as one logical commit (huggingface_hub may split a
    very large folder into several) deleting remote weight files the folder no longer has. A re-run of an interrupted
    push resumes it. Network and Hub errors raise `UserError` with one line.
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, OfflineModeIsEnabled
    from huggingface_hub.utils import get_token, validate_repo_id

    folder = Path(folder)
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise _translate(e, repo_id, "", "checking the repo id") from None
    if "/" not in repo_id:
        raise UserError(f"repo id {repo_id!r} has no namespace: use NAMESPACE/NAME, e.g. my-user/{repo_id}")
    branch = revision or constants.DEFAULT_REVISION

    verify_checkpoint(folder)
    files = upload_files(folder)
    if not (folder / CARD_FILENAME).is_file():  # the card is written just before the upload
        files = sorted(files + [(CARD_FILENAME, len(render_model_card(folder, repo_id).encode()))])
    result = PushResult(repo_id=repo_id, files=files, dry_run=dry_run, revision=branch, private=private)
    if dry_run:
        return result

    token = token or get_token()
    if not token:
        raise UserError(_NO_TOKEN)
    write_model_card(folder, repo_id=repo_id)
    result.files = upload_files(folder)

    api = HfApi(token=token)
    endpoint = api.endpoint
    network = _network_errors()
    what = "creating the repo"
    try:
        try:
            api.create_repo(repo_id, private=private or None, repo_type="model", exist_ok=False)
            result.created = True
            log.info("created %s%s", repo_id, " (private)" if private else "")
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else None
            if status == 409:
                result.created = False
            elif status == 403:  # a token without the create scope may still write to an existing repo
                what = "checking the existing repo"
                api.repo_info(repo_id, repo_type="model")
                result.created = False
            else:
                raise
            log.info("%s exists: updating it%s", repo_id,
                     " (--private does not change an existing repo's visibility)" if private else "")
        if branch != constants.DEFAULT_REVISION:
            what = f"creating branch {branch}"
            api.create_branch(repo_id, branch=branch, repo_type="model", exist_ok=True)
        what = "uploading"
        message = commit_message or f"Upload MLA model ({(provenance.load(folder) or {}).get('kind', 'convert')}) " \
                                    "with mla-convert"
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=folder,
            repo_type="model",
            revision=branch,
            commit_message=message,
            ignore_patterns=list(IGNORE_PATTERNS),
            delete_patterns=list(STALE_WEIGHT_PATTERNS),
        )
    except Exception as e:
        # huggingface_hub sometimes wraps the HTTP error (e.g. "Error while uploading 'x' to the Hub."): look through
        # the chain of causes for the one to explain.
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, (HfHubHTTPError, HFValidationError, OfflineModeIsEnabled,
                                                           *network)):
            cause = cause.__cause__ or cause.__context__
        if cause is None:
            raise
        raise _translate(cause, repo_id, endpoint, what) from None
    result.commit_oid = getattr(info, "oid", None)
    result.commit_url = getattr(info, "commit_url", None)
    log.info("pushed %d files (%d bytes) to %s", len(result.files), result.total_bytes, repo_id)
    return result


__all__ = ["PushResult", "push", "render_model_card", "upload_files", "verify_checkpoint", "write_model_card"]
