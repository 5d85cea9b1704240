#!/usr/bin/env bash
# Every model-level CPU benchmark in one call, alone on the machine, in the order the
# docs/performance.md reads them: the projection kernel, forward cost vs N, `ar`
# against transformers (and llama.cpp when installed), cascade attention, the logits-side
# ops, the thread policy and bf16 rounding.  JSON + PNG under bench/results/cpu/; a log per
# script under $LOGS.  Usage: bash bench/cpu_suite.sh [THREADS]   (~25 min on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
T=${1:-2}
LOGS=${LOGS:-/tmp/dspec_cpu_suite}
mkdir -p "$LOGS"
run() {
    local name=$1; shift
    echo "== $name: $* ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
    "$PY" "$@" > "$LOGS/$name.log" 2>&1 || { echo "   FAILED: see $LOGS/$name.log"; return 1; }
    tail -n 3 "$LOGS/$name.log" | sed 's/^/   /'
}
export OMP_NUM_THREADS=$T DSPEC_NUM_THREADS=$T
run linear bench/bench_linear.py --device cpu --reps 15
run forward bench/bench_forward.py --threads "$T"
run ar bench/bench_ar.py --threads "$T" --calls 3
run cascade bench/bench_cascade_attention.py --device cpu --threads "$T"
run logits bench/bench_logits_cpu.py --threads "$T"
run threads bench/bench_threads.py
run rounding bench/bench_rounding.py --threads "$T"
