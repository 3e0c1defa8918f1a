"""The model card: README.md of an output folder, rendered from its `provenance.json`.

`write_model_card(folder)` renders README.md from the folder's `provenance.json` (convert, finetune or export, with the
`parent` chain of earlier steps): the source, the settings of every step, the KV cache before and after, the measured
quality, how to load and serve the model, framework versions and the exact commands. Everything mla-convert generates
sits between two HTML comment markers; a re-run replaces that block only, so text a user wrote above or below it
survives, and so do front-matter keys we do not own. The block starts with a title unless the user's text has one.
`render_model_card(folder, repo_id)` returns the same text without writing it (hub.push sizes the upload with it).
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path

from mla_convert import provenance
from mla_convert.dtypes import dtype_bytes
from mla_convert.errors import UserError
from mla_convert.writes import write_text_whole

log = logging.getLogger(__name__)

CARD_FILENAME = "README.md"
BEGIN_MARKER = "<!-- mla-convert:begin (generated from provenance.json; edits inside this block are replaced) -->"
END_MARKER = "<!-- mla-convert:end -->"
_FENCE_RE = re.compile(r"^```.*?^```", re.S | re.M)
_BLOCK_RE = re.compile(r"<!-- mla-convert:begin[^>]*-->.*?<!-- mla-convert:end -->", re.S)

CARD_TAGS = ("mla", "mla-convert")
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_CACHE_RE = re.compile(r"(?:^|/)models--([A-Za-z0-9][\w.-]*?)--([\w.-]+)/snapshots/[^/]+/?$")
_STAGING_RE = re.compile(r"^\.(.+)\.incomplete(-[^/]+)?$")
_IN_PLACE_RE = re.compile(r"^\.mla-convert-staging(-[^/]+)?$")  # outputs.IN_PLACE_STAGE: inside the output itself
_STEP_TITLES = {"convert": "Conversion", "finetune": "Fine-tuning", "export": "Export", "basis": "Latent basis"}


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
    """A Hub id for the card's `base_model`, or None when the source was a local folder or file that did not come
    from the Hub cache (a snapshot folder `.../models--ORG--NAME/snapshots/SHA` names its repo)."""
    for value in (source.get("base_model"), source.get("model")):
        if isinstance(value, str) and _HUB_ID_RE.match(value) and not Path(value).exists():
            return value
    cached = _HUB_CACHE_RE.search(str(source.get("model") or "").replace(os.sep, "/"))
    return f"{cached.group(1)}/{cached.group(2)}" if cached else None


def _display_folder(folder: Path) -> Path:
    """Where the folder will live: convert and export write the card inside their hidden staging folder
    (`.NAME.incomplete-XXXX`, or `.NAME.incomplete` for a resumable conversion, beside the output, see
    outputs.staged_output) before moving it to NAME; into a mount point NAME, inside it (`.mla-convert-staging`)."""
    folder = folder.resolve()
    if _IN_PLACE_RE.match(folder.name):
        return folder.parent
    staged = _STAGING_RE.match(folder.name)
    return folder.parent / staged.group(1) if staged else folder


def _title(folder: Path, repo_id: str | None) -> str:
    if repo_id:
        return repo_id.split("/")[-1]
    shown = _display_folder(folder)
    # finetune writes OUT/final: the run's folder names the model better
    return shown.parent.name if shown.name == "final" and shown.parent.name else shown.name


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
                         f"{_fmt(plan.get('rope_dims', plan.get('rope_dim')))}"  # rope_dim: older folders
                         + (f"; nope query/key dims per head (d_n): {plan['nope_dims']}"
                            if plan.get("nope_dims") else "")
                         + ".")
            lines.append("")
            lines += _refine_lines(plan.get("refine"))
            lines += _model_stage_lines(plan.get("refine_model"))
        options = step.get("options")
        if isinstance(options, dict) and options:
            lines += ["| option | value |", "|---|---|"]
            lines += [f"| `{key}` | {_cell(value)} |" for key, value in options.items()]
            lines.append("")
        if step.get("seed") is not None and not (isinstance(options, dict) and "seed" in options):
            lines += [f"Seed: {step['seed']}.", ""]
    return lines


def _refine_lines(record) -> list[str]:
    """The refinement's effect (mla_convert.conversion.refine_layer): held-out attention-output error, mean over layers."""
    if not isinstance(record, list) or not record:
        return []
    before = sum(r["before"] for r in record) / len(record)
    after = sum(r["after"] if r["kept"] else r["before"] for r in record) / len(record)
    kept = sum(bool(r["kept"]) for r in record)
    return [f"Refinement: {kept} of {len(record)} layers improved; relative error of the attention outputs on a "
            f"held-out calibration sequence, mean over layers, {before:.4g} -> {after:.4g}.", ""]


