"""Refinement of the converted layers (`--refine-steps`, mla_convert.conversion.refine_layer), the model stage
(`--refine-model-steps`, conversion.model_stage) and their CPU estimates (conversion.estimates)."""

from __future__ import annotations

import json
import logging
import re
import types

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import mla_convert  # noqa: F401
from mla_convert import policy
from mla_convert.conversion import estimates, model_stage, refine_layer, selftext
from mla_convert.cli import app
from mla_convert.conversion.plan import CALIB_SAMPLES, WIDE_CALIB_SAMPLES, Plan, max_rank
from mla_convert.policy import WIDE_FROM
from mla_convert.schema import OPTIONS
from tiny import tiny_text

from conftest import assert_user_error


def _weights(folder) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


def _plan(folder) -> dict:
    return json.loads((folder / "provenance.json").read_text())["plan"]


def _kl_to_source(src, folder, ids) -> float:
    """Mean KL(source || model) of the next-token distributions over `ids`."""
    mla = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        p = src(ids).logits.log_softmax(-1)
        q = mla(ids).logits.log_softmax(-1)
    return (p.exp() * (p - q)).sum(-1).mean().item()


def test_full_rank_is_left_exact(sources, convert_tiny):
    """A layer the closed form reproduces has nothing to gain: refinement leaves it bit-exact."""
    src = AutoModelForCausalLM.from_pretrained(sources["llama-gqa"], dtype=torch.float32)
    full = dict(rank=max_rank(src.config), rope_dims=src.config.num_key_value_heads * src.config.head_dim, force=True)
    plain = convert_tiny(sources["llama-gqa"], refine_steps=0, **full)
    for scope in refine_layer.SCOPES:
        refined = convert_tiny(sources["llama-gqa"], refine_steps=20, refine_model_steps=model_stage.MODEL_STEPS,
                               refine_scope=scope, **full)
        a, b = _weights(plain), _weights(refined)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
        record = _plan(refined)["refine"]
        assert len(record) == src.config.num_hidden_layers
        assert all(r["before"] < refine_layer.EXACT and not r["kept"] for r in record)
        # the model stage ran (a GPU's steps, at the auto rate) and found nothing to gain either
        options = json.loads((refined / "provenance.json").read_text())["options"]
        assert options["refine_model_steps"] == model_stage.MODEL_STEPS and options["refine_model_lr"] == model_stage.MODEL_LR
        model_record = _plan(refined)["refine_model"]
        assert model_record["before"] < refine_layer.EXACT and not model_record["kept"]


@pytest.mark.parametrize("allocation,scope,propagate", [("uniform", "attention", "source"),
                                                         ("energy", "attention", "source"),
                                                         ("uniform", "layer", "source"),
                                                         ("energy", "layer", "converted")])
def test_refinement_brings_a_lossy_conversion_closer_to_the_source(sources, convert_tiny, allocation, scope, propagate):
    """At a low rank and few RoPE pairs, the refined model's next-token distributions are closer to the source's on
    text no calibration read, and the record says what each layer gained (with the energy allocation too, whose
    statistics pass runs before any layer is converted, and along the converted model's stream)."""
    kind = "llama-gqa"
    src = AutoModelForCausalLM.from_pretrained(sources[kind], dtype=torch.float32).eval()
    lossy = dict(rank=4, rope_dims=4, calib_samples=16, calib_seq_len=64, rank_allocation=allocation,
                 calib_propagate=propagate, refine_model_steps=0)  # the layers' refinement alone (the stage: below)
    plain = convert_tiny(sources[kind], refine_steps=0, **lossy)
    refined = convert_tiny(sources[kind], refine_steps=150, refine_lr=3e-3, refine_scope=scope, **lossy)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sources[kind])
    ids = tok(tiny_text(600, seed=9), return_tensors="pt").input_ids[:, :128]
    assert _kl_to_source(src, refined, ids) < 0.95 * _kl_to_source(src, plain, ids)
    record = _plan(refined)["refine"]
    assert len(record) == src.config.num_hidden_layers
    assert any(r["kept"] for r in record)
    assert all(r["after"] < r["before"] for r in record if r["kept"])
    assert _plan(plain)["refine"] == []  # not run: nothing recorded
    a, b = _weights(plain), _weights(refined)
    mlp_changed = any(not torch.equal(a[k], b[k]) for k in a if ".mlp." in k)
    assert mlp_changed == (scope == "layer")  # the whole layer trains only when asked
    card = (refined / "README.md").read_text()
    assert "Refinement:" in card


def test_converted_stream_trains_each_layer_on_the_inputs_it_will_see(sources, convert_tiny):
    """Along the converted model's stream (`--calib-propagate converted`) the first layer sees the same inputs as
    along the source's (same record), later layers the converted layers' outputs (a different one); the energy
    ranks come from the source's stream either way, and auto refines both."""
    lossy = dict(rank=4, rope_dims=4, calib_samples=8, calib_seq_len=32, refine_steps=None, refine_scope="layer")
    along = {p: convert_tiny(sources["llama-gqa"], calib_propagate=p, **lossy) for p in ("source", "converted")}
    plans = {p: _plan(f) for p, f in along.items()}
    options = {p: json.loads((f / "provenance.json").read_text())["options"] for p, f in along.items()}
    assert options["source"]["refine_steps"] == options["converted"]["refine_steps"] == estimates.DEFAULT_STEPS
    # a narrow budget on a CPU: the short model stage at its rate (none along the converted stream)
    assert options["source"]["refine_model_steps"] == policy.MODEL_STEPS_CPU[0]
    assert options["source"]["refine_model_lr"] == model_stage.SHORT_MODEL_LR
    assert options["converted"]["refine_model_steps"] == 0
    assert options["converted"]["rank_allocation"] == "energy"
    assert plans["source"]["ranks"] == plans["converted"]["ranks"]
    assert plans["source"]["refine"][0] == plans["converted"]["refine"][0]
    assert plans["source"]["refine"][1]["before"] != plans["converted"]["refine"][1]["before"]


