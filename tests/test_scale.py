"""Conversions at scale: unchanged tensors copied through byte for byte in their own dtype, the memory estimate's
shape (depth costs nothing), --device plumbing, per-layer timings in the progress output."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from conftest import assert_user_error
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import tiny_source
from transformers import AutoModelForCausalLM
from typer.testing import CliRunner

import mla_convert  # noqa: F401
from mla_convert import policy
from mla_convert.checkpoint import open_source
from mla_convert.outputs import ShardedWriter
from mla_convert.cli import app
from mla_convert.convert import ConvertOptions, convert, max_rank


def as_bfloat16(folder: Path) -> Path:
    """Rewrite a saved tiny model's tensors (and its config's dtype) as bfloat16."""
    for f in folder.glob("*.safetensors"):
        save_file({k: v.bfloat16() for k, v in load_file(f).items()}, str(f), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def tensors_as_stored(folder: Path) -> dict[str, tuple[torch.dtype, bytes]]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as g:
            for name in g.keys():
                t = g.get_tensor(name)
                out[name] = (t.dtype, t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.fixture(scope="module")
def bf16_source(tmp_path_factory) -> Path:
    return as_bfloat16(tiny_source("qwen2", tmp_path_factory.mktemp("bf16") / "src", seed=3, num_hidden_layers=3))


@pytest.mark.parametrize("propagate", ["source", "converted"])
def test_unchanged_tensors_pass_through_byte_identical(bf16_source, calib_text, tmp_path, monkeypatch, propagate):
    """Embeddings, norms, MLP and lm_head of a bfloat16 source: the same bytes in the output, and handed to the shard
    writer as bfloat16 (never made float32 on the way)."""
    arriving: dict[str, torch.dtype] = {}
    add = ShardedWriter.add

    def recording_add(self, name, tensor):
        arriving[name] = tensor.dtype
        add(self, name, tensor)

    monkeypatch.setattr(ShardedWriter, "add", recording_add)
    options = ConvertOptions(kv_budget=0.5, calib_data=str(calib_text), calib_samples=2, calib_seq_len=32,
                             calib_propagate=propagate)  # fmt: skip
    convert(open_source(str(bf16_source)), tmp_path / "out", options, progress=False)
    before, after = tensors_as_stored(bf16_source), tensors_as_stored(tmp_path / "out")
    unchanged = [n for n in before if ".self_attn." not in n]
    assert len(unchanged) == 3 + 5 * 3  # embed, final norm, lm_head; two norms and three MLP maps per layer
    for name in unchanged:
        assert after[name] == before[name], name
        if propagate == "source":  # kept layers are float32 when the converted layers carry the activations on
            assert arriving[name] == torch.bfloat16, name
    assert all(after[n][0] == torch.bfloat16 for n in after)


def test_device_auto_and_cpu_write_the_default_bytes(sources, calib_text, tmp_path):
    """--device cpu writes what the default writes; --device auto on a machine without CUDA is cpu, recorded so."""
    calib = ["--calib-data", str(calib_text), "--calib-samples", "2", "--calib-seq-len", "32", "-q"]
    runs = {"default": [], "cpu": ["--device", "cpu"]}
    if not torch.cuda.is_available():
        runs["auto"] = ["--device", "auto"]
    for name, extra in runs.items():
        result = CliRunner().invoke(app, ["llama", str(sources["llama-gqa"]), "--rank", "16", "-o",
                                          str(tmp_path / name), *calib, *extra])  # fmt: skip
        assert result.exit_code == 0, result.output
    reference = tensors_as_stored(tmp_path / "default")
    for name in runs:
        assert tensors_as_stored(tmp_path / name) == reference
        assert json.loads((tmp_path / name / "provenance.json").read_text())["options"]["device"] == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_device_cuda_without_cuda_is_refused(sources, tmp_path):
    result = CliRunner().invoke(app, ["llama", str(sources["llama-gqa"]), "--rank", "16", "--device", "cuda",
                                      "--calib-data", "none", "-o", str(tmp_path / "out")])  # fmt: skip
    assert_user_error(result.exit_code, result.output, "no CUDA device", "--device cpu")
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_conversion_is_exact_at_full_rank_and_matches_cpu(sources, convert_tiny):
    """Each layer calibrated and factorized on the GPU: exact at full rank, and a lossy conversion close to the CPU's."""
    src = AutoModelForCausalLM.from_pretrained(sources["llama-gqa"], dtype=torch.float32).eval()
    config = src.config
    full = dict(rank=max_rank(config), rope_dims=config.num_key_value_heads * config.head_dim, force=True)
    ids = torch.randint(3, 300, (2, 24), generator=torch.Generator().manual_seed(0))
    mla = AutoModelForCausalLM.from_pretrained(convert_tiny(sources["llama-gqa"], device="cuda", **full)).eval()
    with torch.no_grad():
        reference = src(ids).logits
        assert ((mla(ids).logits - reference).abs().max() / reference.abs().max()).item() < 1e-4
    # lossy: the same model up to float64 rounding (compared by logits: a latent direction may come out negated), the
    # refinement pinned to the same schedule (a CPU's auto schedule is its own)
    logits, schedule = [], dict(refine_steps=200, refine_queries=0, refine_model_steps=64)
    for device in ("cpu", "cuda"):
        model = AutoModelForCausalLM.from_pretrained(convert_tiny(sources["llama-gqa"], rank=16, device=device,
                                                                  **schedule)).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert ((logits[0] - logits[1]).abs().max() / logits[0].abs().max()).item() < 1e-3


