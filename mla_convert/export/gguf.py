"""GGUF export: a native MLA checkpoint -> one .gguf file that llama.cpp's `deepseek2` architecture runs exactly.

The layers are mapped exactly as for the DeepSeek-V3 export (plan.py, layer.py: identity latent norm, interleaved
geometric RoPE, softmax scale folded into the query, residual stream rescaled so that every norm uses eps 1e-6), then
laid out as llama.cpp's loader reads them (llama.cpp src/models/deepseek2.cpp):

    q_proj                 -> attn_q_a = a_q * I (or a_q * W_q when the query is narrower than the model),
                              attn_q_a_norm = sqrt(eps)/a_q (identity), attn_q_b = W_q (or I): llama.cpp takes a
                              query without LoRA only for DeepSeek-V2-Lite's layer counts (26, 27; 48 with a 128256
                              vocabulary); those get attn_q = W_q
    kv_a_proj_with_mqa     -> attn_kv_a_mqa, attn_kv_a_norm (the identity norm the format always applies)
    kv_b_proj [H*(d_n+d_v), d_c] -> attn_k_b [H, d_c, d_n] (transposed per head: the query absorbs it) and
                              attn_v_b [H, d_v, d_c]
    dense MLP              -> ffn_gate/ffn_up/ffn_down, every layer a leading dense block

The tiny power-of-two scales of the identity norms (a, a_q) put attn_kv_a_mqa's latent rows and attn_q_a below
float16's range, so those two tensors stay float32 in f16 and Q8_0 files; everything else takes the requested type
(1-D tensors are float32, as llama.cpp's converter writes them; Q8_0 needs rows of a multiple of 32 values, others
fall back to float16).

The tokenizer (byte-level BPE from tokenizer.json) is written as llama.cpp's converter writes it: token list, types,
merges, the pre-tokenizer name llama.cpp knows for the tokenizer.json's pre-tokenizer, special token ids and the chat
template (gguf.SpecialVocab). Everything llama.cpp could not run exactly is refused before anything is written, and
the file is written under a temporary name and renamed only when complete.
"""

from __future__ import annotations

import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from mla_convert.errors import UserError
from mla_convert.serving.llamacpp import llamacpp_cache_types, llamacpp_serve_line
from mla_convert.writes import room_for, short_write_cause

log = logging.getLogger(__name__)

GGUF_TYPES = ("f32", "f16", "bf16", "q8_0")
ARCH = "deepseek2"
MARKER_KEY = "mla_convert.export"  # the JSON record this tool writes into every GGUF it makes (--overwrite reads it)
QK8_0 = 32  # values per Q8_0 block
BYTES_PER_VALUE = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 34 / QK8_0}  # q8_0: a float16 scale per block of 32


def lite_layout(layers: int, vocab_size: int) -> bool:
    """llama.cpp loads a query without LoRA (attn_q) only for these layer counts (DeepSeek-V2-Lite and kin)."""
    return layers in (26, 27) or (layers == 48 and vocab_size == 128256)


@dataclass
class TokenizerMeta:
    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    folder: Path


def _pre_tokenizer_name(pre: dict | None) -> str | None:
    """The tokenizer.ggml.pre name whose llama.cpp splitting matches this tokenizer.json pre-tokenizer, or None."""
    if not isinstance(pre, dict):
        return None
    kind = pre.get("type")
    if kind == "ByteLevel":
        return "gpt-2" if pre.get("use_regex", True) and not pre.get("add_prefix_space", False) else None
    if kind != "Sequence":
        return None
    items = pre.get("pretokenizers") or []
    kinds = [p.get("type") for p in items]
    if kinds == ["Digits", "ByteLevel"] and items[0].get("individual_digits") and items[1].get("use_regex", True) \
            and not items[1].get("add_prefix_space", False):
        return "smollm"  # every digit alone, then GPT-2's split (llama.cpp's SMOLLM pre-type)
    if kinds == ["Split", "ByteLevel"] and not items[1].get("use_regex", True):
        regex = (items[0].get("pattern") or {}).get("Regex", "")
        if r"\p{N}{1,3}" in regex and r"[^\r\n\p{L}\p{N}]?\p{L}+" in regex:
            return "llama-bpe"  # Llama 3: numbers in groups of up to three
        if r"\p{N}|" in regex and r"[^\r\n\p{L}\p{N}]?\p{L}+" in regex:
            return "qwen2"  # Qwen2: one digit at a time
    return None


