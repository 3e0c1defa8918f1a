"""Quantized caches as the engines store them (mla_convert.kvquant) and a latent basis made for them
(mla_convert.latent_basis): ggml's rounding bit for bit, the native model's quantized latent cache read alike in every
attention form, and the basis folded into the weights without changing a logit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import mla_convert  # noqa: F401
from mla_convert import kvquant, latent_basis
from mla_convert.convert import max_rank
from mla_convert.modeling.compat import output_cache

CLOSED_FORM = dict(refine_steps=0, refine_model_steps=0)  # no training: these tests read the cache, not the fit
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1", "q5_0": "Q5_0", "q5_1": "Q5_1"}


def rows(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 256, generator=gen) * torch.rand(48, 1, generator=gen) * 3
    x[:, 5] *= 40  # an outlier channel
    x[0] = 0  # an empty block: scale 0
    x[1, :32] = 1.0  # ties everywhere
    x[2, :32] = torch.arange(32) - 16.0  # the largest magnitude negative
    return x


@pytest.mark.parametrize("kind", sorted(GGUF_TYPES))
def test_round_trip_is_ggml_bit_for_bit(kind):
    """gguf-py's quantizers are bit-exact ports of ggml-quants.c's reference rounding."""
    import gguf
    from gguf import quants

    x = rows()
    qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[kind])
    reference = quants.dequantize(quants.quantize(x.numpy(), qtype), qtype)
    np.testing.assert_array_equal(kvquant.round_trip(x, kind).numpy(), reference)


@pytest.mark.parametrize("kind", sorted(GGUF_TYPES) + ["iq4_nl", "f16", "bf16"])
def test_pack_is_ggml_block_bytes(kind):
    """`pack` writes ggml's block structs byte for byte (gguf-py's quantizers; iq4_nl read back by gguf-py's
    dequantizer, its bytes from llama.cpp's own library in test_iq4_nl_is_llamacpps_cache_rounding), and `unpack`
    reads them back as exactly `round_trip`'s values."""
    import gguf
    from gguf import quants

    x = rows()
    packed = kvquant.pack(x, kind)
    assert packed.dtype == torch.uint8 and packed.shape == (48, kvquant.row_bytes(256, kind))
    assert torch.equal(kvquant.unpack(packed, kind), kvquant.round_trip(x, kind).float())
    if kind in GGUF_TYPES:
        qtype = getattr(gguf.GGMLQuantizationType, GGUF_TYPES[kind])
        np.testing.assert_array_equal(packed.numpy(), quants.quantize(x.numpy(), qtype))
    elif kind == "iq4_nl":
        read = quants.dequantize(packed.numpy(), gguf.GGMLQuantizationType.IQ4_NL)
        np.testing.assert_array_equal(read, kvquant.round_trip(x, kind).numpy())
    else:
        assert torch.equal(packed.view(kvquant.FLOAT_DTYPES[kind]), x.to(kvquant.FLOAT_DTYPES[kind]))
    # rows packed one at a time are the rows packed together (a cache appends them)
    assert torch.equal(torch.cat([kvquant.pack(x[i : i + 1], kind) for i in range(3)]), packed[:3])


def test_bytes_and_rows():
    assert kvquant.row_bytes(96, "q4_0") == 54 and kvquant.row_bytes(96, "q8_0") == 102
    assert kvquant.latent_padding(16, 32, "q4_0") == 16 and kvquant.latent_padding(16, 32, "f16") == 0
    assert kvquant.latent_row_bytes(16, 32, "q4_0") == 36 and kvquant.latent_row_bytes(64, 32, "q4_0") == 54
    latent, k_rope = torch.randn(3, 16), torch.randn(3, 32)
    c, k = kvquant.round_trip_latent(latent, k_rope, "q8_0")
    assert c.shape == latent.shape and torch.equal(k, kvquant.round_trip(k_rope, "q8_0"))  # k_r: its own block
    assert kvquant.row_bytes(96, "f16") == 192 and kvquant.row_bytes(64, "q4_1") == 40
    with pytest.raises(ValueError, match="multiple of 32"):
        kvquant.round_trip(torch.zeros(2, 48), "q4_0")
    with pytest.raises(ValueError, match="unknown cache type"):
        kvquant.cache_type("q3_x")
    assert torch.equal(kvquant.round_trip(torch.ones(2, 48), "f16"), torch.ones(2, 48))


