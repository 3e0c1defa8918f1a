"""The benchmark's baselines (benchmarks/quality/run.py) are their papers' closed forms: the options they pass to
`mla-convert llama` plan none of this project's refinement, whatever the CLI's defaults become. The options are read
from the benchmark's command (`--print-options`), as a reader reproducing a row would read them."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mla_convert.cli import app

ROOT = Path(__file__).resolve().parents[1]


def method_options(method: str, budget: int) -> list[str]:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality" / "run.py"), "--print-options",
                           "--methods", method, "--budgets", str(budget)], capture_output=True, text=True, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    (line,) = proc.stdout.splitlines()
    label, options = line.split(": ", 1)
    assert label == f"{method} {budget}", line
    return shlex.split(options)


@pytest.mark.parametrize("method", ["transmla", "mla-convert"])
def test_baseline_plans_no_refinement(sources, method):
    """The tiny llama-gqa source caches 64 elements per token per layer; at 16 (a narrow budget) the default plans
    both refinement stages on this CPU, and the TransMLA-style baseline neither."""
    options = method_options(method, 16)
    result = CliRunner().invoke(app, ["llama", str(sources["llama-gqa"]), "--dry-run", "--calib-data", "self",
                                      *options])  # fmt: skip
    assert result.exit_code == 0, result.output
    line = next(line for line in result.output.splitlines() if line.startswith("refinement:"))
    if method == "transmla":
        assert line.startswith("refinement: 0 steps per layer; model stage: 0 steps"), line
    else:
        assert "refinement: 0 steps" not in line and "model stage: 0 steps" not in line, line