class _Scaled(torch.nn.Module):
    """A stand-in attention: out = x W (the refinement only needs attn(x, position_embeddings=, attention_mask=))."""

    def __init__(self, weight):
        super().__init__()
        self.w = torch.nn.Parameter(weight.clone())

    def forward(self, x, position_embeddings=None, attention_mask=None):
        return x @ self.w, None


def _inputs(n=4, t=16, d=8):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, t, d, generator=gen)
    target = torch.randn(d, d, generator=gen)
    pe = (torch.ones(1, t, 2), torch.zeros(1, t, 2))
    return x, x @ target, pe, target


def test_refine_fits_and_keeps_what_helps():
    x, y, pe, target = _inputs()
    attn = _Scaled(target + 0.3 * torch.randn(target.shape, generator=torch.Generator().manual_seed(1)))
    record = refine_layer.refine_module(attn, x, y, pe, steps=200, lr=3e-2, seq_len=16, batch=2)
    assert record["kept"] and record["after"] < 0.05 * record["before"]


def test_bfloat16_steps_fit_float32_weights(monkeypatch):
    """--refine-precision bfloat16: the steps run under bfloat16 autocast (the module sees bfloat16 activations),
    the trained weights stay float32 and still fit; auto is bfloat16 only on CPUs with native bfloat16 arithmetic."""
    x, y, pe, target = _inputs()
    attn = _Scaled(target + 0.3 * torch.randn(target.shape, generator=torch.Generator().manual_seed(1)))
    seen = []
    original = attn.forward
    attn.forward = lambda xb, **kw: seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu")
                                                 else None) or original(xb, **kw)
    record = refine_layer.refine_module(attn, x, y, pe, steps=200, lr=3e-2, seq_len=16, batch=2, precision="bfloat16")
    assert record["kept"] and record["after"] < 0.05 * record["before"] and attn.w.dtype == torch.float32
    assert torch.bfloat16 in seen and None in seen  # the steps autocast, the held-out checks do not
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert refine_layer.resolve_precision("auto", "cpu", 576) == "float32"
    assert estimates.cpu_rate("bfloat16") == estimates.CPU_FLOPS  # emulated bfloat16 is no faster than float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert refine_layer.resolve_precision("auto", "cpu", 576) == "bfloat16"
    assert estimates.cpu_rate("bfloat16") == estimates.CPU_BF16_FLOPS and estimates.cpu_rate("float32") == estimates.CPU_FLOPS
    # the model stage's products are larger, and AMX speeds them more than the layer step's attention
    assert estimates.cpu_rate("bfloat16", model_stage=True) == estimates.CPU_BF16_MODEL_FLOPS > estimates.CPU_BF16_FLOPS
    assert estimates.cpu_rate("float32", model_stage=True) == estimates.CPU_FLOPS
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert refine_layer.resolve_precision("auto", "cpu", 576) == "bfloat16"
    assert estimates.cpu_rate("bfloat16") == estimates.CPU_AVX512_BF16_FLOPS < estimates.CPU_BF16_FLOPS
    assert estimates.cpu_rate("bfloat16", model_stage=True) == estimates.CPU_AVX512_BF16_FLOPS  # fitted on both stages
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert refine_layer.resolve_precision("auto", "cuda", 576) == "float32"
    assert refine_layer.resolve_precision("auto", "cpu", 64) == "float32"  # tiny layers: the casts cost more than they save
    assert refine_layer.resolve_precision("float32", "cpu", 576) == "float32"
    assert refine_layer.resolve_precision("bfloat16", "cpu", 64) == "bfloat16"


def test_refine_restores_the_weights_when_the_held_out_error_does_not_drop():
    x, y, pe, target = _inputs()
    start = target + 0.3 * torch.randn(target.shape, generator=torch.Generator().manual_seed(1))
    attn = _Scaled(start)
    record = refine_layer.refine_module(attn, x, y, pe, steps=20, lr=50.0, seq_len=16, batch=2)  # diverges
    assert not record["kept"] and record["after"] >= record["before"]
    assert torch.equal(attn.w.detach(), start)
    assert not attn.w.requires_grad


def _shaped_plan(layers, hidden, heads, groups, head_dim, rank, rope_dims, intermediate, nope_dims=None,
                 scope=refine_layer.DEFAULT_SCOPE) -> Plan:
    plan = Plan(family="llama", model_type="llama", layers=layers, hidden=hidden, heads=heads, groups=groups,
                head_dim=head_dim, kv_lora_rank=[rank] * layers, rope_dims=rope_dims,
                nope_dims=head_dim - rope_dims if nope_dims is None else nope_dims,
                dtype="bfloat16", memory={"intermediate": intermediate}, refine_scope=scope,
                source_bytes=0, calib_tokens=0)  # fmt: skip
    plan.set_kv_lora_rank(plan.kv_lora_rank)
    return plan


