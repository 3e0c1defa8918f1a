# Sourced by the GPU scripts (gpu_checks.sh, gpu_finetune.sh): one timed step of a prepared run.
step() {  # step NAME SECONDS COMMAND...: run with a time limit, say how it ended and how long it took
    local name=$1 limit=$2 start=$SECONDS status
    shift 2
    echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    timeout "$limit" "$@"
    status=$?
    echo "=== $name: exit $status after $((SECONDS - start))s"
    return $status
}
