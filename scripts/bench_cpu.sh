#!/usr/bin/env bash
# The CPU numbers of docs/benchmarks.md: decode speed, memory and generation throughput, JSON and PNG under docs/bench/.
# Each run waits until the 1-minute load average is below $MAX_LOAD (default 0.7; shared machines are noisy) and
# records the load it started at. Usage: scripts/bench_cpu.sh [PYTHON]
set -euo pipefail
PY=${1:-python}
OUT=docs/bench
MAX_LOAD=${MAX_LOAD:-0.7}
mkdir -p "$OUT"

quiet() {  # wait for a quiet machine, then print the load average
  while awk -v m="$MAX_LOAD" '{exit !($1 >= m)}' /proc/loadavg; do sleep 20; done
  cut -d' ' -f1-3 /proc/loadavg
}

run() {  # run NAME ARGS...: kivi-jax bench ARGS --json > $OUT/NAME.json, the load beside it
  local name=$1; shift
  echo "load before $name: $(quiet)" | tee -a "$OUT/loadavg.txt"
  "$PY" -m kivi_jax.cli bench "$@" --json > "$OUT/$name.json"
  echo "load after  $name: $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
}

mem() {  # memory numbers are compile-time analysis: no need to wait for a quiet machine
  local name=$1; shift
  "$PY" -m kivi_jax.cli bench "$@" --json > "$OUT/$name.json"
}

date -u +"%Y-%m-%dT%H:%MZ" > "$OUT/loadavg.txt"
run decode_smollm2 decode --model smollm2 --contexts 1024,4096,8192,16384 --batch 1,8 --cache full,kivi2,kivi4 \
  --attention-impl xla --plot "$OUT/decode_smollm2.png"
run decode_llama2-7b_2layers decode --model llama2-7b --layers 2 --contexts 1024,4096 --batch 1,8 \
  --cache full,kivi2,kivi4 --attention-impl xla --plot "$OUT/decode_llama2-7b_2layers.png"
run decode_llama3-8b_2layers decode --model llama3-8b --layers 2 --contexts 1024,4096 --batch 1,8 \
  --cache full,kivi2,kivi4 --attention-impl xla --plot "$OUT/decode_llama3-8b_2layers.png"
mem memory_llama2-7b_4096_80GB memory --model llama2-7b --context 4096 --budget 80GB --dtype bfloat16 \
  --cache full,kivi2,kivi4,k4v2-g32-r128 --plot "$OUT/memory_llama2-7b.png"
mem memory_llama2-7b_32768_80GB memory --model llama2-7b --context 32768 --budget 80GB --dtype bfloat16 \
  --cache full,kivi2,kivi4,k4v2-g32-r128
mem memory_llama2-7b_4096_24GiB memory --model llama2-7b --context 4096 --budget 24GiB --dtype bfloat16 \
  --cache full,kivi2,kivi4 --no-temps
mem memory_llama2-7b_8192_f32 memory --model llama2-7b --context 8192 --budget 80GB --dtype float32 \
  --cache full,kivi2,kivi4
mem memory_llama3-8b_4096_80GB memory --model llama3-8b --context 4096 --budget 80GB --dtype bfloat16 \
  --cache full,kivi2,kivi4
mem memory_smollm2_8192_24GiB memory --model smollm2 --context 8192 --budget 24GiB --dtype bfloat16 \
  --cache full,kivi2,kivi4 --plot "$OUT/memory_smollm2.png"
mem memory_smollm2_8192_f32 memory --model smollm2 --context 8192 --budget 24GiB --dtype float32 \
  --cache full,kivi2,kivi4
run generate_smollm2 generate --model smollm2 --batch 1,4,16 --prompt-len 256 --new-tokens 64 \
  --cache full,kivi2,kivi4 --attention-impl xla --plot "$OUT/generate_smollm2.png"