def test_auto_steps_follow_the_estimated_cost(caplog):
    small = _shaped_plan(30, 576, 9, 3, 64, 64, 32, 1536)  # SmolLM2-135M at 25%
    big = _shaped_plan(32, 4096, 32, 8, 128, 512, 64, 14336)  # Llama-3-8B shapes
    assert estimates.estimate_seconds(small, estimates.DEFAULT_STEPS) <= estimates.AUTO_CPU_SECONDS
    assert estimates.resolve_steps(None, small, "cpu", refine_layer.SEQ_LEN) == estimates.DEFAULT_STEPS
    # a longer window costs more a step: the same tokens, but each score row twice as long
    assert estimates.estimate_seconds(small, 100, 2048) > estimates.estimate_seconds(small, 100, 1024)
    assert refine_layer.batch_for(2048) == 1 and refine_layer.batch_for(1024) == 2 and refine_layer.batch_for(512) == 4
    half = _shaped_plan(30, 576, 9, 3, 64, 144, 48, 1536, nope_dims=64)  # SmolLM2-135M at 50%: refined on a CPU too
    narrow_cpu, wide_cpu = policy.REFINE_STEPS_CPU
    # the wider latent, more steps; on a CPU at fewer positions each (policy.REFINE_QUERIES_CPU), which the estimate
    # counts: the same steps at every position would be over the CPU's limit
    queries = estimates.resolve_queries(None, refine_layer.SEQ_LEN, half.ratio, "cpu")
    assert estimates.resolve_steps(None, half, "cpu", refine_layer.SEQ_LEN, queries=queries) == wide_cpu > narrow_cpu
    assert estimates.estimate_seconds(half, wide_cpu, queries=queries) < estimates.AUTO_CPU_SECONDS
    assert estimates.estimate_seconds(half, wide_cpu) > estimates.AUTO_CPU_SECONDS
    assert estimates.resolve_steps(None, half, "cpu", refine_layer.SEQ_LEN) == estimates.WIDE_STEPS  # steps at every position
    assert estimates.resolve_steps(None, half, "cuda", refine_layer.SEQ_LEN) == estimates.WIDE_STEPS
    assert estimates.default_steps(0.25) == estimates.DEFAULT_STEPS < estimates.WIDE_STEPS == estimates.default_steps(0.5)
    assert estimates.default_steps(0.25, "cpu", 256) == narrow_cpu and estimates.default_steps(0.5, "cpu", 256) == wide_cpu
    # a CPU's steps at every position (a window no longer than the positions) are a GPU's count
    assert estimates.default_steps(0.5, "cpu", 0) == estimates.WIDE_STEPS
    # the whole layer costs more a step than its attention alone (the MLP's maps train too)
    layer, attention = (_shaped_plan(30, 576, 9, 3, 64, 64, 32, 1536, scope=s) for s in ("layer", "attention"))
    assert estimates.step_flops(layer) > 1.5 * estimates.step_flops(attention)
    with caplog.at_level(logging.WARNING, logger="mla_convert.conversion.estimates"):
        assert estimates.resolve_steps(None, big, "cpu", 2048) == 0
    assert "--refine-steps" in caplog.text
    assert estimates.resolve_steps(None, big, "cuda", 2048) == estimates.DEFAULT_STEPS
    assert estimates.resolve_steps(7, big, "cpu", 2048) == 7
    # the estimate grows with the model: an 8B layer is over ten times a 135M one
    assert estimates.step_flops(big) > 10 * estimates.step_flops(small)


def test_estimates_follow_this_cpus_speed(sources, calib_text, monkeypatch):
    """The estimates (and `auto`, which decides on them) scale with this CPU's speed against the 2-core reference: its
    thread count, or MLA_CONVERT_CPU_SPEED; a bad setting is one clear error."""
    monkeypatch.delenv(estimates.CPU_SPEED_ENV)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert estimates.cpu_speed() == 8 and estimates.cpu_rate("float32") == 8 * estimates.CPU_FLOPS
    half = _shaped_plan(30, 576, 9, 3, 64, 144, 48, 1536, nope_dims=64)
    big = _shaped_plan(32, 4096, 32, 8, 128, 512, 64, 14336)
    seconds = {}
    for setting in ("1", "2", "40"):
        monkeypatch.setenv(estimates.CPU_SPEED_ENV, setting)
        rate = estimates.cpu_rate("float32")
        assert rate == estimates.CPU_FLOPS * float(setting)
        seconds[setting] = (estimates.estimate_seconds(half, 600, rate=rate, queries=256),
                            estimates.estimate_model_seconds(half, 32, rate=rate))
        # an 8B's layers refine on a CPU fast enough to do it within AUTO_CPU_SECONDS
        steps = estimates.resolve_steps(None, big, "cpu", refine_layer.SEQ_LEN, rate, queries=256)
        assert steps == (policy.REFINE_STEPS_CPU[0] if setting == "40" else 0), (setting, steps)
    for one, two in zip(seconds["1"], seconds["2"]):
        assert two == pytest.approx(one / 2)
    for setting in ("0", "-1", "fast", "nan"):
        monkeypatch.setenv(estimates.CPU_SPEED_ENV, setting)
        result = CliRunner().invoke(app, ["llama", str(sources["llama-gqa"]), "--rank", "8", "--calib-data",
                                          str(calib_text), "--dry-run"])  # fmt: skip
        assert_user_error(result.exit_code, result.output, estimates.CPU_SPEED_ENV, "positive number")


