#!/usr/bin/env bash
# The end-to-end grid on the real models (SmolLM2-135M-Instruct, smollm2-135m-bd and the
# shipped drafters), on this CPU, alone on the machine.  Two runs:
#   1. the machine's default dtype (bf16 on CPUs with native bf16 matmul): speed, forwards,
#      acceptance, accuracy;
#   2. fp32: the lossless check (same_as_reference must be 1.0 for every lossless method);
#   and with E2E_GRIDS naming them (comma-separated):
#   t1      the same grid sampled at T = 1 (seed 0): acceptance under sampling;
#   batch8  the same grid with 8 prompts per generate call: batched tokens/s.
#   E2E_CONFIGS (comma-separated) replaces the default configuration list below.
# Usage: [E2E_GRIDS=t1,batch8] [E2E_CONFIGS=...] bash bench/e2e_smollm2.sh [PROMPTS_PER_SET] [MAX_NEW_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
N=${1:-4}
T=${2:-64}
CONFIGS=${E2E_CONFIGS:-ar,diffusion-static-1,diffusion-dynamic,ssd,ssd-d3,spiffy,spiffy-p8,s2d2-always,s2d2-min_span,s2d2-noredraft,diffuspec,diffuspec-paper,diffuspec-d8,diffuspec-noCPS-noADL,diffuspec-nolookup,dflash,dflash-adaptive,dflash-full,dflash-chain,dflash-tree,dflash-tree7,dflash-nolookup,d2sd-K1,d2sd-K2,d2sd-K4,d2sd-adaptive-K2,d2sd-full-K2,d2sd-nolookup-K2,d2sd-chain-K2,d2sd-auto,d2sd-resample-K2}
"$PY" -m dspec bench --dllm smollm2-135m-bd --target smollm2-135m --configs "$CONFIGS" \
    --prompt-sets arithmetic,humaneval,mtbench,math500 --prompts "$N" --max-new-tokens "$T" \
    --threads 2 --out bench/results/cpu --name e2e_smollm2
"$PY" -m dspec bench --dllm smollm2-135m-bd --target smollm2-135m --dtype float32 \
    --configs ar,diffusion-static-1,ssd,s2d2-always,diffuspec,dflash,dflash-chain,d2sd-K2 \
    --prompt-sets humaneval,mtbench --prompts 2 --max-new-tokens 32 \
    --threads 2 --out bench/results/cpu --name e2e_smollm2_fp32
grids=${E2E_GRIDS:-}
for grid in ${grids//,/ }; do
    case "$grid" in
        t1) extra=(--temperature 1.0 --seed 0) ;;
        batch8) extra=(--batch 8) ;;
        *) echo "E2E_GRIDS: unknown grid $grid (t1, batch8)" >&2; exit 2 ;;
    esac
    "$PY" -m dspec bench --dllm smollm2-135m-bd --target smollm2-135m --configs "$CONFIGS" \
        --prompt-sets arithmetic,humaneval,mtbench,math500 --prompts "$N" --max-new-tokens "$T" \
        --threads 2 --out bench/results/cpu --name "e2e_smollm2_$grid" "${extra[@]}"
done
