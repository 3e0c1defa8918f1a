"""What scripts/bench_scale.py reads from a conversion's output: the plan's steps and time estimate, each refined
layer's seconds and held-out error (a worker's too), and the report's per-layer column."""

import pytest
from conftest import load_script

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


@pytest.fixture(scope="module")
def bench_scale():
    return load_script("bench_scale")


def test_plan_steps_and_time_estimate(bench_scale):
    plan = bench_scale.parse_plan(OUTPUT)
    assert plan["refine_steps"] == [200, 1]
    assert plan["time_estimate"] == "42 min (calibration 12, refinement 10, model stage 20 min)"
    assert plan["estimate_gib"] == 12.78
    assert plan["attn_params"] == [83886080, 72679424]
    assert bench_scale.parse_plan("nothing printed")["time_estimate"] is None


def test_refined_layers_come_from_their_own_lines(bench_scale):
    refined = bench_scale.refined_layers(OUTPUT)
    assert refined["refine_seconds"] == {0: 553.2, 1: 525.9}
    assert refined["refine_error"] == {0: [0.4969, 29.42], 1: [0.02232, 0.0187]}


@pytest.mark.parametrize("kept", ["kept", "not kept"])
def test_the_line_read_is_the_one_the_conversion_writes(bench_scale, kept):
    from mla_convert.conversion import refine_layer

    line = refine_layer.REFINED_LINE % (3, 0.5, 1.0 / 3, kept, 12.34)
    assert bench_scale.refined_layers(line) == {"refine_seconds": {3: 12.3}, "refine_error": {3: [0.5, 0.3333]}}


def test_the_last_layer_column_takes_the_refinement_from_its_line(bench_scale):
    row = {"layer_seconds": ["calibration 238.9s, factorization 15.5s, refine 0.0s"],
           "refine_seconds": {"0": 553.2, "1": 525.9}}  # as read back from scale.json
    assert bench_scale.last_layer(row) == "calibration 238.9s, factorization 15.5s, refine 525.9s"
    older = {"layer_seconds": ["calibration 0.9s, factorization 0.1s, refine 12.8s"]}
    assert bench_scale.last_layer(older) == older["layer_seconds"][0]
