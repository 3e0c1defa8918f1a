"""A cache budget in bytes (`--kv-bytes`, `--cache-type`): the width and cache type chosen on the measured frontier,
the source's own quantized caches named where they do better, rows of whole blocks, and the latent stored in a basis
made for its blocks, exactly."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_user_error
from typer.testing import CliRunner

from mla_convert import kvquant, policy
from mla_convert.cli import app
from mla_convert.conversion import cachebudget
from mla_convert.modeling.configuration_mla import layer_ranks

runner = CliRunner()

# SmolLM2-135M's cache: 30 layers, 3 kv heads x 64 dims x K and V = 384 elements a layer, 23,040 bytes in 16 bits
LAYERS, KV, TOP = 30, 384, 384


def smollm2_rope(elements: int) -> int:
    """The plan's default rope key for SmolLM2 (a third of the budget, at most 48 = three quarters of head_dim)."""
    return min(48, max(2, 2 * round(elements / 3 / 2)))


def choose(kv_bytes: float, cache_type: str | None = None) -> cachebudget.Choice:
    return cachebudget.choose(SimpleNamespace(kv_bytes=kv_bytes, cache_type=cache_type), LAYERS, KV, TOP,
                              smollm2_rope)


def run(*args):
    result = runner.invoke(app, [str(a) for a in args])
    return result.exit_code, result.output


def test_predicted_ratio_follows_the_measured_frontier():
    for kept, ratio in policy.CONVERTED_16BIT:
        assert cachebudget.predicted_ratio(kept, "f16") == pytest.approx(ratio)
        assert cachebudget.predicted_ratio(kept, "q4_0") == pytest.approx(ratio * policy.LATENT_CACHE_COST["q4_0"])
    widths = [k / 100 for k in range(5, 100, 5)]
    ratios = [cachebudget.predicted_ratio(k, "f16") for k in widths]
    assert all(a > b for a, b in zip(ratios, ratios[1:]))  # a wider latent is predicted better, everywhere
    assert ratios[0] > policy.CONVERTED_16BIT[0][1]  # below the first point: extrapolated, worse


def test_an_eighth_of_the_bytes_takes_a_wide_latent_in_four_bits():
    choice = choose(0.125)
    assert choice.budget == 2880 and choice.source_bytes == 23040
    # the 41.7% point of the frontier, in iq4_nl: q4_0's bytes at a smaller measured cost
    assert (choice.chosen.cache_type, choice.chosen.elements) == ("iq4_nl", 160)
    assert choice.chosen.predicted == pytest.approx(1.385 * policy.LATENT_CACHE_COST["iq4_nl"], rel=1e-3)
    assert choice.chosen.predicted < next(c.predicted for c in choice.candidates if c.cache_type == "q4_0")
    for c in choice.candidates:  # each type's widest row within the budget: whole blocks, the next one too big
        assert c.bytes == LAYERS * kvquant.row_bytes(c.elements, c.cache_type) <= choice.budget
        step = kvquant.BLOCK if kvquant.cache_type(c.cache_type).levels else 2
        assert c.elements % step == 0
        assert LAYERS * kvquant.row_bytes(c.elements + step, c.cache_type) > choice.budget
    assert {c.cache_type: c.elements for c in choice.candidates} == {"f16": 48, "q8_0": 64, "q5_1": 128, "q5_0": 128,
                                                                      "q4_1": 128, "q4_0": 160, "iq4_nl": 160}
    assert choice.source_types == ()  # the source's smallest cache, q4_0, takes 6,480 bytes
    assert "only a conversion goes here" in "\n".join(choice.describe())


def test_where_the_sources_own_cache_fits_and_does_better_the_plan_says_so():
    choice = choose(0.5)
    assert {k for k, _, _ in choice.source_types} == set(policy.SOURCE_CACHE_COST) - {"q8_0"}  # 12,240 B > 11,520
    text = "\n".join(choice.describe())
    assert "note: converting is not worth it at this budget: the source's own q5_1 cache fits (8,640 B)" in text
    assert choose(11520).chosen == choice.chosen  # bytes or the same fraction: one budget


def test_a_quarter_of_the_bytes_takes_the_measured_five_bit_point():
    choice = choose(0.25)
    assert (choice.chosen.cache_type, choice.chosen.elements, choice.chosen.bytes) == ("q5_1", 256, 5760)
    assert choice.chosen.predicted == pytest.approx(1.080 * policy.LATENT_CACHE_COST["q5_1"], rel=1e-3)


def test_a_named_cache_type_is_the_only_one_considered():
    choice = choose(0.125, "q8_0")
    assert [c.cache_type for c in choice.candidates] == ["q8_0"] and choice.chosen.elements == 64