def test_hadamard_and_engine_rotation():
    h = kvquant.hadamard(64)
    assert torch.allclose(h @ h, torch.eye(64), atol=1e-6) and torch.equal(h, h.T)
    assert h[0, 0] == h[0, 1] == 1 / 8 and h[1, 1] == -1 / 8  # Sylvester's order: [[H, H], [H, -H]]
    assert [kvquant.engine_rotation(w, True) for w in (64, 96, 128, 192, 576)] == [64, 0, 128, 64, 64]
    assert [kvquant.engine_rotation(w, False) for w in (64, 96, 128)] == [64, 0, 64]
    x = torch.randn(3, 128)
    assert torch.allclose(kvquant.rotate_rows(kvquant.rotate_rows(x, 64), 64), x, atol=1e-5)


def test_rotation_spreads_an_outlier():
    """A head with one large dim: 4-bit blocks lose far less of it once rotated (why llama.cpp rotates)."""
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(1))
    x[:, 3] *= 30
    plain = (kvquant.round_trip(x, "q4_0") - x).norm()
    rotated = (kvquant.rotate_rows(kvquant.round_trip(kvquant.rotate_rows(x, 64), "q4_0"), 64) - x).norm()
    assert rotated < 0.5 * plain


def tokens(length: int = 20) -> torch.Tensor:
    return torch.randint(3, 300, (2, length), generator=torch.Generator().manual_seed(0))


def test_source_cache_types(sources):
    """f32 'cache' reads the source's own keys and values; q8_0 is close; q4_0 further; rotation changes q4_0."""
    src = AutoModelForCausalLM.from_pretrained(sources["llama-gqa"], dtype=torch.float32).eval()
    ids = tokens()
    with torch.no_grad():
        reference = src(ids).logits
        out = {}
        for kind, rotation in [("f32", True), ("q8_0", True), ("q4_0", True), ("q4_0", False)]:
            kvquant.read_source_cache_as(src, kind, rotation=rotation)
            out[kind, rotation] = src(ids).logits
    err = {k: ((v - reference).abs().max() / reference.abs().max()).item() for k, v in out.items()}
    assert err["f32", True] < 1e-6
    assert 0 < err["q8_0", True] < 0.1 and err["q8_0", True] < err["q4_0", True], err
    assert torch.equal(out["q4_0", True], out["q4_0", False])  # heads of 16: llama.cpp rotates none


def test_source_rotation_where_llama_cpp_rotates(tmp_path):
    """Heads of 64: the rotated q4_0 cache reads other values than the plain one, and closer to the source's."""
    from tiny import tiny_source

    src = AutoModelForCausalLM.from_pretrained(tiny_source("llama-gqa", tmp_path / "src", head_dim=64),
                                               dtype=torch.float32).eval()
    ids = tokens()
    with torch.no_grad():
        reference = src(ids).logits
        kvquant.read_source_cache_as(src, "q4_0", rotation=True)
        rotated = src(ids).logits
        kvquant.read_source_cache_as(src, "q4_0", rotation=False)
        plain = src(ids).logits
    assert not torch.equal(rotated, plain)


@pytest.fixture(scope="module")
def converted(sources, convert_tiny):
    """A tiny llama converted at full rank with every RoPE pair kept, and its source."""
    src = AutoModelForCausalLM.from_pretrained(sources["llama-gqa"], dtype=torch.float32).eval()
    folder = convert_tiny(sources["llama-gqa"], rank=max_rank(src.config), rope_dims=32, rope_merge=True, force=True,
                          **CLOSED_FORM)
    return src, folder


def load(folder, **config):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **config).eval()
    return model


def test_latent_cache_type_reads_alike_in_prefill_and_decode(converted):
    """The cached row [c, k_r] is quantized as it is written: a prefill and a token-by-token decode (absorbed form,
    over the cache) read the same values, and they differ from the 32-bit model's."""
    _, folder = converted
    plain = load(folder)
    row = plain.config.kv_lora_ranks[0] + plain.config.qk_rope_head_dim
    if row % 32:
        pytest.skip(f"the tiny conversion's cache row is {row} wide")
    model = load(folder)
    model.config.latent_cache_type = "q8_0"
    ids = tokens()
    with torch.no_grad():
        whole = model(ids).logits
        out = model(ids[:, :4], use_cache=True)
        steps, cache = [out.logits], output_cache(out)
        for t in range(4, ids.shape[1]):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = output_cache(out)
        stepped = torch.cat(steps, dim=1)
        reference = plain(ids).logits
    assert (whole - stepped).abs().max() < 1e-4 * whole.abs().max()
    assert (whole - reference).abs().max() > 1e-4 * whole.abs().max()