def test_cli_prints_the_auto_warnings_once(sources, calib_text, monkeypatch):
    """The CLI plans once quietly (serving notes) before the conversion: its warnings come out once, not twice."""
    monkeypatch.setattr(estimates, "AUTO_CPU_SECONDS", -1.0)
    monkeypatch.setattr(estimates, "AUTO_MODEL_CPU_SECONDS", -1.0)
    result = CliRunner().invoke(app, ["llama", str(sources["llama-gqa"]), "--rank", "8", "--calib-data", str(calib_text),
                                      "--dry-run"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert result.output.count("not refining the converted layers") == 1
    assert result.output.count("no model stage") == 1


@pytest.mark.parametrize("args,needle", [
    (["--refine-steps", "many"], "--refine-steps must be auto or a number"),
    (["--refine-steps", "-3"], "--refine-steps must be 0 or more"),
    (["--refine-model-steps", "many"], "--refine-model-steps must be auto or a number"),
    (["--refine-model-steps", "-1"], "--refine-model-steps must be 0 or more"),
    (["--refine-queries", "half"], "--refine-queries must be auto or a number of positions"),
    (["--refine-queries", "-1"], "--refine-queries must be 0 or more"),
    (["--refine-model-lr", "0"], "--refine-model-lr must be positive"),
    (["--refine-model-lr", "nan"], "--refine-model-lr must be positive"),
    (["--refine-model-lr", "fast"], "--refine-model-lr must be auto or a learning rate"),
    (["--refine-model-steps", "4", "--calib-data", "none"], "--refine-model-steps trains on calibration text"),
    (["--refine-model-steps", "4", "--calib-propagate", "converted"], "--calib-propagate source"),
    (["--refine-model-scope", "model"], "--refine-model-scope must be one of attention, layer"),
    (["--refine-precision", "fp8"], "--refine-precision must be one of auto, float32, bfloat16"),
    (["--refine-workers", "0"], "--refine-workers must be auto or 1 or more"),
    (["--refine-workers", "two"], "--refine-workers must be auto or a number of processes"),
    (["--refine-workers", "2", "--calib-propagate", "converted", "--refine-model-steps", "0"],
     "--calib-propagate source (or --refine-workers 1)"),
])
def test_bad_refine_steps_is_one_clear_line(sources, tmp_path, args, needle):
    result = CliRunner().invoke(app, ["llama", str(sources["llama-gqa"]), "-o", str(tmp_path / "out"),
                                      "--kv-budget", "0.5", *args])
    assert_user_error(result.exit_code, result.output, needle)
    assert not (tmp_path / "out").exists()


def test_refine_without_calibration_text_is_refused(sources, tmp_path):
    result = CliRunner().invoke(app, ["llama", str(sources["llama-gqa"]), "-o", str(tmp_path / "out"),
                                      "--kv-budget", "0.5", "--calib-data", "none", "--refine-steps", "10"])
    assert_user_error(result.exit_code, result.output, "--refine-steps", "--calib-data")


def test_cli_defaults_are_the_library_defaults():
    """The convert commands' defaults (made from the option schema) equal ConvertOptions' and refine's and selftext's
    constants (None: left to the library, resolved per family; `auto` refinement is the library's None)."""
    import dataclasses

    import typer

    from mla_convert.convert import ConvertOptions

    library = ConvertOptions()
    fields = {f.name for f in dataclasses.fields(ConvertOptions)}
    group = typer.main.get_command(app)
    checked = set()
    for name in ("convert", "llama", "qwen"):
        for option in group.commands[name].params:
            if option.name not in fields or option.default is None:
                continue
            auto = (option.name in ("refine_steps", "refine_model_steps", "refine_model_lr", "refine_queries",
                                    "refine_workers")
                    and getattr(library, option.name) is None)
            expected = "auto" if auto else None
            assert option.default == (expected or getattr(library, option.name)), (name, option.name)
            checked.add(option.name)
    assert {"calib_seq_len", "calib_sample_tokens", "refine_lr",
            "refine_seq_len", "refine_queries", "refine_steps", "refine_mlp_lr_scale", "refine_model_steps", "refine_model_lr",
            "refine_model_scope", "refine_precision", "refine_workers"} <= checked
    assert library.refine_lr == refine_layer.DEFAULT_LR and library.refine_seq_len == refine_layer.SEQ_LEN
    assert library.refine_model_lr is None and library.refine_model_scope == model_stage.MODEL_SCOPE  # resolve_model_lr
    assert library.refine_mlp_lr_scale == refine_layer.MLP_LR_SCALE
    assert library.calib_sample_tokens == selftext.SAMPLE_TOKENS
    temperature = [o for o in group.commands["convert"].params if o.name == "calib_temperature"]
    assert library.calib_temperature is None and temperature[0].default is None  # by the cache kept (selftext)
    assert f"{WIDE_FROM:.1%}" in temperature[0].help
    samples = [o for o in group.commands["convert"].params if o.name == "calib_samples"]
    assert library.calib_samples is None and samples[0].default is None  # by the cache kept (convert)
    assert f"{WIDE_FROM:.1%}" in samples[0].help
    assert f"{CALIB_SAMPLES} where" in samples[0].help and f"else {WIDE_CALIB_SAMPLES}" in samples[0].help


def test_mlp_learning_rate_reaches_the_loop(sources, convert_tiny):
    """`refine_mlp_lr_scale` is the MLP's learning rate in the whole-layer scope: at 0 the MLP and norms stay the
    source's while the attention still trains (to the whole layer's target); above 0 they train."""
    lossy = dict(rank=4, rope_dims=4, calib_samples=8, calib_seq_len=32, refine_steps=30, refine_scope="layer")
    plain = _weights(convert_tiny(sources["llama-gqa"], refine_steps=0, **{k: v for k, v in lossy.items()
                                                                          if k != "refine_steps"}))
    for scale in (0.0, 1.0):
        folder = convert_tiny(sources["llama-gqa"], refine_mlp_lr_scale=scale, **lossy)
        trained = _weights(folder)
        mlp = [k for k in plain if ".mlp." in k or "layernorm" in k]
        attention = [k for k in plain if ".self_attn." in k]
        assert any(r["kept"] for r in _plan(folder)["refine"])
        assert any(not torch.equal(plain[k], trained[k]) for k in attention)
        assert any(not torch.equal(plain[k], trained[k]) for k in mlp) == (scale > 0), scale


def test_refinement_window_reaches_the_loop(sources, convert_tiny):
    """`refine_seq_len` sets the window each step trains on (windows past the calibration length are the whole
    sequence): a different window trains different weights, and provenance records the one used."""
    lossy = dict(rank=4, rope_dims=4, calib_samples=4, calib_seq_len=64, refine_steps=5, refine_lr=3e-3)
    short = convert_tiny(sources["llama-gqa"], refine_seq_len=16, **lossy)
    whole = convert_tiny(sources["llama-gqa"], refine_seq_len=64, **lossy)
    longer = convert_tiny(sources["llama-gqa"], refine_seq_len=4096, **lossy)  # capped at the 64 calibrated
    a, b, c = _weights(short), _weights(whole), _weights(longer)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(b[k], c[k]) for k in b)
    options = json.loads((whole / "provenance.json").read_text())["options"]
    assert options["refine_seq_len"] == 64


def test_refinement_queries_reach_the_loop(sources, convert_tiny):
    """`refine_queries` sets the positions a step takes its loss at: fewer than the window train other weights (and
    still lower the held-out error), as many as the window are every position (the default, 0), and provenance
    records what ran."""
    lossy = dict(rank=4, rope_dims=4, calib_samples=4, calib_seq_len=64, refine_steps=8, refine_lr=3e-3,
                 refine_model_steps=0)
    some = convert_tiny(sources["llama-gqa"], refine_queries=16, **lossy)
    window = convert_tiny(sources["llama-gqa"], refine_queries=64, **lossy)
    every = convert_tiny(sources["llama-gqa"], **lossy)
    a, b, c = _weights(some), _weights(window), _weights(every)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    assert all(torch.equal(b[k], c[k]) for k in c)
    assert any(r["kept"] and r["after"] < r["before"] for r in _plan(some)["refine"])
    recorded = [json.loads((f / "provenance.json").read_text())["options"]["refine_queries"] for f in (some, every)]
    assert recorded == [16, 0]


def test_queries_of_a_whole_window_are_every_position():
    assert estimates.resolve_queries(100, 2048) == 100
    assert estimates.resolve_queries(2048, 2048) == 0
    assert estimates.resolve_queries(0, 2048) == 0


def test_auto_queries_follow_the_device_and_the_cache_kept():
    """`--refine-queries auto` (None): policy.REFINE_QUERIES_CPU on a CPU by the cache kept, every position on a GPU
    and wherever the window is not longer than the positions."""
    narrow, wide = policy.REFINE_QUERIES_CPU
    assert estimates.resolve_queries(None, 2048, 0.25, "cpu") == narrow > 0
    assert estimates.resolve_queries(None, 2048, 0.5, "cpu") == wide
    assert estimates.resolve_queries(None, 2048, 0.25, "cuda") == 0
    assert estimates.resolve_queries(None, narrow, 0.25, "cpu") == 0
    assert estimates.resolve_queries(64, 2048, 0.25, "cuda") == 64
    # the help text states the rule once where both budgets take the same value
    assert policy.rule_text((256, 256)) == "256 at every budget"
    assert policy.rule_text((256, 0)).startswith("256 where the MLA cache is under 37.5%")


def test_model_stage_brings_a_lossy_conversion_closer_to_the_source(sources, convert_tiny):
    """The model stage (`refine_model_steps`) trains the converted attention end to end to the source's next-token
    distributions: on text no calibration read the model is closer to the source; only attention tensors change
    (embeddings, MLPs and norms are the layers' as converted); the record says what the held-out window gained."""
    kind = "llama-gqa"
    src = AutoModelForCausalLM.from_pretrained(sources[kind], dtype=torch.float32).eval()
    lossy = dict(rank=4, rope_dims=4, calib_samples=16, calib_seq_len=64, refine_steps=0)
    plain = convert_tiny(sources[kind], refine_model_steps=0, **lossy)
    staged = convert_tiny(sources[kind], refine_model_steps=60, refine_model_lr=3e-3, **lossy)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sources[kind])
    ids = tok(tiny_text(600, seed=9), return_tensors="pt").input_ids[:, :128]
    assert _kl_to_source(src, staged, ids) < 0.9 * _kl_to_source(src, plain, ids)
    record = _plan(staged)["refine_model"]
    assert record["kept"] and record["after"] < record["before"]
    assert _plan(plain)["refine_model"] == {}  # not run: nothing recorded
    a, b = _weights(plain), _weights(staged)
    assert a.keys() == b.keys()
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert changed and all(".self_attn." in k for k in changed)
    assert 0 < record["step"] <= 60 and [s for s, _ in record["curve"]][-1] == 60
    assert f"(kept, the weights after step {record['step']})" in (staged / "README.md").read_text()