def plan_for(tmp_path: Path, calib_text: Path, layers: int, **options):
    src = tiny_source("llama-gqa", tmp_path / f"src-{layers}", num_hidden_layers=layers)
    # the layer stream alone unless asked: the model stage holds the whole model (test below)
    params = dict(rank=16, calib_data=str(calib_text), calib_samples=2, calib_seq_len=64, refine_model_steps=0) | options
    return convert(open_source(str(src)), tmp_path / "never", ConvertOptions(**params), dry_run=True)


def test_memory_estimate_does_not_grow_with_depth(tmp_path, calib_text, monkeypatch):
    """Layers stream one at a time: 8 layers cost what 2 cost, with either rank allocation (energy keeps only each
    layer's spectrum from its statistics pass). Shards as small as a tiny model's: the writer holds one shard, not the
    whole checkpoint, as at full size. The one part that grows, by design: the hidden states the energy allocation's
    statistics pass keeps for the conversion pass where every layer's fit plan.KEEP_HIDDEN_BYTES and a quarter of the
    machine's memory (a small model's); a large model's do not, as here with either limit too low."""
    monkeypatch.setattr("mla_convert.conversion.plan.SHARD_BYTES", 4096)
    kept = [plan_for(tmp_path, calib_text, n).memory_parts() for n in (2, 8)]
    part = "hidden states kept from the statistics pass"
    assert kept[1][part] == 4 * kept[0][part] == 8 * 2 * 64 * 64 * 4  # layers x tokens x hidden x float32
    monkeypatch.setattr("mla_convert.conversion.estimates.machine_bytes", lambda: 4 * kept[1][part] - 1)  # a quarter too little
    assert part in plan_for(tmp_path, calib_text, 2).memory_parts()
    assert part not in plan_for(tmp_path, calib_text, 8).memory_parts()
    monkeypatch.setattr("mla_convert.conversion.plan.KEEP_HIDDEN_BYTES", 0)
    two, eight = plan_for(tmp_path, calib_text, 2), plan_for(tmp_path, calib_text, 8)
    assert two.memory_estimate() == eight.memory_estimate() > 0
    for allocation in ("energy", "uniform"):
        ours = [plan_for(tmp_path, calib_text, n, rank_allocation=allocation).memory_estimate() for n in (2, 8)]
        assert ours[0] == ours[1] == two.memory_estimate()
    longer = plan_for(tmp_path, calib_text, 2, calib_samples=64, calib_seq_len=256)
    assert longer.memory_estimate() > two.memory_estimate()  # more calibration tokens: more hidden states
    none = plan_for(tmp_path, calib_text, 2, calib_data=None)
    assert none.memory_parts()["calibration hidden states"] == 0 < longer.memory_parts()["calibration hidden states"]


def test_model_stage_memory_is_the_whole_model(tmp_path, calib_text):
    """The model stage holds the whole converted model: where it runs (auto, on a tiny model at a narrow budget) the
    estimate shows it and grows with depth; without it the streamed estimate stays."""
    staged = [plan_for(tmp_path, calib_text, n, rank=8, refine_model_steps=None) for n in (2, 8)]
    assert all(p.refine_model_steps > 0 and "model stage" in p.memory_parts() for p in staged)
    assert staged[1].memory_estimate() > staged[0].memory_estimate()
    assert staged[0].memory_parts()["model stage"] > 0
    assert "model stage" not in plan_for(tmp_path, calib_text, 8).memory_parts()


def test_dry_run_prints_the_estimate_and_its_parts(sources, calib_text, monkeypatch):
    args = ["llama", str(sources["llama-gqa"]), "--rank", "8", "--dry-run", "--calib-data", str(calib_text)]
    result = CliRunner().invoke(app, [*args, "--refine-model-steps", "0"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if "estimated peak memory" in line)
    assert "runtime" in line and "one layer's working set" in line and "GiB" in line
    assert "hidden states kept from the statistics pass" in line  # a tiny model's fit plan.KEEP_HIDDEN_BYTES
    monkeypatch.setattr("mla_convert.conversion.plan.KEEP_HIDDEN_BYTES", 0)  # as a large model's: none kept
    result = CliRunner().invoke(app, args)  # auto runs the model stage on this tiny model (25%): its memory is shown
    line = next(line for line in result.output.splitlines() if "estimated peak memory" in line)
    assert "model stage" in line and f"model stage: {policy.MODEL_STEPS_CPU[0]} steps" in result.output


def test_progress_reports_each_layers_calibration_and_factorization(sources, convert_tiny, caplog):
    with caplog.at_level(logging.INFO, logger="mla_convert.convert"):
        convert_tiny(sources["llama-gqa"], rank=16)
    timings = [r.getMessage() for r in caplog.records if r.getMessage().startswith("layer ")]
    assert [t.split(":")[0] for t in timings] == ["layer 0", "layer 1"]
    assert all("calibration" in t and "factorization" in t and "refine" in t for t in timings)  # refined by default