def tokenizer_meta(folder: Path, vocab_size: int) -> TokenizerMeta:
    """The token list, types, merges and pre-tokenizer name for llama.cpp; refuses what it cannot write exactly."""
    import gguf

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{folder} has no tokenizer.json: the GGUF export writes byte-level BPE tokenizers only "
                        "(copy the source's tokenizer.json into the folder)")
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        model = spec["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read {path} ({type(e).__name__}): the GGUF export needs an intact tokenizer.json") from None
    if model.get("type") != "BPE":
        raise UserError(f"the tokenizer is {model.get('type')}, not byte-level BPE: the GGUF export writes BPE "
                        "tokenizers only (use the DeepSeek-V3 export, --format deepseek, for this model)")
    pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))
    if pre is None:
        raise UserError("the tokenizer's pre-tokenizer is not one llama.cpp splits the same way (GPT-2, SmolLM, "
                        "Llama 3, Qwen2): use the DeepSeek-V3 export (--format deepseek) for this model")
    vocab: dict[str, int] = dict(model.get("vocab") or {})
    added = {t["id"]: t for t in spec.get("added_tokens") or []}
    for i, t in added.items():
        vocab[t["content"]] = i
    by_id = {i: s for s, i in vocab.items()}
    if max(by_id, default=-1) >= vocab_size:
        raise UserError(f"the tokenizer has ids up to {max(by_id)} but the model's vocabulary is {vocab_size}: "
                        "the tokenizer does not belong to this model")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    return TokenizerMeta(tokens, [int(t) for t in types], merges, pre, folder)


def check_gguf_output(out: Path, overwrite: bool, inputs: tuple[Path, ...]) -> Path:
    """Refuse an output path the GGUF export must not write; returns it resolved."""
    from mla_convert.outputs import check_location

    given = out
    if out.suffix != ".gguf":
        raise UserError(f"--format gguf writes one file: -o must end in .gguf (got {given})")
    out = check_location(out, [("input", src) for src in inputs], "-o out/NAME.gguf")
    if out.is_dir():
        raise UserError(f"output {given} is a folder: --format gguf writes one file, -o out/NAME.gguf")
    if out.exists():
        if not overwrite:
            raise UserError(f"{given} already exists: pass --overwrite or choose another -o")
        if not written_by_us(out):
            raise UserError(f"{given} is not a GGUF mla-convert wrote, so --overwrite will not replace it: remove it "
                            "yourself or choose another -o")
    return out


def written_by_us(path: Path) -> bool:
    try:
        import gguf

        return MARKER_KEY in gguf.GGUFReader(str(path)).fields
    except Exception:  # not a GGUF, unreadable: not ours
        return False


def _attention_biases(source, config) -> list[dict]:
    prefix = "model.layers.{i}.self_attn."
    out = []
    for i in range(config.num_hidden_layers):
        found = {}
        for name in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj"):
            key = f"{prefix.format(i=i)}{name}.bias"
            if source.has(key) and bool(source.get(key).abs().max() > 0):
                found[name] = True
        out.append(found)
    return out


def _matrix_type(gguf_type: str, name: str, shape: tuple[int, ...]):
    """The GGML type a tensor is stored in for the requested file type (see the module docstring)."""
    import gguf

    T = gguf.GGMLQuantizationType
    if len(shape) == 1 or gguf_type == "f32":
        return T.F32
    if name.endswith(("attn_kv_a_mqa.weight", "attn_q_a.weight")) and gguf_type in ("f16", "q8_0"):
        return T.F32  # the identity norms' tiny scales: below float16's range (bfloat16 holds them)
    if gguf_type == "bf16":
        return T.BF16
    if gguf_type == "q8_0" and shape[-1] % QK8_0 == 0:
        return T.Q8_0
    return T.F16


def _encode(array: np.ndarray, qtype):
    import gguf

    T = gguf.GGMLQuantizationType
    array = np.ascontiguousarray(array, dtype=np.float32)
    if qtype == T.F32:
        return array
    if qtype == T.F16:
        return array.astype(np.float16)
    return gguf.quants.quantize(array, qtype)


class _QueryLayout(NamedTuple):
    """How the query is laid out: `mode` None (attn_q, the Lite layer counts), "input" (attn_q_a the scaled identity
    over the model width) or "output" (attn_q_a the scaled W_q, when the query is narrower); `lora_rank` is
    attn_q_a's width, `rows` the query's."""

    mode: str | None
    lora_rank: int | None
    rows: int