def test_model_stage_layer_scope_trains_whole_layers_only(sources, convert_tiny):
    """`refine_model_scope="layer"`: the stage trains every decoder layer whole (attention, MLP and norms, written to
    the shards as trained), never the embeddings, the final norm or the head; the method line says so."""
    kind = "llama-gqa"
    src = AutoModelForCausalLM.from_pretrained(sources[kind], dtype=torch.float32).eval()
    lossy = dict(rank=4, rope_dims=4, calib_samples=16, calib_seq_len=64, refine_steps=0)
    plain = convert_tiny(sources[kind], refine_model_steps=0, **lossy)
    staged = convert_tiny(sources[kind], refine_model_steps=60, refine_model_lr=3e-3, refine_model_scope="layer",
                          **lossy)
    record = _plan(staged)["refine_model"]
    assert record["kept"] and record["after"] < record["before"]
    a, b = _weights(plain), _weights(staged)
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert any(".mlp." in k for k in changed) and any(".self_attn." in k for k in changed)
    assert any("layernorm" in k for k in changed)
    assert all(".layers." in k for k in changed), changed - {k for k in changed if ".layers." in k}
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(sources[kind])(tiny_text(600, seed=9), return_tensors="pt").input_ids[:, :128]
    assert _kl_to_source(src, staged, ids) < _kl_to_source(src, plain, ids)
    provenance = json.loads((staged / "provenance.json").read_text())
    assert provenance["options"]["refine_model_scope"] == "layer"
    assert "every whole layer trained 60 steps end to end" in provenance["method"]
    assert record["scope"] == "layer" and "every decoder layer trained end to end" in (staged / "README.md").read_text()


