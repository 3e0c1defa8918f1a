#!/usr/bin/env bash
# The frontier (benchmarks/frontier/frontier.{json,md,png}) from one command: every conversion it plots is made if
# its folder is missing (the commands below; `--dry-run` on each estimates its time), then every point the table lacks is measured
# (`--keep`): the source and the `--target deepseek` conversions (one fine-tuned) in llama.cpp itself at its cache types (their
# GGUFs exported by run.py), and every conversion simulated in transformers with ggml's rounding.
#   bash benchmarks/frontier/make.sh            (from the repository root; scripts/install-llamacpp.sh first)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
CONVERT=${MLA_CONVERT:-.venv/bin/mla-convert}

convert() {  # FOLDER ARGS...: the conversion, unless its folder is complete
  local folder=$1
  shift
  [ -f "$folder/config.json" ] || "$CONVERT" llama "$@" -o "$folder"
}
convert out/qc-slots --kv-budget 0.25                          # the main job: 25% of the 16-bit bytes
convert out/kv256 --kv-budget 256 --cache-type q8_0            # 66.7%: the quarter line's best point in q5_1
convert out/ds25 --kv-budget 0.25 --target deepseek             # the main job as llama.cpp serves it
convert out/ds125 --kv-bytes 0.125 --target deepseek            # an eighth of the bytes, as llama.cpp serves it
# the eighth fine-tuned through its iq4_nl cache (recipes/smollm2-135m-eighth.yaml; 55 min on 2 cores)
[ -f runs/ds125-kd/final/config.json ] || "$CONVERT" finetune --config recipes/smollm2-135m-eighth.yaml \
  model=out/ds125 output=runs/ds125-kd

TYPES=f16+q8_0+q5_1+q5_0+q4_1+q4_0+iq4_nl
exec "$PY" benchmarks/frontier/run.py --windows 2 --keep --source-types f16 --unrotated-types "" --bases native \
  --gguf "source=auto@$TYPES,ds25=out/ds25@$TYPES,ds125=out/ds125@$TYPES,ds125kd=runs/ds125-kd/final@$TYPES" \
  --models "ds25=out/ds25@f16+q8_0+q4_1+q4_0+iq4_nl,ds125=out/ds125@f16+q4_0+iq4_nl,ds125kd=runs/ds125-kd/final@iq4_nl+q4_0,main25=out/qc-slots@f16+q8_0,kv256=out/kv256@f16+q5_1" \
  "$@"
