"""The benchmark's baselines (benchmarks/quality/run.py) are their papers' closed forms: the options they pass to
`mla-convert llama` plan none of this project's refinement, whatever the CLI's defaults become."""

from __future__ import annotations

import pytest
from conftest import load_script
from typer.testing import CliRunner

from mla_convert.cli import app


def _bench_quality():
    return load_script("bench_quality")


@pytest.mark.parametrize("method", ["transmla", "mla-convert"])
def test_baseline_plans_no_refinement(sources, method):
    """The tiny llama-gqa source caches 64 elements per token per layer; at 16 (a narrow budget) the default plans
    both refinement stages on this CPU, and the TransMLA-style baseline neither."""
    options = _bench_quality().method_options(method, 16)
    result = CliRunner().invoke(app, ["llama", str(sources["llama-gqa"]), "--dry-run", "--calib-data", "self",
                                      *options])  # fmt: skip
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("refinement:"))
    if method == "transmla":
        assert line.startswith("refinement: 0 steps per layer; model stage: 0 steps"), line
    else:
        assert "refinement: 0 steps" not in line and "model stage: 0 steps" not in line, line