def _model_stage_lines(record) -> list[str]:
    """The model stage's effect (mla_convert.conversion.model_stage): held-out KL to the source, per token."""
    if not isinstance(record, dict) or "before" not in record:
        return []
    at = f", the weights after step {record['step']}" if record.get("step") else ""
    outcome = (f"{record['before']:.4g} -> {record['after']:.4g} (kept{at})" if record.get("kept") else
               f"{record['before']:.4g}, not improved: the stage's weights were not kept")
    trained = "every decoder layer" if record.get("scope") == "layer" else "the attention"  # older records: attention
    return [f"Model stage: {trained} trained end to end to the source's next-token distributions; KL to the source "
            f"per token on a held-out calibration window {outcome}.", ""]


def _kv_rows(steps: list[dict], config: dict) -> tuple[list[tuple[str, object, object]], str]:
    """(label, elements per token per layer, bytes per token over all layers) for the source, a native MLA model an
    export started from, and this model; and the dtype the bytes are counted in (this model's cache dtype).

    The source row comes from the first step that recorded a cache (the conversion), this model's from the newest.
    Recorded bytes are used when they were counted in the same dtype; otherwise (an export records elements only, or
    changes the dtype) bytes are elements x layers x bytes per element, so that all rows compare in one dtype."""
    records = [s for s in steps if isinstance(s.get("kv_cache"), dict) and s["kv_cache"]]
    if not records:
        return [], "?"
    first, last = records[0], records[-1]
    dtype = str(last["kv_cache"].get("dtype") or first["kv_cache"].get("dtype") or "?")
    layers = config.get("num_hidden_layers")
    size = dtype_bytes(dtype)

    def nbytes(kv: dict, which: str):
        recorded = kv.get(f"bytes_per_token_{which}")
        elements = kv.get(f"elements_per_token_per_layer_{which}")
        if isinstance(recorded, (int, float)) and kv.get("dtype") == dtype:
            return recorded
        if isinstance(elements, (int, float)) and isinstance(layers, int) and size:
            return int(round(elements * layers * size))
        return None

    kv0, kv1 = first["kv_cache"], last["kv_cache"]
    rows = [("source", kv0.get("elements_per_token_per_layer_before"), nbytes(kv0, "before"))]
    if last is not first and last.get("kind") == "export":  # its "before" is the native MLA model it started from
        rows.append(("native MLA (before export)", kv1.get("elements_per_token_per_layer_before"),
                     nbytes(kv1, "before")))
    rows.append(("this model", kv1.get("elements_per_token_per_layer_after"), nbytes(kv1, "after")))
    return rows, dtype


