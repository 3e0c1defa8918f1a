#!/usr/bin/env bash
# The main job on the embedded default (SmolLM2-135M-Instruct): convert to 25% of its KV cache with data-free
# calibration (text sampled from the model itself: no data set needed; cached under ~/.cache/mla-convert), then
# measure perplexity on the WikiText-2 test text (16 x 2048-token windows) for source and result.
# Usage: bash scripts/main.sh [OUT] [extra convert options...]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-out/smollm2-135m-mla-25}
shift || true
DATA=${SHARED:-../shared}/data/wikitext-2
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
MLA=.venv/bin/mla-convert
$MLA llama --kv-budget 0.25 -o "$OUT" --overwrite "$@"
if [ ! -f "$DATA/wiki.test.raw" ]; then
  echo "converted to $OUT; no evaluation text at $DATA (set SHARED to the folder holding data/wikitext-2)" >&2
  exit 0
fi
$MLA eval --data "$DATA/wiki.test.raw" --seq-len 2048 --windows 16
$MLA eval "$OUT" --data "$DATA/wiki.test.raw" --seq-len 2048 --windows 16 --record