def test_kv_bytes_dry_run_and_its_errors(sources, tmp_path, calib_text):
    src, out = sources["llama-gqa"], tmp_path / "out"  # 2 layers, 2 kv heads x 16 dims: 64 elements, 256 bytes
    calib = ["--calib-data", calib_text, "--calib-samples", 2, "--calib-seq-len", 16]
    code, output = run("llama", src, "--kv-bytes", 40, "-o", out, "--dry-run", *calib)
    assert code == 0, output
    assert "cache budget 40 bytes per token (0.156 of the source's 16-bit 256): the latent in q4_1, 32 values" in output
    assert "served with its latent in q4_1: 40 bytes per token" in output and "balanced basis" in output
    assert not out.exists()
    code, output = run("llama", src, "--kv-bytes", 40, "--rank", 8, "-o", out, *calib)
    assert_user_error(code, output, "give one of --rank", "--kv-bytes")
    code, output = run("llama", src, "--kv-bytes", 5, "-o", out, *calib)
    assert_user_error(code, output, "--kv-bytes 5 (5 bytes per token) holds no latent row", "raise --kv-bytes")
    code, output = run("llama", src, "--kv-bytes", -1, "-o", out, *calib)
    assert_user_error(code, output, "--kv-bytes must be a positive number")
    code, output = run("llama", src, "--rank", 8, "--rope-dims", 8, "--cache-type", "q4_0", "-o", out, *calib)
    assert_user_error(code, output, "whole blocks of 32", "--rank 24")
    assert not out.exists()


def test_a_conversion_to_a_byte_budget_serves_its_choice(sources, convert_tiny, calib_text):
    out = convert_tiny(sources["llama-gqa"], kv_bytes=40)
    config = json.loads((out / "config.json").read_text())
    assert config["latent_cache_type"] == "q4_1"
    assert all((r + config["qk_rope_head_dim"]) % kvquant.BLOCK == 0 for r in layer_ranks(config))
    record = json.loads((out / "provenance.json").read_text())
    assert record["options"]["kv_bytes"] is None and record["options"]["kv_budget"] == 32.0
    assert record["options"]["cache_type"] == "q4_1"
    kv = record["kv_cache"]
    assert kv["cache_type"] == "q4_1" and kv["latent_basis"] == "balanced" and kv["budget_bytes"] == 40
    assert kv["bytes_per_token_in_cache_type"] == 40
    assert "Served with its latent in `q4_1`: 40 bytes per token" in (out / "README.md").read_text()
    code, output = run("eval", out, "--data", calib_text, "--seq-len", 32, "--windows", 2)  # reads its q4_1 cache
    assert code == 0 and "q4_1" in output, output


def test_the_latent_basis_is_folded_in_exactly(sources, convert_tiny, tmp_path):
    from mla_convert.evaluate import load_model
    from mla_convert.latent_basis import rebase_in_place

    out = convert_tiny(sources["llama-gqa"], rank=22, rope_dims=10)
    copy = shutil.copytree(out, tmp_path / "rebased")
    windows = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(0))
    assert rebase_in_place(copy, windows) < 1e-4
    a, _, _ = load_model(str(out))
    b, _, _ = load_model(str(copy))
    with torch.no_grad():
        la, lb = a(input_ids=windows).logits, b(input_ids=windows).logits
    assert torch.allclose(la, lb, rtol=0, atol=1e-4 * la.abs().max().item())
    wa, wb = a.model.layers[0].self_attn.kv_a_proj.weight, b.model.layers[0].self_attn.kv_a_proj.weight
    assert not torch.allclose(wa, wb, atol=1e-3)  # the latent is another basis of the same model


def test_ranks_for_a_block_cache_are_allocated_a_block_at_a_time():
    from mla_convert.conversion.plan import allocate

    spectra = [torch.exp(-torch.arange(384.0) / (8 + 4 * i)) for i in range(30)]  # later layers decay slower
    plan = SimpleNamespace(kv_lora_rank=[112] * 30, layers=30, latent_cache_type="q4_0")
    ranks = allocate(plan, spectra, 384)
    assert sum(ranks) == 30 * 112 and len(set(ranks)) > 1  # shared by the spectra, the total kept
    assert all((r + 48) % kvquant.BLOCK == 0 and r >= 16 for r in ranks)  # d_r 48: every row whole blocks
    plan16 = SimpleNamespace(kv_lora_rank=[112] * 30, layers=30, latent_cache_type=None)
    assert all(r % 16 == 0 for r in allocate(plan16, spectra, 384))  # without a block type: units of 16, as before