def _kv_section(steps: list[dict], config: dict) -> list[str]:
    rows, dtype = _kv_rows(steps, config)
    if not rows:
        return []
    lines = ["### KV cache", "", f"| | elements per token per layer | bytes per token (all layers, {dtype}) |",
             "|---|---|---|"]
    lines += [f"| {label} | {_cell(elements)} | {_cell(nbytes)} |" for label, elements, nbytes in rows]
    lines.append("")
    before, after = rows[0], rows[-1]
    ratio = None
    for i in (2, 1):  # bytes when both are known, else elements (same layer count)
        if isinstance(before[i], (int, float)) and isinstance(after[i], (int, float)) and before[i]:
            ratio = after[i] / before[i]
            break
    if ratio is not None and ratio > 0:
        lines += [f"Ratio after/before: {ratio:.4f} (this model's cache is {ratio:.1%} of the source's, "
                  f"{1 / ratio:.2f}x smaller).", ""]
    kv = next((s["kv_cache"] for s in reversed(steps) if isinstance(s.get("kv_cache"), dict)
               and s["kv_cache"].get("cache_type")), None)
    if kv is not None:  # a conversion planned for a block cache type (--cache-type, --kv-bytes)
        kind = kv["cache_type"]
        lines += [f"Served with its latent in `{kind}`: {_cell(kv.get('bytes_per_token_in_cache_type'))} bytes per "
                  f"token (llama.cpp's blocks; latent basis `{kv.get('latent_basis', 'native')}`). `mla-convert eval` "
                  f"and `generate` read the cache so (the config's `latent_cache_type`); llama.cpp on the GGUF export: "
                  f"`--cache-type-k {kind} --flash-attn`.", ""]
    return lines


_PPL_LABELS = {"source": "source model", "converted": "converted (no training)", "finetuned": "fine-tuned",
               "exported": "exported (stock DeepSeek-V3)"}
_FINETUNE_FACTS = (("steps", "optimizer steps"), ("tokens", "training tokens"), ("processes", "processes"),
                   ("device", "device"), ("mixed_precision", "mixed precision"), ("seconds", "seconds"),
                   ("trainable_parameters", "trainable parameters"), ("loss_first", "loss at the first step"),
                   ("loss_last", "loss at the last step"))


def _ppl(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def _perplexity_rows(steps: list[dict]) -> list[tuple[str, object, str]]:
    """(label, perplexity, protocol) from every step of the chain, in order, each measurement once.

    Each row keeps the protocol it was measured with: `eval --record` numbers and the fine-tuning run's held-out
    numbers come from different text and window sizes and must not be read as one series."""
    rows: list[tuple[str, object, str]] = []
    for step in steps:
        m = step.get("measurements") or {}
        ppl = m.get("perplexity")
        if isinstance(ppl, dict):
            protocol = str(ppl.get("protocol") or "-")
            for key, value in ppl.items():
                if key != "protocol" and isinstance(value, (int, float)):
                    rows.append((_PPL_LABELS.get(key, key), value, protocol))
        ft = m.get("finetune")
        if isinstance(ft, dict):
            protocol = str(ft.get("held_out_protocol") or "-")
            if isinstance(ft.get("held_out_perplexity_before"), (int, float)):
                rows.append(("before fine-tuning (held out)", ft["held_out_perplexity_before"], protocol))
            if isinstance(ft.get("held_out_perplexity_after"), (int, float)):
                rows.append(("fine-tuned (held out)", ft["held_out_perplexity_after"], protocol))
    unique = []
    for row in rows:
        if row not in unique:
            unique.append(row)
    return unique


def _quality_section(steps: list[dict]) -> list[str]:
    lines = []
    rows = _perplexity_rows(steps)
    if rows:
        lines += ["| model | perplexity | protocol |", "|---|---|---|"]
        lines += [f"| {label} | {_ppl(value)} | {_cell(protocol)} |" for label, value, protocol in rows]
        lines.append("")
    merged = _measurements(steps)
    ft = merged.get("finetune")
    if isinstance(ft, dict):
        facts = [f"{label} {_cell(ft[key])}" for key, label in _FINETUNE_FACTS if ft.get(key) is not None]
        if facts:
            lines += ["Fine-tuning run: " + ", ".join(facts) + ".", ""]
    others = {k: v for k, v in merged.items() if k not in ("perplexity", "finetune")}
    if others:
        lines += [f"- `{key}`: {_cell(value)}" for key, value in others.items()]
        lines.append("")
    return ["### Measured quality", ""] + lines if lines else []


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
        "",
        *_vllm_section(ref, config),
        "Engines without the plugin (SGLang, ...) need the stock DeepSeek-V3 format, which holds only conversions "
        "made with `--target deepseek` (see mla-convert's docs/serving.md).", "",
    ]