def _query_layout(config, plan) -> _QueryLayout:
    """The query's layout for this model (see `_QueryLayout`)."""
    hidden = config.hidden_size
    rows = plan.heads * (plan.nope_out + plan.rope_dims_out)
    mode = None if lite_layout(config.num_hidden_layers, config.vocab_size) else ("output" if rows < hidden
                                                                                  else "input")
    lora_rank = None if mode is None else (rows if mode == "output" else hidden)
    return _QueryLayout(mode, lora_rank, rows)


def _exportable_config(folder: Path):
    """The native config of `folder`, refused where llama.cpp's deepseek2 could not run it exactly."""
    from mla_convert.export.plan import native_config
    from mla_convert.serving.layout import check_servable

    config = native_config(folder, "the GGUF export")
    check_servable(config, "llama.cpp's deepseek2 attention")
    if getattr(config, "mlp_bias", False):
        raise UserError("the MLP has biases, which llama.cpp's deepseek2 dense blocks cannot hold: not exportable to GGUF")
    if config.hidden_act != "silu":
        raise UserError(f"hidden_act {config.hidden_act}: llama.cpp's deepseek2 MLP is SiLU-gated only")
    if config.qk_nope_head_dim < 1:
        raise UserError("qk_nope_head_dim is 0: llama.cpp's deepseek2 loader needs at least one non-rope key dim")
    return config


def _check_weights(source, config) -> None:
    """Refuse non-finite weights and attention biases (deepseek2 has no place for them) before the file is begun."""
    from mla_convert.validate import check_checkpoint_finite

    check_checkpoint_finite(source, "a GGUF export")
    biased = sorted({n for layer in _attention_biases(source, config) for n in layer})
    if biased:
        raise UserError(f"this model has attention biases ({', '.join(biased)}), which llama.cpp's deepseek2 "
                        "attention has no place for: serve the native checkpoint through the vLLM plugin or "
                        "transformers instead (docs/serving.md)")


def _export_record(folder: Path, gguf_type: str, plan, query: _QueryLayout, tok: TokenizerMeta, layers: int) -> dict:
    """The export record (written into the file under MARKER_KEY and returned)."""
    from mla_convert import __version__

    return {
        "format": "gguf", "gguf_type": gguf_type, "architecture": ARCH, "source": str(folder.resolve()),
        "kv_lora_rank": plan.kv_lora_rank_out, "qk_rope_head_dim": plan.rope_dims_out,
        "qk_nope_head_dim": plan.nope_out, "v_head_dim": plan.value_out, "rope_theta": plan.rope_theta,
        "q_lora_rank": query.lora_rank, "q_factorization": query.mode or "none (DeepSeek-V2-Lite layer count)",
        "tokenizer_pre": tok.pre, "mla_convert_version": __version__,
        # llama.cpp caches the latent and the rope key of every layer, f16 by default
        "kv_cache_elements_per_token": layers * (plan.kv_lora_rank_out + plan.rope_dims_out),
    }  # fmt: skip


def _query_tensors(b: str, w_q: torch.Tensor, norm_weight: torch.Tensor, query: _QueryLayout, hidden: int):
    """(GGUF name, tensor) of layer `b`'s query: attn_q, or attn_q_a, its identity norm and attn_q_b."""
    from mla_convert.export.layer import _round_to, identity_norm_scale
    from mla_convert.export.plan import EXPORT_EPS

    if query.mode is None:
        yield b + "attn_q.weight", w_q
        return
    a_q = identity_norm_scale(_query_mean_square_bound(w_q, norm_weight, query.mode))
    q_norm = _round_to(math.sqrt(EXPORT_EPS) / a_q, torch.bfloat16)
    correction = math.sqrt(EXPORT_EPS) / a_q / q_norm
    if query.mode == "input":
        q_a, q_b = a_q * torch.eye(hidden, dtype=torch.float64), correction * w_q
    else:
        q_a, q_b = a_q * w_q, correction * torch.eye(query.rows, dtype=torch.float64)
    yield b + "attn_q_a.weight", q_a
    yield b + "attn_q_a_norm.weight", torch.full((q_a.shape[0],), q_norm, dtype=torch.float64)
    yield b + "attn_q_b.weight", q_b