def stepped(model, ids: torch.Tensor, prompt: int = 5) -> tuple[torch.Tensor, object]:
    """Logits of a prefill of `prompt` tokens then one token at a time over the cache (absorbed form), and the cache."""
    out = model(ids[:, :prompt], use_cache=True)
    steps, cache = [out.logits], output_cache(out)
    for t in range(prompt, ids.shape[1]):
        out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
        steps.append(out.logits)
        cache = output_cache(out)
    return torch.cat(steps, dim=1), cache


@pytest.mark.parametrize("kind", ["q4_0", "q5_1", "q8_0", "f16"])
def test_latent_cache_holds_the_type_for_real(converted, kind, monkeypatch):
    """A model with `latent_cache_type` holds its dynamic cache in the type's bytes (ggml's blocks; the latent
    zero-padded to whole blocks) and reads back exactly the values the simulated cache (the model's dtype, each row
    rounded as the type) reads: the same logits bit for bit, in a prefill and in a token-by-token decode."""
    from mla_convert import evaluate
    from mla_convert.modeling import modeling_mla
    from mla_convert.modeling.latent_cache import TypedLatentLayer

    _, folder = converted
    model = load(folder)
    model.config.latent_cache_type = kind
    config = model.config
    ids = tokens()
    per_token = sum(kvquant.latent_row_bytes(r, config.qk_rope_head_dim, kind) for r in config.kv_lora_ranks)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        held, held_cache = stepped(model, ids)
        assert evaluate.kv_cache_bytes_per_token(model) == per_token
        monkeypatch.setattr(modeling_mla, "hold_latent_typed", lambda cache, config: None)
        simulated, simulated_cache = stepped(model, ids)
        assert torch.equal(out.logits, model(ids, use_cache=False).logits)
    assert all(isinstance(layer, TypedLatentLayer) for layer in held_cache.layers)
    assert torch.equal(held, simulated)
    assert evaluate.cache_bytes(held_cache) == ids.numel() * per_token
    held_cache.reset()  # an emptied cache after the type changed: retyped, or back to floats
    model.config.latent_cache_type = "q8_0" if kind != "q8_0" else "q4_0"
    monkeypatch.undo()
    with torch.no_grad():
        model(ids, cache=held_cache, use_cache=True)
    assert all(layer.kind == model.config.latent_cache_type for layer in held_cache.layers)
    held_cache.reset()
    model.config.latent_cache_type = None
    with torch.no_grad():
        plain = model(ids, cache=held_cache, use_cache=True).logits
    assert torch.equal(plain, model(ids, use_cache=False).logits) and not evaluate.holds_cache_type(model)
    floats = sum(r + config.qk_rope_head_dim for r in config.kv_lora_ranks) * 4  # float32 rows, unpadded
    assert evaluate.cache_bytes(simulated_cache) == ids.numel() * floats > ids.numel() * per_token


@pytest.mark.parametrize("basis", ["rotation", "balanced"])
def test_latent_basis_changes_no_logit(converted, basis):
    """The basis folded into kv_a_proj and kv_b_proj: the logits stay the source's at full rank (float rounding)."""
    src, folder = converted
    model = load(folder)
    ids = tokens()
    moments = latent_basis.latent_moments(model, ids) if basis == "balanced" else None
    before = model.model.layers[0].self_attn.kv_b_proj.weight.clone()
    latent_basis.apply_basis(model, basis, moments)
    assert not torch.allclose(before, model.model.layers[0].self_attn.kv_b_proj.weight)
    with torch.no_grad():
        reference, out = src(ids).logits, model(ids).logits
    assert (reference - out).abs().max() < 1e-4 * reference.abs().max()


