#!/usr/bin/env bash
# The checks that need a GPU, as one short run for a lent CUDA machine (where nothing can be installed or fetched):
#   1. the CUDA tests (`-m gpu`: the Triton kernel against the float32 reference at the converter's shapes, the
#      model's decode through it, the CUDA-graph decode step, a conversion with --device cuda);
#   2. an 8B-shaped conversion with --device cuda (benchmarks/scale/run.py: random weights, Llama-3-8B shapes,
#      LAYERS layers, calibrated on 1 x 512 tokens, default refinement and model stage);
#   3. the whole-model decode benchmark and the kernel table at the converter's default 25% shape, then at 50%
#      (d_c 144, d_r 48; benchmarks/decode/run.py).
# Each step has its own time limit, and a step that fails or runs out does not stop the next. Everything it writes
# goes to OUTDIR: log.txt, scale.json / scale.md (benchmarks/scale/ with the new row merged, only when the conversion
# finished), decode_gpu_<gpu>.md/.json and decode_gpu_<gpu>_half.md/.json. LAYERS=32 needs SCALE_LIMIT of about 720
# (the per-layer times it is sized from: benchmarks/scale/README.md).
#
#   bash scripts/gpu_checks.sh OUTDIR [TOKENIZER_DIR CALIB_FILE]
#
# TOKENIZER_DIR and CALIB_FILE stand in for the embedded SmolLM2-135M's tokenizer and ../shared's WikiText-2
# validation text on a machine that has neither (save the tokenizer with `save_pretrained`, copy the text, carry both).
set -u
out=${1:?usage: bash scripts/gpu_checks.sh OUTDIR [TOKENIZER_DIR CALIB_FILE]}
tokenizer=${2:-}
calib=${3:-}
py=${PYTHON:-python3}
layers=${LAYERS:-4}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
exec > >(tee -a "$out/log.txt") 2>&1

. "$(dirname "$0")/step.sh"

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)"

step "CUDA tests" "${TEST_LIMIT:-240}" $py -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_scale.py

extra=()
[ -n "$tokenizer" ] && extra+=(--tokenizer "$tokenizer")
[ -n "$calib" ] && extra+=(--calib-file "$calib")
step "8B-shaped conversion, $layers layers, --device cuda" "${SCALE_LIMIT:-240}" \
    $py benchmarks/scale/run.py run llama3-8b --layers "$layers" --device cuda ${extra[@]+"${extra[@]}"} &&
    cp benchmarks/scale/scale.json "$out/" && cp benchmarks/scale/README.md "$out/scale.md"

gpu=$($py -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower())" 2>/dev/null || echo gpu)
decode=($py benchmarks/decode/run.py --device cuda --skip-layer --model-contexts 1k,8k,32k --model-batches 1,8,32
        --model-budget "${MODEL_BUDGET:-0.5}")
step "whole-model decode, 25%" "${DECODE_LIMIT:-200}" "${decode[@]}" \
    --out "$out/decode_gpu_$gpu.md" --json "$out/decode_gpu_$gpu.json"
step "whole-model decode, 50%" "${DECODE_LIMIT:-200}" "${decode[@]}" --d-c 144 --d-r 48 \
    --out "$out/decode_gpu_${gpu}_half.md" --json "$out/decode_gpu_${gpu}_half.json"
echo "=== done after ${SECONDS}s"