def _layer_tensors(source, plan, i: int, query: _QueryLayout, hidden: int):
    """(GGUF name, tensor) of decoder layer `i`, in file order: the exported attention, then the dense MLP."""
    from mla_convert.export.layer import export_layer

    s = plan.residual_scale
    p = f"model.layers.{i}."
    norm_weight = source.get(p + "input_layernorm.weight")
    attn = {f"{n}.weight": source.get(f"{p}self_attn.{n}.weight")
            for n in ("q_proj", "kv_a_proj", "kv_b_proj", "o_proj")}
    t, _ = export_layer(attn, plan, i, norm_weight)
    b = f"blk.{i}."
    yield b + "attn_norm.weight", norm_weight
    yield from _query_tensors(b, t["q_proj.weight"], norm_weight, query, hidden)
    yield b + "attn_kv_a_mqa.weight", t["kv_a_proj_with_mqa.weight"]
    yield b + "attn_kv_a_norm.weight", t["kv_a_layernorm.weight"]
    kv_b = t["kv_b_proj.weight"].view(plan.heads, plan.nope_out + plan.value_out, plan.kv_lora_rank_out)
    yield b + "attn_k_b.weight", kv_b[:, : plan.nope_out].transpose(1, 2).contiguous()
    yield b + "attn_v_b.weight", kv_b[:, plan.nope_out :].contiguous()
    yield b + "attn_output.weight", t["o_proj.weight"]
    yield b + "ffn_norm.weight", source.get(p + "post_attention_layernorm.weight")
    yield b + "ffn_gate.weight", source.get(p + "mlp.gate_proj.weight")
    yield b + "ffn_up.weight", source.get(p + "mlp.up_proj.weight")
    yield b + "ffn_down.weight", s * source.get(p + "mlp.down_proj.weight").double()


def _model_tensors(source, config, plan, query: _QueryLayout):
    """(GGUF name, tensor) of the whole model, in file order: embeddings, final norm, output, then every layer."""
    s = plan.residual_scale
    yield "token_embd.weight", s * source.get("model.embed_tokens.weight").double()
    yield "output_norm.weight", source.get("model.norm.weight")
    lm_head = "lm_head.weight" if source.has("lm_head.weight") else "model.embed_tokens.weight"
    yield "output.weight", source.get(lm_head)
    for i in range(config.num_hidden_layers):
        yield from _layer_tensors(source, plan, i, query, config.hidden_size)