def test_model_stage_restores_the_weights_when_the_held_out_kl_does_not_drop(sources, convert_tiny):
    """A stage that makes the held-out window worse (a learning rate that diverges) is not kept: the output is the
    conversion without it, bit for bit."""
    lossy = dict(rank=4, rope_dims=4, calib_samples=4, calib_seq_len=32, refine_steps=0)
    plain = convert_tiny(sources["llama-gqa"], refine_model_steps=0, **lossy)
    diverged = convert_tiny(sources["llama-gqa"], refine_model_steps=8, refine_model_lr=10.0, **lossy)
    record = _plan(diverged)["refine_model"]
    assert not record["kept"] and record["after"] >= record["before"]
    a, b = _weights(plain), _weights(diverged)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_auto_model_steps_follow_the_estimated_cost(caplog, monkeypatch):
    small = _shaped_plan(30, 576, 9, 3, 64, 64, 32, 1536)  # SmolLM2-135M at 25%
    small.memory["vocab"] = 49152
    big = _shaped_plan(32, 4096, 32, 8, 128, 512, 64, 14336)  # Llama-3-8B shapes
    big.memory["vocab"] = 128256
    narrow, wide = policy.MODEL_STEPS_CPU
    assert 0 < estimates.estimate_model_seconds(small, narrow) <= estimates.AUTO_MODEL_CPU_SECONDS
    assert estimates.resolve_model_steps(None, small, "cpu", refine_layer.SEQ_LEN) == narrow < model_stage.MODEL_STEPS  # 25%
    assert estimates.resolve_model_steps(None, small, "cuda", refine_layer.SEQ_LEN) == model_stage.MODEL_STEPS
    half = _shaped_plan(30, 576, 9, 3, 64, 144, 48, 1536, nope_dims=64)  # SmolLM2-135M at 50%
    half.memory["vocab"] = 49152
    assert estimates.resolve_model_steps(None, half, "cpu", refine_layer.SEQ_LEN) == wide
    with caplog.at_level(logging.WARNING, logger="mla_convert.conversion.estimates"):
        assert estimates.resolve_model_steps(None, big, "cpu", refine_layer.SEQ_LEN) == 0
    assert "--refine-model-steps" in caplog.text
    big_half = _shaped_plan(32, 4096, 32, 8, 128, 960, 64, 14336, nope_dims=64)  # 8B at 50%: the wide steps too long
    big_half.memory["vocab"] = 128256
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mla_convert.conversion.estimates"):
        assert estimates.resolve_model_steps(None, big_half, "cpu", refine_layer.SEQ_LEN) == 0 < wide
    assert f"--refine-model-steps {wide}" in caplog.text
    monkeypatch.setattr(policy, "MODEL_STEPS_CPU", (narrow, 0))  # a CPU default of none at the wide budget
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mla_convert.conversion.estimates"):
        assert estimates.resolve_model_steps(None, big_half, "cpu", refine_layer.SEQ_LEN) == 0
    assert "model stage" not in caplog.text  # nothing to skip: no warning offering "--refine-model-steps 0"
    assert estimates.resolve_model_steps(None, big, "cuda", refine_layer.SEQ_LEN) == model_stage.MODEL_STEPS
    assert estimates.resolve_model_steps(5, big, "cpu", refine_layer.SEQ_LEN) == 5
    # the rate follows the stage's length unless given
    assert estimates.resolve_model_lr(None, model_stage.MODEL_STEPS) == model_stage.MODEL_LR
    assert estimates.resolve_model_lr(None, narrow) == model_stage.SHORT_MODEL_LR > model_stage.MODEL_LR
    assert estimates.resolve_model_lr(3e-5, narrow) == 3e-5
    help_text = next(o.help for o in OPTIONS if o.name == "refine_model_lr")  # says the same rule
    assert [float(x) for x in re.findall(r"\d+e-\d+", help_text)] == [model_stage.MODEL_LR, model_stage.SHORT_MODEL_LR]
    assert f"for {model_stage.MODEL_STEPS} steps or more" in help_text
    # the stage holds the whole model: an 8B model's float32 copy alone is over 30 GB
    assert estimates.model_stage_bytes(big) > 30e9 > estimates.model_stage_bytes(small)