def test_training_through_a_typed_cache(converted):
    """Fine-tuning a model whose latent is served in a block type: the forward reads the type's values (the logits
    of the no-grad forward), and the gradient passes the rounding straight through to the projections that write
    the cache; through the rounded codes alone it would vanish but for each block's largest value."""
    _, folder = converted
    model = load(folder)
    config = model.config
    if (config.kv_lora_ranks[0] + config.qk_rope_head_dim) % 32:
        pytest.skip("the tiny conversion's cache row is not whole blocks")
    ids = tokens()
    weight = model.model.layers[0].self_attn.kv_a_proj.weight

    def grad(kind):
        model.config.latent_cache_type = kind
        model.zero_grad()
        out = model(ids, labels=ids, use_cache=False)
        out.loss.backward()
        with torch.no_grad():
            assert (out.logits - model(ids).logits).abs().max() <= 1e-5 * out.logits.abs().max()
        return weight.grad.clone()

    plain, q8, q4 = grad(None), grad("q8_0"), grad("q4_0")
    for g in (q8, q4):  # the plain model's gradient at the rounded values (the codes alone carry almost none)
        assert torch.nn.functional.cosine_similarity(g.flatten(), plain.flatten(), dim=0) > 0.2
        assert 0.5 < g.norm() / plain.norm() < 2
    assert (q8 - plain).norm() < (q4 - plain).norm()  # finer rounding, closer to the plain model's
    rows = kvquant.round_trip(torch.randn(4, 64, requires_grad=True), "q4_0")
    assert rows.grad_fn is not None
    with torch.no_grad():
        assert torch.equal(kvquant.round_trip(rows, "q4_0"), rows)  # the forward values are the type's own


def test_balanced_map_balances():
    gen = torch.Generator().manual_seed(3)
    a, b = torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randn(8, 8, generator=gen, dtype=torch.float64)
    sigma, cost = a @ a.T + 0.1 * torch.eye(8, dtype=torch.float64), b @ b.T + 0.1 * torch.eye(8, dtype=torch.float64)
    m = latent_basis.balanced_map(sigma, cost)
    left, right = m @ sigma @ m.T, torch.linalg.inv(m).T @ cost @ torch.linalg.inv(m)
    assert torch.allclose(left, right, atol=1e-8) and torch.allclose(left, torch.diag(torch.diagonal(left)), atol=1e-8)


def test_eval_cache_type(sources, tmp_path, calib_text, convert_tiny):
    """`eval --cache-type`: a converted model's latent row and a source's keys and values in ggml's blocks, the
    bytes as the type stores them; what a type cannot hold is one error line."""
    import json

    from conftest import assert_user_error
    from test_cli import run

    out = convert_tiny(sources["llama-gqa"], rank=24, rope_dims=8, rank_allocation="uniform", **CLOSED_FORM)  # rows of 24 + 8 = 32
    args = ("--data", calib_text, "--seq-len", 32, "--windows", 2, "-q")
    code, output = run("eval", out, *args, "--json", tmp_path / "plain.json")
    assert code == 0, output
    code, output = run("eval", out, *args, "--cache-type", "q4_0", "--json", tmp_path / "q4.json")
    assert code == 0 and "q4_0 cache" in output, output
    plain, q4 = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "q4"))
    assert q4["kv_cache_bytes_per_token"] == 2 * 18 and q4["cache_type"] == "q4_0"  # 2 layers x one 18-byte block
    assert q4["perplexity"] != plain["perplexity"]
    assert_user_error(*run("eval", out, *args, "--cache-type", "q3_x"), "--cache-type must be one of")
    assert_user_error(*run("eval", out, *args, "--cache-type", "q4_0", "--engine", "vllm"), "--engine transformers")
    odd = convert_tiny(sources["llama-gqa"], rank=16, rope_dims=8, rank_allocation="uniform", **CLOSED_FORM)  # rows of 24
    code, output = run("eval", odd, *args, "--cache-type", "q8_0", "--json", tmp_path / "odd.json")
    assert code == 0 and "zero-padded" in output, output  # padded to one block: 34 bytes a layer
    assert json.loads((tmp_path / "odd.json").read_text())["kv_cache_bytes_per_token"] == 2 * 34
    assert_user_error(*run("eval", sources["llama-gqa"], *args, "--cache-type", "q8_0"), "heads of a multiple of 32")
    code, output = run("eval", sources["llama-gqa"], *args, "--cache-type", "f16")
    assert code == 0 and "KV cache 256 bytes/token" in output, output  # 2 layers x 2 x 2 heads x 16 x 2 bytes