def _vllm_section(ref: str, config: dict) -> list[str]:
    """How to serve a native checkpoint in vLLM, or why it cannot be (a layout beyond vLLM's MLA kernels)."""
    from mla_convert.serving.layout import serving_notes

    from mla_convert.modeling.configuration_mla import layer_ranks

    notes = serving_notes(layer_ranks(config) or [0], int(config.get("qk_rope_head_dim") or 0))
    if notes:
        return [f"Not servable in vLLM as converted: {notes[0]}.", ""]
    return [
        "Serve it with vLLM: install mla-convert beside vLLM (`pip install 'mla-convert[vllm]'`); its vLLM plugin runs "
        "this checkpoint through vLLM's own MLA attention and paged latent cache, exactly:", "",
        "```bash",
        f"vllm serve {ref}",
        "```", "",
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


def _render_block(folder: Path, record: dict, repo_id: str | None, title: str | None) -> str:
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
    ref = repo_id or str(_display_folder(folder))
    config = _read_config(folder)
    lines = [BEGIN_MARKER, ""] + ([f"# {title}", ""] if title else []) + ["## About this model", "", intro, ""]
    lines += _settings_section(steps)
    lines += _kv_section(steps, config)
    lines += _quality_section(steps)
    lines += _usage_section(kind, ref, config)
    lines += _versions_section(steps)
    lines += _commands_section(steps)
    lines.append(END_MARKER)
    return "\n".join(lines)


def render_model_card(folder: str | os.PathLike, repo_id: str | None = None) -> str:
    """The README.md that `write_model_card` would write (the folder is not touched).

    `repo_id` is used in the loading examples; without it they name the folder path.
    """
    import yaml
    from huggingface_hub import ModelCard

    folder = Path(folder)
    record = provenance.load(folder)
    if record is None:
        raise UserError(f"{folder} has no {provenance.FILENAME}: point at a folder written by mla-convert "
                        "(convert, finetune or export)")
    steps = _chain(record)
    source = _root_source(steps)
    path = folder / CARD_FILENAME
    try:
        existing = path.read_text(encoding="utf-8") if path.is_file() else ""
        card = ModelCard(existing or "---\nlibrary_name: transformers\n---\n")
    except (ValueError, yaml.YAMLError) as e:  # UnicodeDecodeError is a ValueError
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path} has front matter that is not valid YAML ({first}): fix it or delete the file") from None

    data = card.data
    base = _base_model(source)
    if base:
        data.base_model = base
    data.library_name = "transformers"
    data.pipeline_tag = data.pipeline_tag or "text-generation"
    tags = [data.tags] if isinstance(data.tags, str) else list(data.tags or [])  # `tags: foo` is one tag
    data.tags = tags + [t for t in CARD_TAGS if t not in tags]
    if source.get("license") and not data.license:
        data.license = source["license"]

    text = card.text
    # The title is generated (inside the block) unless the user's own text outside the block has one.
    outside = _FENCE_RE.sub("", _BLOCK_RE.sub("", text))
    title = None if re.search(r"^# \S", outside, re.M) else _title(folder, repo_id)
    try:
        block = _render_block(folder, record, repo_id, title)
    except (AttributeError, TypeError, KeyError, ValueError, IndexError) as e:  # a hand-edited or foreign record
        raise UserError(f"{folder / provenance.FILENAME} holds a field of the wrong type or shape ({type(e).__name__}: "
                        f"{str(e)[:120]}): restore it or re-run the step that wrote {folder}") from None
    if _BLOCK_RE.search(text):
        text = _BLOCK_RE.sub(lambda _: block, text, count=1)
    elif text.strip():
        text = text.rstrip() + "\n\n" + block + "\n"
    else:
        text = f"\n{block}\n"
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
    write_text_whole(path, content)
    log.info("wrote model card %s", path)
    return path

__all__ = ["CARD_FILENAME", "render_model_card", "write_model_card"]
