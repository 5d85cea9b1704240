#!/usr/bin/env bash
# One-call GPU suite: build dspec._C, run the tests, run every benchmark, summarise.
#
#   bash bench/gpu_suite.sh OUT_DIR
#
# Meant for the GPU machine (H100/H200, Python 3.12, no internet, <= 10 min per call).
# Everything lands flat in OUT_DIR (the device returns at most 8 files):
#   suite.log     everything this script printed (build output included)
#   tests.log     pytest output
#   summary.md    markdown tables (bench/summarize.py)
#   results.json  every bench's JSON combined (raw per-rep timings dropped)
#   token_stats.png, verify.png, cascade_attention.png, topk.png   (8 files in all: the
#                 limit; boundary is launch-bound, its numbers are in summary.md, no PNG)
# Steps keep going after a failure; failures are listed at the end and the exit status is
# the number of failed steps.  Every step runs under `timeout`, clipped so that the whole
# suite ends within SUITE_BUDGET seconds (default 540).
#
# Environment knobs:
#   SUITE_BUDGET=540      total seconds
#   DSPEC_CUDA_ARCHS=90   CUDA archs for the nvcc build (default: 90)
#   SKIP_BUILD=1 SKIP_TESTS=1 SKIP_BENCH=1   skip a part
#   TEST_ARGS="..."       extra pytest args (default: --maxfail=25)
#   TESTS_CAP=seconds     the tests' time cap (default 180, or 520 with SKIP_BENCH=1)
# Before the first call: `bash bench/device_pack.sh out` (the device takes a 64 MiB tree; the
# SmolLM2 assets, data/ and CPU results are ~130 MB), and `bash bench/device_pack.sh back` after.
# A first run on a fresh GPU machine should make two calls: SKIP_BENCH=1 (tests, up to ~9 min), then
# SKIP_TESTS=1 (benchmarks); each rebuilds dspec._C (the machine starts bare).
#   BENCH_ARGS="..."      extra args for every bench_*.py (e.g. --quick, --reps 10)
#   BENCHES="token_stats verify cascade_attention boundary topk"   which benches, in order
#                         (verify and cascade_attention come early: their headlines have
#                         targets; boundary / topk may be cut by the budget)
#   PLOTS="token_stats,verify,cascade_attention,topk"   benches that get a PNG (PLOTS=all:
#                         every bench, which can exceed the 8 files the device returns)
#   BENCH_DEVICE=cuda     device for the benches (cpu: dry-run this script on a CPU box)
set -u -o pipefail

OUT_DIR=${1:-${OUT:-}}
if [ -z "$OUT_DIR" ]; then
  echo "usage: bash bench/gpu_suite.sh OUT_DIR" >&2
  exit 2
fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2

SUITE_BUDGET=${SUITE_BUDGET:-540}
START=$SECONDS
STAGE=$(mktemp -d /tmp/dspec_bench.XXXXXX)
FAILED=()
PY=$(command -v python || command -v python3)
export PYTHONUNBUFFERED=1

exec > >(tee -a "$OUT_DIR/suite.log") 2>&1

left() { echo $(( SUITE_BUDGET - (SECONDS - START) )); }

# step NAME CAP RESERVE CMD...: run CMD under timeout min(CAP, time left - RESERVE)
step() {
  local name=$1 cap=$2 reserve=$3
  shift 3
  local limit
  limit=$(( $(left) - reserve ))
  [ "$limit" -gt "$cap" ] && limit=$cap
  if [ "$limit" -lt 10 ]; then
    echo "=== [$name] SKIPPED: out of time budget"
    FAILED+=("$name(no-time)")
    return 0
  fi
  echo
  echo "=== [$name] $(date +%T) timeout ${limit}s (t=$((SECONDS - START))s): $*"
  local t0=$SECONDS rc
  timeout --signal=TERM --kill-after=15 "$limit" "$@"
  rc=$?
  echo "=== [$name] rc=$rc in $((SECONDS - t0))s"
  if [ "$rc" -ne 0 ]; then
    [ "$rc" -eq 124 ] && FAILED+=("$name(timeout)") || FAILED+=("$name(rc=$rc)")
  fi
  return 0
}

