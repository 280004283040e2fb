#!/usr/bin/env bash
# Every CUDA claim of this repo in one command, for a machine with an NVIDIA GPU (a few minutes on an H200):
#
#   bash engines/fast/gpu_check.sh [OUT_DIR]        # default OUT_DIR: gpu_check.out
#   ALSO_64=1 bash engines/fast/gpu_check.sh        # and the serving trace with 64 clients, last
#
# Each stage runs under a timeout of its own, its output written to OUT_DIR/STAGE.log as it comes (and its
# tail printed), a failed stage not stopping the rest; the script ends with one PASS/FAIL line per stage and
# exits 1 if any failed. The stages: the decode step's tokens on CUDA equal to cached.py's on the CPU, eager,
# captured and compiled (float32, TF32 off) and FastEngine's tok/s against its targets (engines/fast/cuda_check.py);
# the lesson's commands on cuda; the serving engine's 16 chats, each request equal to the Engine alone at
# float32 (engines/serving/check.py, compiled and captured), and at bfloat16 where they part; serve.py on cuda
# under the saturated serving trace (engines/bench/serving.py, beside the Engine one request at a time);
# bench.py's tables 0, 2, 4 and 5 on cuda.
set -u
cd "$(dirname "$0")/.."
out=${1:-gpu_check.out}
mkdir -p "$out"
py=$(command -v python || command -v python3)
export PYTHONUNBUFFERED=1
results=()

stage() {  # NAME SECONDS COMMAND...
    local name=$1 seconds=$2 status
    shift 2
    echo "== $name (at most ${seconds} s): $*"
    timeout --kill-after=10 "$seconds" "$@" >"$out/$name.log" 2>&1
    status=$?
    tail -n 20 "$out/$name.log"
    if [ "$status" -eq 0 ]; then
        results+=("PASS $name")
    elif [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        results+=("FAIL $name: past its ${seconds} s ($out/$name.log)")
    else
        results+=("FAIL $name: exit status $status ($out/$name.log)")
    fi
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
stage cuda_tokens_and_speed 150 "$py" -m engines.fast.cuda_check --json "$out/cuda_check.json"
stage lesson_on_cuda 60 sh -c "$py cached.py --device cuda && $py prefill_clone.py --device cuda && \
$py sample_grid.py --device cuda"
stage serving_check_float32 120 "$py" -m engines.serving.check --device cuda --compile --chats 16
stage serving_check_bfloat16 90 "$py" -m engines.serving.check --device cuda --chats 16 --dtype bfloat16
stage serve_saturated 150 "$py" -m engines.bench.serving --device cuda --rate 50 --think 0.05 --skip llama-server \
    --json "$out/serving.json"
stage bench_post 60 "$py" bench.py cuda --tokens 64 256
stage bench_tables 150 "$py" -m engines.bench cuda --tables 4,5 --tokens 64 256 --json "$out/bench.json"
if [ -n "${ALSO_64:-}" ]; then
    stage serve_64_clients 150 "$py" -m engines.bench.serving --device cuda --rate 50 --think 0.05 --clients 64 \
        --skip llama-server,engine --json "$out/serving64.json"
fi

echo "== results"
printf '%s\n' "${results[@]}" | tee "$out/results.txt"
! grep -q '^FAIL' "$out/results.txt"
