"""What benchmarks/scale/run.py reads from a conversion's output (its `parse` command on a saved log): the plan's
steps and time estimate, each refined layer's seconds and held-out error (a worker's too), and the report's per-layer
column."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = """\
refining 2 layers at once, in worker processes of 1 thread(s)
layer 0: calibration 162.5s, factorization 11.2s, refine 0.0s
layer 1: calibration 238.9s, factorization 15.5s, refine 0.0s
refine: layer 0 held-out error 0.4969 -> 29.42 (not kept), 553.2 s
refine: layer 1 held-out error 0.02232 -> 0.0187 (kept), 525.9 s
attention parameters: 83,886,080 -> 72,679,424
refinement: 200 steps per layer (loss at 256 positions a window), 2 layers at once; model stage: 1 step; training
time on this CPU (2 threads): about 42 min (calibration 12, refinement 10, model stage 20 min)
source size 2836 MiB; estimated peak memory 12.78 GiB (x1.15 of: runtime 0.60)
"""


def parse(tmp_path: Path, output: str) -> dict:
    log = tmp_path / "conversion.log"
    log.write_text(output)
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scale" / "run.py"), "parse", str(log)],
                          capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_plan_steps_and_time_estimate(tmp_path):
    row = parse(tmp_path, OUTPUT)
    assert row["refine_steps"] == [200, 1]
    assert row["time_estimate"] == "42 min (calibration 12, refinement 10, model stage 20 min)"
    assert row["estimate_gib"] == 12.78
    assert row["attn_params"] == [83886080, 72679424]
    assert parse(tmp_path, "nothing printed")["time_estimate"] is None


def test_refined_layers_come_from_their_own_lines(tmp_path):
    row = parse(tmp_path, OUTPUT)
    assert row["refine_seconds"] == {"0": 553.2, "1": 525.9}
    assert row["refine_error"] == {"0": [0.4969, 29.42], "1": [0.02232, 0.0187]}


@pytest.mark.parametrize("kept", ["kept", "not kept"])
def test_the_line_read_is_the_one_the_conversion_writes(tmp_path, kept):
    from mla_convert.conversion import refine_layer

    line = refine_layer.REFINED_LINE % (3, 0.5, 1.0 / 3, kept, 12.34)
    row = parse(tmp_path, line + "\n")
    assert (row["refine_seconds"], row["refine_error"]) == ({"3": 12.3}, {"3": [0.5, 0.3333]})


def test_the_last_layer_column_takes_the_refinement_from_its_line(tmp_path):
    assert parse(tmp_path, OUTPUT)["last_layer"] == "calibration 238.9s, factorization 15.5s, refine 525.9s"
    older = "layer 0: calibration 0.9s, factorization 0.1s, refine 12.8s\n"  # no refined layer's own line
    assert parse(tmp_path, older)["last_layer"] == "calibration 0.9s, factorization 0.1s, refine 12.8s"