class _SpoilsLate(torch.optim.Adam):
    """Adam that, after its first `good` steps, adds large noise to every weight it trains: a run whose later weights
    are certainly worse than its earlier ones, whatever the numerics of the machine that runs it."""

    good = 8

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        self.taken, self.noise = 0, torch.Generator().manual_seed(0)

    @torch.no_grad()
    def step(self, closure=None):
        super().step(closure)
        self.taken += 1
        if self.taken > self.good:
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(torch.randn(p.shape, generator=self.noise), alpha=0.5)


def _stage_inputs(sources, convert_tiny, windows: int, seed: int):
    """(a tiny converted folder without refinement, `windows` random 48-token windows, the source's final hidden
    states on them): the model stage's inputs in its tests."""
    src = AutoModelForCausalLM.from_pretrained(sources["llama-gqa"], dtype=torch.float32).eval()
    folder = convert_tiny(sources["llama-gqa"], rank=4, rope_dims=4, refine_steps=0, refine_model_steps=0)
    ids = torch.randint(0, src.config.vocab_size, (windows, 48), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        teacher = torch.cat([src.model(input_ids=x[None]).last_hidden_state for x in ids])
    return folder, ids, teacher


def test_model_stage_keeps_the_best_weights_it_checked(sources, convert_tiny, monkeypatch):
    """The stage checks the held-out window MODEL_CHECKS times and keeps the best weights seen: what the model holds
    afterwards scores exactly the record's `after`, the lowest of the checks (or the converted weights' own, if no
    check beat them), and a run that goes wrong late in training does not cost what it gained early."""
    folder, ids, teacher = _stage_inputs(sources, convert_tiny, 5, 3)
    adam = torch.optim.Adam
    for lr, steps, spoiled in ((3e-3, 16, False), (3e-3, 16, True), (1e-2, 5, False)):
        monkeypatch.setattr(torch.optim, "Adam", _SpoilsLate if spoiled else adam)
        mla = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        record = model_stage.refine_model(mla, ids, teacher, steps, lr=lr)
        checks = [kl for _, kl in record["curve"]]
        every = max(1, steps // model_stage.MODEL_CHECKS)
        assert [s for s, _ in record["curve"]] == [s for s in range(1, steps + 1) if s % every == 0 or s == steps]
        assert record["curve"][-1][0] == steps and record["last"] == checks[-1]
        assert record["after"] == min([record["before"], *checks])
        assert record["kept"] == (record["after"] < record["before"])
        assert model_stage.model_kl(mla, ids[-1:], teacher[-1:]) == pytest.approx(record["after"], rel=1e-6)
        if record["kept"]:
            assert dict(record["curve"])[record["step"]] == record["after"]
        if spoiled:  # the best check came before the noise: the later weights were dropped
            assert record["kept"] and record["step"] <= _SpoilsLate.good and record["last"] > record["after"]


def test_model_stage_forms_teacher_terms_of_the_windows_it_reads(sources, convert_tiny, monkeypatch):
    """The teacher's terms are formed for the held-out window and for each window a step draws, once each: a short
    stage over many windows forms few. A window's terms formed alone are those formed with the others."""
    folder, ids, teacher = _stage_inputs(sources, convert_tiny, 12, 4)
    mla = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    together = model_stage.teacher_terms(mla, teacher)
    for i in range(len(ids)):
        torch.testing.assert_close(model_stage.teacher_terms(mla, teacher[i]), together[i], rtol=1e-6, atol=1e-7)
    formed, real = [], model_stage.teacher_terms
    monkeypatch.setattr(model_stage, "teacher_terms", lambda m, t: formed.append(t.shape[0] if t.dim() == 3 else 1)
                        or real(m, t))
    gen = torch.Generator().manual_seed(0)  # the stage's window draw, replayed
    drawn = {int(torch.randint(0, len(ids) - 1, (1,), generator=gen)) for _ in range(3)}
    record = model_stage.refine_model(mla, ids, teacher, 3, lr=3e-3)
    assert sum(formed) == 1 + len(drawn) < len(ids) and len(record["curve"]) == 3


@pytest.mark.parametrize("bias", [False, True])
def test_kl_from_teacher_terms_is_the_kl_of_the_teachers_logits(bias):
    """`teacher_terms` (the teacher's expected head row and constant, formed once) give the KL of the head's
    distributions at the teacher's and the student's hidden states, and its gradient, as forming both logits does;
    with a bias in the head too. Positions span more than one LOGIT_CHUNK."""
    gen = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(16, 50, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(50, 16, generator=gen))
        if bias:
            head.bias.copy_(torch.randn(50, generator=gen))
    model = types.SimpleNamespace(get_output_embeddings=lambda: head)
    count = model_stage.LOGIT_CHUNK + 7
    teacher, hidden = torch.randn(2, count, 16, generator=gen), torch.randn(count, 16, generator=gen)
    terms = model_stage.teacher_terms(model, teacher)
    assert terms.shape == (2, count, 17)
    leaf = hidden.clone().requires_grad_(True)
    total = model_stage._kl_chunks(model, leaf, terms[1], backward=True)
    reference = hidden.clone().requires_grad_(True)
    direct = torch.nn.functional.kl_div(torch.log_softmax(head(reference), -1), torch.log_softmax(head(teacher[1]), -1),
                                        log_target=True, reduction="sum")
    (direct / count).backward()
    assert total == pytest.approx(direct.item(), rel=1e-5)
    torch.testing.assert_close(leaf.grad, reference.grad, rtol=1e-4, atol=1e-6)
    # where the student is the teacher, nothing is left
    assert model_stage._kl_chunks(model, teacher[0], terms[0], backward=False) == pytest.approx(0.0, abs=1e-3)


def test_model_stage_at_chosen_positions(sources, convert_tiny, monkeypatch):
    """`positions`: a step's KL (and the head's logits) at that many random positions of its window, every layer
    still at every position; the held-out checks at every position. It trains, and its gradient is the mean KL's at
    the positions drawn."""
    folder, ids, teacher = _stage_inputs(sources, convert_tiny, 5, 3)
    rows, real = [], model_stage._kl_chunks
    monkeypatch.setattr(model_stage, "_kl_chunks", lambda m, h, t, backward, **kw: rows.append((h.shape[0], backward))
                        or real(m, h, t, backward, **kw))
    mla = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    record = model_stage.refine_model(mla, ids, teacher, 8, lr=3e-3, positions=12)
    assert {r for r, backward in rows if backward} == {12} and {r for r, backward in rows if not backward} == {48}
    assert record["kept"] and record["after"] < record["before"]
    # one step's gradient is that of the mean KL over the drawn positions (the draw replayed with the same seed)
    monkeypatch.setattr(model_stage, "_kl_chunks", real)
    mla = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    grads = {}
    monkeypatch.setattr(torch.optim.Adam, "step", lambda self, closure=None: grads.update(
        {id(p): p.grad.clone() for g in self.param_groups for p in g["params"]}))
    model_stage.refine_model(mla, ids, teacher, 1, lr=3e-3, positions=12)
    row = int(torch.randint(0, 4, (1,), generator=torch.Generator().manual_seed(0)))
    at = torch.randperm(48, generator=torch.Generator().manual_seed(1))[:12].sort().values
    names = set(model_stage.model_parameter_names(mla))
    params = [p for n, p in mla.named_parameters() if n in names]
    for p in params:
        p.requires_grad_(True)
    hidden = model_stage.final_hidden(mla, ids[row])[at]
    logp = torch.log_softmax(mla.lm_head(hidden), -1)
    target = torch.log_softmax(mla.lm_head(teacher[row][at]), -1)
    torch.nn.functional.kl_div(logp, target, log_target=True, reduction="batchmean").backward()
    assert all(torch.allclose(grads[id(p)], p.grad, rtol=1e-4, atol=1e-7) for p in params)


def test_model_stage_on_the_top_layers_trains_them_alone(sources, convert_tiny):
    """`refine_model(top=K)`: the frozen layers' outputs, computed once, carried through the layers above give the
    whole model's KL; only the last K layers' attention changes; the record's `after` is what the whole model scores
    afterwards."""
    folder, ids, teacher = _stage_inputs(sources, convert_tiny, 5, 4)
    mla = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    n = len(mla.model.layers)
    assert n >= 2
    below = model_stage.frozen_outputs(mla, ids, n - 1)
    assert below.shape == (*ids.shape, mla.config.hidden_size)
    assert model_stage.model_kl(mla, ids, teacher, below, n - 1) == pytest.approx(model_stage.model_kl(mla, ids, teacher), rel=1e-5)
    start = {k: v.clone() for k, v in mla.state_dict().items()}
    for top in (0, n + 1):
        with pytest.raises(ValueError, match="last 1 to"):
            model_stage.refine_model(mla, ids, teacher, 8, top=top)
    bottom_calls = []
    mla.model.layers[0].register_forward_hook(lambda *_: bottom_calls.append(1))
    record = model_stage.refine_model(mla, ids, teacher, 8, lr=3e-3, top=1, seq_len=40)
    assert len(bottom_calls) == len(ids)  # the frozen layers ran once a window, not once a step
    assert record["kept"] and record["after"] < record["before"]
    changed = {k for k, v in mla.state_dict().items() if not torch.equal(v, start[k])}
    assert changed and all(k.startswith(f"model.layers.{n - 1}.self_attn.") for k in changed)
    assert len(mla.model.layers) == n  # the whole decoder again after the stage
    assert model_stage.model_kl(mla, ids[-1:], teacher[-1:]) == pytest.approx(record["after"], rel=1e-5)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_update_at_chosen_positions_is_the_whole_windows_update_there(sources, convert_tiny, name):
    """`refine_layer.layer_update_at` (the loss at some of a window's positions, `--refine-queries`) gives the whole
    window's layer update at those positions, and the same gradients as the whole window's loss taken there."""
    if name not in sources:
        pytest.skip(f"no tiny {name} source")
    folder = convert_tiny(sources[name], rank=4, rope_dims=4, refine_steps=0, refine_model_steps=0)
    mla = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    layer, rotary = mla.model.layers[1], mla.model.rotary_emb
    assert refine_layer.subset_supported(layer)
    x = torch.randn(2, 24, mla.config.hidden_size, generator=torch.Generator().manual_seed(0))
    pe = rotary(x, torch.arange(24)[None].expand(2, -1))
    index = torch.tensor([0, 3, 4, 11, 23])
    grads = []
    for at in (True, False):
        layer.zero_grad()
        out = refine_layer.layer_update_at(layer, x, pe, index) if at else refine_layer.layer_update(layer, x, pe)[:, index]
        out.pow(2).sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in layer.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(grads[0][1], grads[1][1]):  # float32 sums in another order: equal to the gradients' rounding
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * max(1.0, b.abs().max().item()))
