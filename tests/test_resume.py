"""A conversion killed with SIGKILL keeps the layers it finished; the same command resumes and writes the same bytes
as an uninterrupted run; other options start over; the staging folder is gone once the output is in place."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from mla_convert.cli import app
from tiny import tiny_source

# Runs the CLI and kills its own process (SIGKILL: no cleanup of any kind) right after layer KILL_AFTER_LAYER's file
# is written.
KILLER = """
import os, signal, sys
from mla_convert.conversion import store
after, write = int(os.environ["KILL_AFTER_LAYER"]), store.write_layer
def killing_write(path, *args):
    write(path, *args)
    if path.name == store.layer_file(after):
        os.kill(os.getpid(), signal.SIGKILL)
store.write_layer = killing_write
from mla_convert.cli import app
sys.argv[0] = "mla-convert"
app()
"""
OUTPUT_FILES = ("model.safetensors", "model.safetensors.index.json", "config.json")


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    return tiny_source("llama-gqa", tmp_path_factory.mktemp("resume") / "src", seed=3, num_hidden_layers=4)


def killed_run(args: list[str], after: int) -> subprocess.CompletedProcess:
    # the same thread count as this process: the fingerprint holds it (it changes the order of float sums)
    env = {**os.environ, "KILL_AFTER_LAYER": str(after), "OMP_NUM_THREADS": str(torch.get_num_threads()),
           "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-c", KILLER, *args], env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("propagate,after", [("source", 1), ("converted", 1), ("source", 3)])
def test_killed_conversion_resumes_to_the_same_bytes(four_layers, calib_text, tmp_path, propagate, after):
    """Killed after layer 1 (of 4), or after the last layer, before the model stage (which runs only along the
    source's stream): that stage then starts from the kept activations after the last layer."""
    common = ["llama", str(four_layers), "--kv-budget", "0.25", "--calib-data", str(calib_text), "--calib-samples", "3",
              "--calib-seq-len", "32", "--calib-propagate", propagate, "--dtype", "bfloat16", "-q"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert CliRunner().invoke(app, [*common, "-o", str(straight)]).exit_code == 0
    staged = json.loads((straight / "provenance.json").read_text())["plan"]["refine_model"]
    assert ("before" in staged) == (propagate == "source")  # auto runs the model stage where it can

    killed = killed_run([*common, "-o", str(resumed)], after=after)
    assert killed.returncode == -9, killed.stderr[-2000:]
    stage = tmp_path / ".resumed.incomplete"
    assert not resumed.exists()
    assert sorted(p.name for p in (stage / ".resume").glob("layer-*.safetensors")) == [
        f"layer-{i:05d}.safetensors" for i in range(after + 1)]
    assert all((stage / ".resume" / f"layer-{i:05d}.safetensors.sha256").is_file() for i in range(after + 1))  # sealed
    assert (stage / ".resume" / "activations.safetensors").is_file()  # the resume starts from them
    assert not (stage / ".resume" / "model_stage.safetensors").exists()

    result = CliRunner().invoke(app, [*common, "-o", str(resumed)])
    assert result.exit_code == 0, result.output
    assert f"{after + 1} of 4 layers were converted already" in result.output
    for name in OUTPUT_FILES:
        assert (resumed / name).read_bytes() == (straight / name).read_bytes(), name
    plans = [json.loads((folder / "provenance.json").read_text())["plan"] for folder in (straight, resumed)]
    again = plans[1]["refine_model"]
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in staged.items() if k != "seconds"}
    # the records of the layers the killed run converted come back from their files: the same record as straight
    assert len(plans[1]["refine"]) == 4 and [{k: v for k, v in p.items() if k != "refine_model"} for p in plans] == [
        {k: v for k, v in plans[0].items() if k != "refine_model"}] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["resumed", "straight"]  # staging folder gone
    assert not (resumed / ".resume").exists()


def test_other_options_start_over(four_layers, calib_text, tmp_path):
    common = ["llama", str(four_layers), "--calib-data", str(calib_text), "--calib-samples", "2", "--calib-seq-len",
              "32", "-q"]
    out = tmp_path / "out"
    assert killed_run([*common, "--rank", "8", "-o", str(out)], after=0).returncode == -9
    fresh = tmp_path / "fresh"
    assert CliRunner().invoke(app, [*common, "--rank", "12", "-o", str(fresh)]).exit_code == 0
    result = CliRunner().invoke(app, [*common, "--rank", "12", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "converted already" not in result.output  # the kept layer had rank 8: not reused
    for name in OUTPUT_FILES:
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "out"]
