#!/usr/bin/env bash
# The test suite on CPU: tiny models for exactness and I/O, the real SmolLM2-135M for the slow tests, and the Triton
# kernel under the interpreter (TRITON_INTERPRET=1 is set by the kernel tests themselves). GPU tests skip without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest -q --durations=10 "$@"