echo "=== dspec GPU suite: $(date -u +%FT%TZ) on $(hostname) in $REPO -> $OUT_DIR"
nvidia-smi || echo "(nvidia-smi failed)"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
command -v nvcc >/dev/null && nvcc --version | tail -n 2
echo "python: $PY ($($PY --version 2>&1))"
$PY - <<'EOF' || true
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("gpu", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
try:
    import triton
    print("triton", triton.__version__)
except Exception as exc:
    print("triton missing:", exc)
try:
    import flashinfer
    print("flashinfer", getattr(flashinfer, "__version__", "?"))
except Exception as exc:
    print("flashinfer unavailable (bench_verify / bench_cascade_attention skip it):", exc)
EOF
git -C "$REPO" rev-parse HEAD 2>/dev/null || echo "(no git commit)"

# ---- optional wheels carried in .whl/ -------------------------------------------------
if [ -d "$REPO/.whl" ] && ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  step wheels 120 300 "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade \
    --target /tmp/site "$REPO"/.whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

# ---- build dspec._C -------------------------------------------------------------------
export DSPEC_CUDA_ARCHS=${DSPEC_CUDA_ARCHS:-90}
if [ "${SKIP_BUILD:-0}" != "1" ]; then
  if [ -f "$REPO/pyproject.toml" ] || [ -f "$REPO/setup.py" ]; then
    n_failed=${#FAILED[@]}
    step build 240 240 "$PY" -m pip install --no-build-isolation --no-deps -v -e .
    if [ "${#FAILED[@]}" -gt "$n_failed" ]; then
      # pip itself failed (e.g. no setuptools/wheel for an editable install): build the
      # extension in place with the same CMake build tree instead
      step build_inplace 180 240 "$PY" setup.py build_ext --inplace
    fi
  else
    echo "=== [build] no pyproject.toml/setup.py: nothing to build"
    FAILED+=("build(no-project)")
  fi
fi
# dspec must import; fall back to the source tree (pure Python + Triton) if the install
# did not provide it.  (Not unconditionally: it could shadow an editable install's _C.)
if ! (cd /tmp && "$PY" -c "import dspec" 2>/dev/null); then
  echo "dspec not importable after install: using PYTHONPATH=$REPO"
  export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
fi
(cd /tmp && "$PY" - <<'EOF') || FAILED+=("import")
import dspec
from dspec import _backend as b
print("dspec from", dspec.__file__)
print("dspec._C: cpp_available", b.cpp_available(), "cuda_available", b.cuda_available())
EOF

# ---- tests ----------------------------------------------------------------------------
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  # reserve time for the benches and the summary, unless this call runs the tests only
  if [ "${SKIP_BENCH:-0}" = "1" ]; then tests_cap=${TESTS_CAP:-520}; tests_reserve=10
  else tests_cap=${TESTS_CAP:-180}; tests_reserve=200; fi
  step tests "$tests_cap" "$tests_reserve" bash -c "set -o pipefail; '$PY' -m pytest -q -p no:cacheprovider tests ${TEST_ARGS:---maxfail=25} \
    > '$OUT_DIR/tests.log' 2>&1; rc=\$?; tail -n 25 '$OUT_DIR/tests.log'; exit \$rc"
fi

# ---- benchmarks -------------------------------------------------------------------------
if [ "${SKIP_BENCH:-0}" != "1" ]; then
  BENCHES=${BENCHES:-token_stats verify cascade_attention boundary topk}
  for b in $BENCHES; do
    # reserve: seconds kept for the steps after this one (later benches + summarize)
    case $b in
      token_stats)       cap=170; reserve=160 ;;
      verify)            cap=170; reserve=120 ;;
      cascade_attention) cap=170; reserve=70 ;;
      boundary)          cap=70;  reserve=45 ;;
      *)                 cap=170; reserve=25 ;;
    esac
    # shellcheck disable=SC2086
    step "bench_$b" $cap $reserve "$PY" bench/bench_$b.py --device "${BENCH_DEVICE:-cuda}" --out "$STAGE" \
      --no-plot ${BENCH_ARGS:-}
  done
  # JSON + PNGs from the staging dir, flat into OUT_DIR
  PLOTS=${PLOTS:-token_stats,verify,cascade_attention,topk}
  plot_arg=(--plots "$PLOTS")
  [ "$PLOTS" = all ] && plot_arg=()
  step summarize 60 0 "$PY" bench/summarize.py "$STAGE" --out "$OUT_DIR" ${plot_arg[@]+"${plot_arg[@]}"}
fi

echo
echo "=== files in $OUT_DIR:"; ls -la "$OUT_DIR"
echo "=== suite done in $((SECONDS - START))s; failed steps: ${FAILED[*]:-none}"
exit ${#FAILED[@]}
