#!/usr/bin/env bash
# llama.cpp in its own environment, ./.venv-llamacpp: llama-cpp-python (pinned), which builds llama.cpp from source for
# this CPU; pip's wheel cache keeps the build, so a re-run takes seconds. The GGUF export tests and
# benchmarks/llamacpp/run.py run llama.cpp through it (docs/serving.md). Idempotent.
#   The first build compiles llama.cpp (about an hour on 2 busy cores); CMAKE_BUILD_PARALLEL_LEVEL sets its jobs.
#   CMAKE_ARGS defaults to -DLLAVA_BUILD=OFF: the multimodal library (a third of the build) is never loaded here.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
[ -x .venv-llamacpp/bin/python ] || "$PY" -m venv .venv-llamacpp
. .venv-llamacpp/bin/activate
pip install -q --upgrade pip
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} CMAKE_ARGS=${CMAKE_ARGS--DLLAVA_BUILD=OFF}
pip install -q "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" numpy
python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