def _write_file(out: Path, write, recheck) -> None:
    """Write `out` by `write(path)` under a temporary name beside it and rename it into place after `recheck()`;
    the partial file is removed on any failure."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            write(tmp)
        except OSError as e:  # numpy reports a full disk as a short write without its errno
            raise short_write_cause(tmp, e) from None
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would hide the file from other users
        recheck()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def export_gguf(model: str | os.PathLike, out: str | os.PathLike, gguf_type: str = "f32",
                overwrite: bool = False, pad_latent: str = "none") -> dict:
    """Write the native MLA checkpoint folder `model` as one llama.cpp GGUF `out`; returns the export record.
    `pad_latent` "llamacpp" zero-pads kv_lora_rank so that a cached row is a multiple of 64 values (exact)."""
    import gguf

    from mla_convert import provenance
    from mla_convert.export.plan import ExportOptions, make_export_plan
    from mla_convert.sources import SafetensorsSource

    if gguf_type not in GGUF_TYPES:
        raise UserError(f"--gguf-type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type}")
    if pad_latent not in ("none", "llamacpp"):
        raise UserError(f"--pad-latent {pad_latent} is a vLLM/FlashMLA layout; a GGUF takes --pad-latent none or "
                        "llamacpp")
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        raise UserError(f"{folder} has no config.json: pass a native MLA checkpoint folder (mla-convert llama -o DIR)")
    out = check_gguf_output(Path(out).expanduser(), overwrite, (folder,))
    config = _exportable_config(folder)
    source = SafetensorsSource(config, str(folder), folder)
    try:
        _check_weights(source, config)
        layers = [{} for _ in range(config.num_hidden_layers)]
        plan = make_export_plan(config, layers, ExportOptions(verify=False, pad_latent=pad_latent))
        query = _query_layout(config, plan)
        tok = tokenizer_meta(folder, config.vocab_size)
        special = gguf.SpecialVocab(folder, load_merges=False, n_vocab=config.vocab_size)
        record = _export_record(folder, gguf_type, plan, query, tok, config.num_hidden_layers)

        def write(path: Path) -> None:
            writer = gguf.GGUFWriter(str(path), ARCH)
            _write_metadata(writer, config, plan, tok, special, gguf_type, query.lora_rank, record, folder)
            for name, tensor in _model_tensors(source, config, plan, query):
                array = tensor.detach().to(torch.float64).numpy().astype(np.float32)
                qtype = _matrix_type(gguf_type, name, array.shape)
                writer.add_tensor(name, _encode(array, qtype), raw_dtype=qtype)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
            writer.close()

        needed = int(sum(math.prod(source.shape(n)) for n in source.keys()) * BYTES_PER_VALUE[gguf_type])
        with room_for(out, needed, "the export to"):  # the output is checked again before the rename
            _write_file(out, write, lambda: check_gguf_output(out, overwrite, (folder,)))
    finally:
        source.close()
    record["parent_provenance_kind"] = (provenance.load(folder) or {}).get("kind")
    record["latent_cache_type"] = getattr(config, "latent_cache_type", None)  # the type the conversion planned for
    return record


def _query_mean_square_bound(w_q: torch.Tensor, norm_weight: torch.Tensor, mode: str) -> float:
    """Bound on mean(y^2) of what attn_q_a outputs: x itself (input mode) or W_q x (output mode), x the attn_norm
    output, whose mean square is at most max(norm_weight^2)."""
    w2 = float(norm_weight.double().abs().max()) ** 2
    if mode == "input":
        return w2
    sigma = float(torch.linalg.matrix_norm(w_q.double() * norm_weight.double(), ord=2))
    return sigma * sigma * w_q.shape[1] / w_q.shape[0]


def _write_metadata(writer, config, plan, tok: TokenizerMeta, special, gguf_type: str, q_lora_rank: int | None,
                    record: dict, folder: Path) -> None:
    import gguf

    from mla_convert.export.plan import EXPORT_EPS

    layers = config.num_hidden_layers
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]
    writer.add_name(folder.name)
    writer.add_string(MARKER_KEY, json.dumps(record, sort_keys=True))
    writer.add_block_count(layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(plan.heads)
    writer.add_head_count_kv(1)  # MLA with the absorbed query is MQA over the latent
    writer.add_rope_freq_base(plan.rope_theta)
    writer.add_layer_norm_rms_eps(EXPORT_EPS)
    writer.add_file_type(file_type)
    writer.add_leading_dense_block_count(layers)
    writer.add_vocab_size(config.vocab_size)
    if q_lora_rank is not None:
        writer.add_q_lora_rank(q_lora_rank)
    writer.add_kv_lora_rank(plan.kv_lora_rank_out)
    writer.add_key_length(plan.kv_lora_rank_out + plan.rope_dims_out)
    writer.add_value_length(plan.kv_lora_rank_out)
    writer.add_key_length_mla(plan.nope_out + plan.rope_dims_out)
    writer.add_value_length_mla(plan.value_out)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_expert_shared_count(0)
    writer.add_rope_dimension_count(plan.rope_dims_out)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tok.pre)
    writer.add_token_list(tok.tokens)
    writer.add_token_types(tok.types)
    writer.add_token_merges(tok.merges)
    special.add_to_gguf(writer)


def report_gguf(record: dict, output: Path, say) -> None:
    """What a GGUF export wrote, through `say` (the CLI passes typer.echo)."""
    q = f"q_lora_rank {record['q_lora_rank']} ({record['q_factorization']})" if record["q_lora_rank"] else "no q LoRA"
    say(f"wrote {output}: llama.cpp {record['architecture']} {record['gguf_type']}, kv_lora_rank "
        f"{record['kv_lora_rank']} + rope {record['qk_rope_head_dim']}, {q}, rope_theta {record['rope_theta']:.6g}, "
        f"tokenizer pre {record['tokenizer_pre']}; llama.cpp caches {record['kv_cache_elements_per_token']} values "
        "per token (f16 cache: x2 bytes)")
    say(llamacpp_cache_types(record["kv_lora_rank"], record["qk_rope_head_dim"]))
    say(f"run it: mla-convert eval {output} --engine llamacpp --data TEXT (llama.cpp from scripts/install-llamacpp.sh)")
    say(llamacpp_serve_line(output, record["kv_lora_rank"], record["qk_rope_head_dim"],
                            record.get("latent_cache_type"), record["kv_cache_elements_per_token"]))