def test_rebase_command(sources, tmp_path, calib_text, convert_tiny):
    """`mla-convert rebase`: a new folder with its provenance and card, the same logits; bad input is one line."""
    from conftest import assert_user_error
    from test_cli import run

    from mla_convert import provenance

    out = convert_tiny(sources["llama-gqa"], rank=24, rope_dims=8, rank_allocation="uniform", **CLOSED_FORM)
    target = tmp_path / "rebased"
    args = ("--calib-data", calib_text, "--calib-samples", 2, "--calib-seq-len", 32, "-q")
    code, output = run("rebase", out, "-o", target, *args)
    assert code == 0 and "latent basis balanced" in output, output
    assert provenance.load(target)["kind"] == "basis" and (target / "README.md").is_file()
    ids = tokens()
    with torch.no_grad():
        before, after = load(out)(ids).logits, load(target)(ids).logits
    assert (before - after).abs().max() < 1e-4 * before.abs().max()
    assert_user_error(*run("rebase", out, "-o", target, *args), "--overwrite")
    assert_user_error(*run("rebase", sources["llama-gqa"], "-o", tmp_path / "x", *args), "not a native MLA")
    assert_user_error(*run("rebase", out, "-o", tmp_path / "y", "--basis", "diagonal", *args), "--basis must be")
    code, output = run("rebase", out, "-o", target, *args, "--overwrite", "--basis", "rotation")
    assert code == 0, output


def test_generate_cache_type(sources, convert_tiny):
    from test_cli import run

    out = convert_tiny(sources["llama-gqa"], rank=24, rope_dims=8, rank_allocation="uniform", **CLOSED_FORM)
    code, output = run("generate", out, "-p", "w1 w2 w3", "-n", 4, "--cache-type", "q4_0")
    assert code == 0 and "KV cache: 36 bytes/token (q4_0 blocks, as llama.cpp stores them" in output, output
    code, output = run("generate", out, "-p", "w1 w2 w3", "-n", 4, "--cache-type", "q4_0", "--cache", "static")
    assert code == 0 and "read as a q4_0 cache: 36 bytes/token" in output, output  # a static cache: simulated
    assert "KV cache: 256 bytes/token (float32, all layers)" in output, output  # 2 layers x (24 + 8) x 4 bytes


IQ4_NL_BY_GGML = """
import ctypes, json, sys
from pathlib import Path
import numpy as np
import llama_cpp
lib = ctypes.CDLL(str(next(Path(llama_cpp.__file__).parent.glob("lib/libggml-base.so*"))))
x = np.ascontiguousarray(json.loads(Path(sys.argv[1]).read_text())["rows"], dtype=np.float32).reshape(-1)
blocks = np.zeros(x.size // 32 * 18, dtype=np.uint8)
out = np.zeros_like(x)
lib.quantize_row_iq4_nl_ref(x.ctypes.data_as(ctypes.c_void_p), blocks.ctypes.data_as(ctypes.c_void_p),
                            ctypes.c_int64(x.size))
lib.dequantize_row_iq4_nl(blocks.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p),
                          ctypes.c_int64(x.size))
Path(sys.argv[2]).write_text(json.dumps({"rows": out.tolist()}))
"""


def test_iq4_nl_is_llamacpps_cache_rounding():
    """iq4_nl as llama.cpp's cache writes it (its from_float, quantize_row_iq4_nl_ref) and reads it back, from
    llama.cpp's own library: gguf-py has no iq4_nl quantizer to compare with."""
    from mla_convert.serving.engine import run_worker
    from mla_convert.serving.llamacpp import llamacpp_python

    if llamacpp_python() is None:
        pytest.skip("needs scripts/install-llamacpp.sh (.venv-llamacpp)")
    x = torch.cat((rows(), rows(1) * 1e-3))
    got = run_worker([str(llamacpp_python()), "-c", IQ4_NL_BY_GGML], {"rows": x.tolist()}, "llama.cpp's iq4_nl", 120)
    reference = np.asarray(got["rows"], dtype=np.float32).reshape(x.shape)
    np.testing.assert_array_equal(kvquant.round_trip(x, "iq4_nl").numpy(), reference)
    assert kvquant.row_bytes(64, "iq4_nl") == 36
